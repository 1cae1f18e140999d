"""Does `mx.slice_update` of a large backing copy it, eager or inside `mx.compile`, when the
caller keeps no other reference? 200 one-row updates of an [n, 512] bf16 backing, µs each."""

import time

import mlx.core as mx


def f(b, idx, v):
    return mx.slice_update(b, v, idx, axes=(0,))


cf = mx.compile(f)
for n in (8192, 262144):
    b = mx.zeros((n, 512), mx.bfloat16)
    v = mx.ones((1, 512), mx.bfloat16)
    mx.eval(b, v)
    for name, fn in (("eager", f), ("compiled", cf)):
        bb = mx.array(b)
        mx.eval(bb)
        t0 = time.perf_counter()
        for i in range(200):
            bb = fn(bb, mx.array([i % n]), v)
            mx.eval(bb)
        print(f"rows {n} {name}: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us per update")
