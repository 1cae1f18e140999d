import statistics
import time

import mlx.core as mx

cap = 131072 + 512
d = 256
keys = mx.random.normal((1, 2, cap, d)).astype(mx.bfloat16)
vals = mx.random.normal((1, 2, cap, d)).astype(mx.bfloat16)
q = mx.random.normal((1, 24, 1, d)).astype(mx.bfloat16)
idx = mx.sort(mx.random.randint(0, cap, (2052,))).astype(mx.int32)
mx.eval(keys, vals, q, idx)


def t(name, f, n=7):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        mx.eval(f())
        ts.append((time.perf_counter() - t0) * 1e3)
    print(f"{name}: {statistics.median(ts):.3f} ms")


t("take axis2", lambda: mx.take(keys, idx, axis=2))
t("take axis2 x2", lambda: [mx.take(keys, idx, axis=2), mx.take(vals, idx, axis=2)])
k3 = keys.reshape(2, cap, d)
t("take 3d axis1", lambda: mx.take(k3, idx, axis=1))
t("index k3[:, idx]", lambda: k3[:, idx])
kk = mx.take(keys, idx, axis=2).reshape(2, 1, 2052, d)
mx.eval(kk)
qg = q[0].reshape(2, 12, 1, d).transpose(0, 2, 1, 3)
t("matmul qk bf16", lambda: mx.matmul(qg, kk.swapaxes(-1, -2)))
t("matmul qk f32", lambda: mx.matmul(qg.astype(mx.float32), kk.swapaxes(-1, -2).astype(mx.float32)))
p = mx.softmax(mx.random.normal((2, 1, 12, 2052)), axis=-1).astype(mx.bfloat16)
mx.eval(p)
t("matmul pv bf16", lambda: mx.matmul(p, kk))
kf = kk.astype(mx.float32)
qf = qg.astype(mx.float32)
mx.eval(kf, qf)
t("matmul qk f32 preconv", lambda: mx.matmul(qf, kf.swapaxes(-1, -2)))
kfT = mx.contiguous(kf.swapaxes(-1, -2))
mx.eval(kfT)
t("matmul qk f32 contiguous T", lambda: mx.matmul(qf, kfT))
t("astype kk f32", lambda: kk.astype(mx.float32))
t("qk via multiply-sum f32", lambda: (qf[:, :, :, None, :] * kf[:, :, None, :, :]).sum(-1))
t("qk bf16 as (k @ q^T)", lambda: mx.matmul(kk, qg.swapaxes(-1, -2)))
pf = p.astype(mx.float32)
mx.eval(pf)
t("pv f32 preconv", lambda: mx.matmul(pf, kf))
print(mx.__version__)
