import statistics
import time

import mlx.core as mx

d = 256


def t(f, n=7):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        mx.eval(f())
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


for cap in (32768 + 512, 131072 + 512):
    keys = mx.random.normal((1, 2, cap, d)).astype(mx.bfloat16)
    idx = mx.sort(mx.random.randint(0, cap, (2052,))).astype(mx.int32)
    mx.eval(keys, idx)
    a = mx.take(keys, idx, axis=2)
    b = keys[:, :, idx]
    mx.eval(a, b)
    print(
        cap,
        "equal",
        mx.array_equal(a, b).item(),
        a.shape,
        b.shape,
        f"take {t(lambda k=keys, i=idx: mx.take(k, i, axis=2)):.3f} ms,",
        f"getitem {t(lambda k=keys, i=idx: k[:, :, i]):.3f} ms",
    )
