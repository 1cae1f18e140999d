import time

import mlx.core as mx

a = mx.random.normal((1, 2560)).astype(mx.bfloat16)
w = mx.random.normal((12288, 2560)).astype(mx.bfloat16)
mx.eval(a, w)
for _ in range(2):
    mx.eval(a @ w.T)
t0 = time.perf_counter()
for _ in range(5):
    mx.eval(a @ w.T)
print("bf16 1x2560 @ 2560x12288:", (time.perf_counter() - t0) / 5 * 1e3, "ms")
