"""Command line of ``spec-bench``: ``spec-bench [numerics | gpu-check | profile | tune | compile | gemm] [OPTIONS]``.

A dispatch table: the first argument names a subcommand module whose ``main(argv)`` runs; anything
else goes to ``side_by_side`` (the end-to-end benchmark). Modules load on use, and none imports this
one back: shared argument helpers live in ``spec_decode.bench.args``.
"""

from __future__ import annotations

import importlib
import sys

from spec_decode.bench.args import missing_bench_extra

SUBCOMMANDS = {
    "numerics": "spec_decode.bench.numerics_bench",
    "gpu-check": "spec_decode.bench.gpu_check",
    "profile": "spec_decode.bench.profile_step",
    "tune": "spec_decode.bench.tune",
    "compile": "spec_decode.bench.compile_ab",
    "gemm": "spec_decode.bench.gemm",
}
DEFAULT_COMMAND = "spec_decode.bench.side_by_side"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``spec-bench`` and ``python -m spec_decode.bench``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    missing = None if {"-h", "--help"} & set(argv) else missing_bench_extra()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    return importlib.import_module(DEFAULT_COMMAND).main(argv)
