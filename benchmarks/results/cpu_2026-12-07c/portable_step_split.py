import statistics
import time

import mlx.core as mx

from mlx_qsa import bench
from mlx_qsa.config import QSAConfig

cfg = QSAConfig()
for T in (32768, 131072):
    s = bench.DecodeSet(cfg, T, 1, 0)
    mx.eval(s.index_q, s.pooled, s.q, s.keys, s.values)

    def sel(s=s):
        keys_t = s.pooled[0].astype(mx.float32).T
        out = bench.step_selector(1)(
            s.index_q,
            keys_t,
            bench.block_penalty(keys_t.shape[1]),
            s.positions,
            4,
            512,
            1,
            s.pooled,
            "portable",
        )
        return out

    def full(s=s):
        return bench.qsa_step(cfg, s, "portable")[0]

    out = sel()
    mx.eval(out)
    selection = bench.step_selection(cfg, s, out)

    def att(s=s, selection=selection):
        return bench.step_attention(cfg, s, selection, "portable")

    for name, f in (("selection", sel), ("attention", att), ("both", full)):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            mx.eval(f())
            ts.append((time.perf_counter() - t0) * 1e3)
        print(T, name, f"{statistics.median(ts):.2f} ms")
