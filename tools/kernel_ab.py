"""The invariant panel kernel of two source trees, in one process: one forward's projections of
SmolLM2-135M-Instruct (its own weights, bf16 or float32 panels), the two builds' passes alternated, the
median of each per row count, on the AVX2 path.

    taskset -c 1 python tools/kernel_ab.py BASE_TREE NEW_TREE --rows 2,3,4,7,8,9 --dtype bf16 --passes 41

Each tree's kernel is built (or found) in the cache by that tree's own ``cpu_gemm``; both take the panels
this tree packs, whose layout the trees share. docs/performance.md keeps the figures.
"""
import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from spec_decode.bench.gemm import forward_panels
from spec_decode.cpu.cpu_gemm import panel_linear_functions
from spec_decode.fixtures import smollm2_target_dir
from spec_decode.models import Transformer


def built_kernel(tree: Path) -> str:
    """The path of ``tree``'s compiled kernel, built by that tree's own ``cpu_gemm`` (in a subprocess)."""
    code = "from spec_decode.cpu import cpu_gemm; print(cpu_gemm._build())"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)),
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def load(path: str, dtype: torch.dtype):
    """The kernel's entry point for ``dtype`` inputs, on the AVX2 path."""
    lib = ctypes.CDLL(path)
    lib.safespec_panel_isa(1)
    fp32, bf16 = panel_linear_functions(lib)
    return bf16 if dtype is torch.bfloat16 else fp32


def one_pass(fn, panels, rows: int, xs: dict, ys: dict) -> float:
    """Seconds of every projection of one forward over ``rows`` rows."""
    start = time.perf_counter()
    for p in panels:
        fn(rows, p.in_features, p.out_features, xs[p.in_features].data_ptr(), p._panels_ptr, p._panels_bf16,
           None, ys[p.out_features].data_ptr())
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,12")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--passes", type=int, default=41)
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    fns = [load(built_kernel(tree), dtype) for tree in (args.base, args.new)]
    panels = forward_panels(Transformer.from_pretrained(smollm2_target_dir(), dtype=dtype), dtype)
    torch.manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).to(dtype) for k in {p.in_features for p in panels}}
        ys = {n: torch.empty(rows, n, dtype=dtype) for n in {p.out_features for p in panels}}
        times: list[list[float]] = [[], []]
        for i in range(args.passes):
            for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                times[j].append(one_pass(fns[j], panels, rows, xs, ys))
        base, new = (statistics.median(t) * 1e3 for t in times)
        print(f"rows {rows:3d}  base {base:7.2f} ms  new {new:7.2f} ms  new/base {new / base:.3f}", flush=True)


if __name__ == "__main__":
    main()
