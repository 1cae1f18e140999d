"""`mlx-qsa` command line: a thin argparse front over `trace`, `sweep` and `bench`.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. Only the
module of the chosen subcommand is imported (the sweep sets MLX variables before MLX loads).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "trace": ("mlx_qsa.trace", "run the trace profiles and write records in the reference schema"),
    "sweep": ("mlx_qsa.sweep", "GEMM tile sweep in the reference schema"),
    "bench": ("mlx_qsa.bench", "decode / prefill / prompt timings of one layer beside its peers"),
}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-qsa", description="QSA attention for MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == selected:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
