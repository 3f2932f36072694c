"""The invariant panel kernel of two source trees, in one process: one forward's projections of
SmolLM2-135M (random weights of its shapes, bf16 or float32 panels), the two builds' passes alternated,
the median of each per row count.

    taskset -c 1 python tools/kernel_ab.py BASE_TREE NEW_TREE --rows 2,3,4,7,8,9 --dtype bf16 --passes 41

Each tree's kernel is built (or found) in the cache by that tree's own ``cpu_gemm``; both take the same
packed panels, whose layout the trees share. docs/performance.md keeps the figures.
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

from spec_decode.cpu.cpu_gemm import PanelWeight

# SmolLM2-135M: 30 layers of q, k, v, o, gate, up, down as (out, in), then the lm_head
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
SHAPES = LAYER_SHAPES * 30 + [(49152, 576)]


def built_kernel(tree: Path) -> str:
    """The path of ``tree``'s compiled kernel, built by that tree's own ``cpu_gemm`` (in a subprocess)."""
    code = "from spec_decode.cpu import cpu_gemm; print(cpu_gemm._build())"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)),
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def load(path: str, dtype: torch.dtype):
    """The kernel's entry point for ``dtype`` inputs, with its argument types, on the AVX2 path."""
    lib = ctypes.CDLL(path)
    lib.safespec_panel_isa(1)
    fn = lib.safespec_panel_linear_bf16 if dtype is torch.bfloat16 else lib.safespec_panel_linear
    fn.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2
    return fn


def one_pass(fn, weights, rows: int, xs: dict, ys: dict) -> float:
    """Seconds of every projection of one forward over ``rows`` rows."""
    start = time.perf_counter()
    for w, (n, k) in zip(weights, SHAPES):
        fn(rows, k, n, xs[k].data_ptr(), w._panels_ptr, w._panels_bf16, None, ys[n].data_ptr())
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
    torch.manual_seed(0)
    weights = [PanelWeight(torch.randn(n, k).to(dtype) * 0.05) for n, k in SHAPES]
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
        ys = {n: torch.empty(rows, n, dtype=dtype) for n in (192, 576, 1536, 49152)}
        times: list[list[float]] = [[], []]
        for i in range(args.passes):
            for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                times[j].append(one_pass(fns[j], weights, rows, xs, ys))
        base, new = (statistics.median(t) * 1e3 for t in times)
        print(f"rows {rows:3d}  base {base:7.2f} ms  new {new:7.2f} ms  new/base {new / base:.3f}", flush=True)


if __name__ == "__main__":
    main()
