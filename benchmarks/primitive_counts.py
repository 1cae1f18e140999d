"""MLX primitives of one decode step at 32K, counted from the unevaluated graph
(`bench.primitive_counts`): the whole layer and selection + attention, portable path.

Usage: python3 benchmarks/primitive_counts.py
"""

from __future__ import annotations

import mlx.core as mx

from mlx_qsa import bench
from mlx_qsa.config import QSAConfig, QSAOptions
from mlx_qsa.layer import QSAAttention
from mlx_qsa.rope import text_rope


def main() -> None:
    cfg = QSAConfig()
    mx.random.seed(0)
    layer = QSAAttention(cfg, options=QSAOptions(kernels="portable"), fused=4)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    for T, rows in ((32768, 1), (32768, 4)):
        cache = bench.random_cache(layer, T, rows, 0)
        x = bench.layer_rows(cfg, rows, 1)
        for _ in range(3):  # the last step runs with the compiled core warm
            text_rope.cache_clear()  # the step makes its own RoPE tables (a first layer)
            y = layer(x, cache=cache)
            counts = bench.primitive_counts(y, *cache.state)
            mx.eval(y, *cache.state)
            cache.trim(rows)
        print(f"T={T} rows={rows} layer step {counts['total']} {layer.last_call.consumers}")
        print("  ", counts["by_kind"])
        y = layer(x, cache=cache)  # a later layer at the same step: the tables are shared
        shared = bench.primitive_counts(y, *cache.state)["total"]
        mx.eval(y, *cache.state)
        cache.trim(rows)
        print(f"T={T} rows={rows} layer step, tables already made this step: {shared}")
        out, _ = bench.qsa_step(cfg, bench.DecodeSet(cfg, T, rows, 0), "portable")
        counts = bench.primitive_counts(out)
        print(f"T={T} rows={rows} selection + attention {counts['total']}")
        print("  ", counts["by_kind"])


if __name__ == "__main__":
    main()
