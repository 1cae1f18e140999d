import time

import mlx.core as mx

for n in (256, 1024):
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a, b)
    for _ in range(2):
        mx.eval(a @ b)
    t0 = time.perf_counter()
    for _ in range(5):
        mx.eval(a @ b)
    dt = (time.perf_counter() - t0) / 5
    print(n, f"{dt * 1e3:.2f} ms {2 * n**3 / dt / 1e9:.1f} GFLOP/s")
