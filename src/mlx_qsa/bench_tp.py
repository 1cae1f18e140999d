"""`mlx-qsa bench decode|prefill --tp 1,2,4,8`: the tensor-parallel scaling run (issue 11).

With several group sizes, `bench` coordinates: for each size N it starts one process per rank
through MLX's launcher (`mlx._distributed_utils.launch`, what `mlx.launch` runs; NCCL on CUDA
hosts, else the ring backend over localhost) running `bench ... --tp N`, keeps rank 0's document,
and puts the sizes side by side: time per step per layer, speedup over the smallest size, the
`all_sum` of the layer's output timed alone, the bytes it moves and each rank's K/V bytes.
NVLink multicast stays off in every rank (`NCCL_NVLS_ENABLE=0`, also passed through the
launcher, which builds each rank's environment itself).

The plan (commands, the table) is pure Python; `run_scaling` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

LAUNCH = (
    "import sys; from mlx._distributed_utils.launch import main; "
    "sys.argv[0] = 'mlx.launch'; sys.exit(main())"
)


def child_argv(args: argparse.Namespace, n: int, out: Path) -> list[str]:
    """The `bench` arguments each rank of the size-`n` run gets."""
    argv = [args.mode, "--tp", str(n), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    if args.contexts is not None:
        argv += ["--contexts", ",".join(str(c) for c in args.contexts)]
    if args.mode == "decode":
        argv += ["--rows", ",".join(str(r) for r in args.rows)]
    else:
        argv += ["--chunk", str(args.chunk)]
    return argv + ["--out", str(out)]


def launch_command(
    n: int, backend: str, argv: list[str], port: int | None = None, python: str | None = None
) -> list[str]:
    """One process per rank for `n` ranks running `python -m mlx_qsa bench <argv>`. A ring of
    one is not launched (MLX 0.32.4's ring launcher fails to start one rank): that process runs
    alone, in the singleton group."""
    if backend not in ("ring", "nccl"):
        raise ValueError(f"launch_command(backend): expected 'ring' or 'nccl', got {backend!r}")
    if n < 1:
        raise ValueError(f"launch_command(n): expected a group size >= 1, got {n}")
    py = python or sys.executable
    if backend == "ring" and n == 1:
        return [py, "-m", "mlx_qsa", "bench", *argv]
    cmd = [py, "-c", LAUNCH, "--backend", backend, "-n", str(n)]
    if port is not None:
        cmd += ["-p" if backend == "ring" else "--nccl-port", str(port)]
    cmd += ["--env", "NCCL_NVLS_ENABLE=0"]
    if os.environ.get("PYTHONPATH"):
        cmd += ["--env", f"PYTHONPATH={os.environ['PYTHONPATH']}"]
    return cmd + ["--", py, "-m", "mlx_qsa", "bench", *argv]


def scaling_table(mode: str, runs: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (context, rows) and group size: the step, its speedup over the smallest size, the
    all_sum alone; for decode also step / (smallest size's step + this size's all_sum), the
    issue's bound (<= 1 meets it)."""
    sizes = sorted(runs)
    base = {(p["context"], p["rows"]): p for p in runs[sizes[0]]["points"]}
    table = []
    for n in sizes:
        for p in runs[n]["points"]:
            key = (p["context"], p["rows"])
            b = base.get(key)
            step, all_sum = p["step"]["median_us"], p["all_sum"]["median_us"]
            row = {
                "tp": n,
                "context": p["context"],
                "rows": p["rows"],
                "step_us": step,
                "all_sum_us": all_sum,
                "all_sum_bytes": p["all_sum_bytes"],
                "rank_kv_bytes": p["rank_kv_bytes"],
                "rel_err_vs_unsharded": p["rel_err_vs_unsharded"],
                "speedup": b["step"]["median_us"] / step if b else None,
            }
            if mode == "decode" and b:
                row["step_over_base_plus_all_sum"] = step / (b["step"]["median_us"] + all_sum)
            table.append(row)
    return table


def free_base_port(n: int) -> int:
    """A base port with n consecutive free local ports (the ring backend uses base + rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"no {n} consecutive free local ports")


def run_scaling(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """Every size of `args.tp` in its own launch; rank 0's documents and the table."""
    runs: dict[int, dict[str, Any]] = {}
    commands: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.tp:
            out = Path(tmp) / f"tp{n}.json"
            port = free_base_port(n) if backend == "ring" else None
            cmd = launch_command(n, backend, child_argv(args, n, out), port)
            commands[str(n)] = cmd
            print(f"bench --tp {n}: {backend}, {n} process(es)", flush=True)
            env = dict(os.environ, NCCL_NVLS_ENABLE="0")
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.tp_timeout, env=env
            )
            if proc.returncode != 0 or not out.exists():
                raise SystemExit(
                    f"bench --tp {n} ({backend}) failed with code {proc.returncode}:\n"
                    + proc.stdout[-2000:]
                    + proc.stderr[-2000:]
                )
            sys.stdout.write(proc.stdout)
            runs[n] = json.loads(out.read_text())
    return {
        "tp": list(args.tp),
        "launcher": {"backend": backend, "commands": commands},
        "runs": {
            str(n): {k: d[k] for k in ("tp", "points", "environment")} for n, d in runs.items()
        },
        "scaling": scaling_table(args.mode, runs),
    }
