"""Host time of building one CUDA layer decode step's graph, on any machine (no GPU): MLX's CUDA
availability and `mx.fast.cuda_kernel` are replaced by stand-ins (`host_build.stand_in_cuda`; a
stand-in kernel returns lazy zeros of its output shapes) and the layer resolves its kernels to
"cuda", so what is timed is our Python and the MLX ops it records for the CUDA route, not MLX's
kernel calls or evaluation. Both output-gate modes (fused into the attention kernel, and
`MLX_QSA_FUSE_GATE=0`) are built in turns, round by round.

    python3 benchmarks/layer_host_build.py [--context 131072] [--rows 1] [--rounds 20]
        [--steps 50] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import mlx.core as mx
from host_build import stand_in_cuda_layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    layer, cache, x = stand_in_cuda_layer(a.context, a.rows)
    from mlx_qsa.bench import decode_layer_step, set_switch

    def mode(fused: bool) -> None:
        set_switch("MLX_QSA_FUSE_GATE", None if fused else "0")

    step = decode_layer_step(layer, [x], [cache], a.rows)

    def build() -> mx.array:
        return step(0)

    for fused in (True, False):
        mode(fused)
        for _ in range(5):
            build()
        # (no primitive count here: the stand-in kernels' zeros are not the GPU's graph)
        print(f"{'fused' if fused else 'unfused'}: {layer.impl} {layer.last_call.consumers}")
    samples: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(a.rounds):
        for fused in (True, False):
            mode(fused)
            t0 = time.perf_counter()
            for _ in range(a.steps):
                build()
            samples[fused].append((time.perf_counter() - t0) / a.steps * 1e6)
    diffs = [f - u for f, u in zip(samples[True], samples[False], strict=True)]
    print(f"context {a.context}, rows {a.rows}, {a.rounds} rounds of {a.steps} builds, µs per "
          f"build (median): fused {statistics.median(samples[True]):.1f}, unfused "
          f"{statistics.median(samples[False]):.1f}; fused - unfused per round: median "
          f"{statistics.median(diffs):.1f}, fused faster in {sum(d < 0 for d in diffs)} of "
          f"{len(diffs)}")  # fmt: skip
    if a.profile:
        mode(True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.rounds * a.steps):
            build()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    mode(True)


if __name__ == "__main__":
    main()
