"""``spec-bench numerics``: our sanitize-and-count pass against the engines' inline approaches.

Inputs are verify-shaped logits ``[B * (k + 1), V]`` (``k + 1 = 8`` rows per request: the
EAGLE-2 default of 8 tree nodes), NaN-free, the common case whose cost safety must keep low.
``--nan-every k`` puts a NaN in every k-th row instead and times the counts alone
(``ours_*_counts`` against ``nan_only_counts``): the cost when rows are corrupted.
Implementations, each timed on the same tensor:

* ``ours_torch`` / ``ours_triton``: ``numerics.nonfinite_counts_per_request(..., sanitize=True)``
  (per-request NaN, Inf and dead-row counts and the in-place sanitize; Triton only on CUDA).
  ``nan_counts_per_request`` is the same pass;
* ``nan_only_torch``: the torch pass before issue 11 (per-row ``isnan`` count, per-request
  ``index_add_``, sanitize), kept as the yardstick of what the extra counts cost:
  ``vs_nan_only`` = impl time / ``nan_only_torch`` time (issue 11 asks < 1.10 for ``ours_torch``);
* ``sglang_style``: an ``isnan().any()`` flag plus ``nan_to_num_``. SGLang's sampler branches on
  that flag in Python (``if torch.any(torch.isnan(logits))``), a host sync per step; here the flag
  stays on device so that the comparison measures memory traffic alone;
* ``vllm_style``: ``isnan().sum(-1)`` per row plus a per-request segment sum. vLLM then copies the
  counts to the host (``.cpu()``); that copy is left out here for the same reason;
* ``copy``: ``dst.copy_(x)`` into a preallocated tensor, the bandwidth yardstick.

``gb_s`` counts the bytes read once (``numel * itemsize``) over the median time;
``fraction_of_copy`` = copy time / implementation time (1.0 = as fast as one copy).
On CUDA, ``host_syncs`` counts synchronizing calls per invocation (``set_sync_debug_mode("warn")``),
and our path is also run under ``set_sync_debug_mode("error")``: any sync fails the benchmark.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch

from spec_decode.bench.args import add_threads_arg, at_most, csv_list, nonneg_int, out_dir, positive_float, positive_int
from spec_decode.bench.config import BenchInputError, check_out_dir
from spec_decode.dtypes import DTYPES as ALL_DTYPES

ROWS_PER_REQUEST = 8
DEFAULT_VOCABS = (32000, 151936)
FULL_VOCABS = (32000, 128256, 151936)
DEFAULT_ROWS = (8, 64)          # B = 1, 8
FULL_ROWS = (8, 64, 256)        # B = 1, 8, 32
MAX_CASE_ENTRIES = 1 << 28
"""The most entries (rows x vocab) of one case's logits: a case holds the logits, a copy and their float32
source at once, so this bounds its memory to a few GiB; past it the allocator fails mid-run."""
MAX_MIN_RUN_TIME = 60.0
"""The most seconds ``--min-run-time`` may ask per implementation: each case times five or more."""
DTYPES = {name: ALL_DTYPES[name] for name in ("bf16", "fp32")}   # the dtypes this micro-benchmark runs


def sglang_style(x: torch.Tensor, owner: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """Flag + in-place ``nan_to_num_`` (sync-free variant). Shape: x [R, V]; returns bool [] on device."""
    flag = torch.isnan(x).any()
    c = 1e30 if x.dtype != torch.float16 else 65504.0
    torch.nan_to_num_(x, nan=-c, posinf=c, neginf=-c)
    return flag


def vllm_style(x: torch.Tensor, owner: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """Per-row NaN count + per-request segment sum. Shape: x [R, V], owner [R]; returns int32 [num_reqs]."""
    row = torch.isnan(x).sum(-1, dtype=torch.int32)
    return torch.zeros(num_reqs, dtype=torch.int32, device=x.device).index_add_(0, owner, row)


def nan_only_torch(x: torch.Tensor, owner: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """The torch pass before issue 11: per-request NaN counts (``vllm_style``) + in-place sanitize.

    Shape: x [R, V], owner [R]; returns int32 [num_reqs] on device.
    """
    from numerics import sanitize_nan_logits

    counts = vllm_style(x, owner, num_reqs)
    sanitize_nan_logits(x, warn=False)
    return counts


def _ours(backend: str):
    from numerics import nonfinite_counts_per_request

    def run(x, cu):
        return nonfinite_counts_per_request(x, cu, sanitize=True, backend=backend)
    return run


def _median_s(fn, min_run_time: float) -> float:
    from torch.utils import benchmark

    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def count_host_syncs(fn) -> int:
    """Synchronizing CUDA calls made by one ``fn()`` (``set_sync_debug_mode("warn")`` warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def assert_no_host_sync(fn) -> None:
    """Run ``fn()`` under ``set_sync_debug_mode("error")``: any host sync raises RuntimeError."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def _corrupted_impls(x, cu, owner, num_reqs) -> dict:
    """Counts only (no sanitize, which would repair ``x`` after the first call): ours and the NaN-only count."""
    from numerics import nonfinite_counts_per_request

    impls = {"ours_torch_counts": lambda: nonfinite_counts_per_request(x, cu, backend="torch")}
    if x.device.type == "cuda":
        impls["ours_triton_counts"] = lambda: nonfinite_counts_per_request(x, cu, backend="triton")
    impls["nan_only_counts"] = lambda: vllm_style(x, owner, num_reqs)
    return impls


def bench_case(device: torch.device, dtype_name: str, rows: int, vocab: int, min_run_time: float,
               nan_every: int = 0) -> list[dict]:
    """All implementations on one ``[rows, vocab]`` tensor. Returns one record per implementation.

    ``nan_every`` = 0: clean logits, every implementation. ``nan_every`` = k: a NaN in every k-th row
    (column 5), counts only (``*_counts`` impls; ``vs_nan_only`` relative to ``nan_only_counts``).
    """
    dtype = DTYPES[dtype_name]
    g = torch.Generator(device="cpu").manual_seed(rows * 7 + vocab)
    x = torch.randn(rows, vocab, generator=g).to(device=device, dtype=dtype)
    if nan_every:
        x[::nan_every, min(5, vocab - 1)] = float("nan")
    dst = torch.empty_like(x)
    cu = torch.arange(0, rows + 1, ROWS_PER_REQUEST, device=device, dtype=torch.int32)
    num_reqs = cu.numel() - 1
    owner = torch.arange(rows, device=device) // ROWS_PER_REQUEST
    impls = {"copy": lambda: dst.copy_(x)}
    if nan_every:
        impls.update(_corrupted_impls(x, cu, owner, num_reqs))
        yardstick = "nan_only_counts"
    else:
        impls["ours_torch"] = lambda: _ours("torch")(x, cu)
        if device.type == "cuda":
            impls["ours_triton"] = lambda: _ours("triton")(x, cu)
        impls["nan_only_torch"] = lambda: nan_only_torch(x, owner, num_reqs)
        impls["sglang_style"] = lambda: sglang_style(x, owner, num_reqs)
        impls["vllm_style"] = lambda: vllm_style(x, owner, num_reqs)
        yardstick = "nan_only_torch"

    nbytes = x.numel() * x.element_size()
    times = {name: _median_s(fn, min_run_time) for name, fn in impls.items()}
    records = []
    for name, fn in impls.items():
        rec = {"device": device.type, "dtype": dtype_name, "rows": rows, "requests": num_reqs, "vocab": vocab,
               "impl": name, "median_ms": times[name] * 1e3, "gb_s": nbytes / times[name] / 1e9,
               "fraction_of_copy": times["copy"] / times[name],
               "nan_every": nan_every, "vs_nan_only": times[name] / times[yardstick]}
        if device.type == "cuda":
            if name.startswith("ours"):
                assert_no_host_sync(fn)
            rec["host_syncs"] = count_host_syncs(fn)
            if name.startswith("ours") and rec["host_syncs"]:
                raise AssertionError(f"{name} made {rec['host_syncs']} host syncs per call; expected 0")
        records.append(rec)
    return records


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spec-bench numerics",
                                description="Sanitize-and-count micro-benchmark on verify-shaped logits.")
    p.add_argument("--out", type=out_dir, default=Path("bench_out"), help="output directory (default ./bench_out)")
    p.add_argument("--full", action="store_true",
                   help=f"rows {FULL_ROWS} x vocab {FULL_VOCABS} (default rows {DEFAULT_ROWS} x vocab {DEFAULT_VOCABS})")
    p.add_argument("--rows", type=csv_list(positive_int), default=None,
                   help=f"comma list of row counts (multiples of 8), overrides --full; rows x vocab at most "
                        f"{MAX_CASE_ENTRIES}")
    p.add_argument("--vocabs", type=csv_list(positive_int), default=None,
                   help="comma list of vocab sizes, overrides --full")
    p.add_argument("--dtypes", type=csv_list(choices=tuple(DTYPES)), default="bf16,fp32",
                   help="comma list of bf16,fp32")
    p.add_argument("--device", default="all", choices=("all", "cpu", "cuda"),
                   help="all (CPU, plus CUDA when present), cpu or cuda")
    p.add_argument("--min-run-time", type=at_most(positive_float, MAX_MIN_RUN_TIME, " seconds"), default=0.2,
                   help=f"seconds of timing per implementation (> 0, at most {MAX_MIN_RUN_TIME:g})")
    add_threads_arg(p)
    p.add_argument("--nan-every", type=nonneg_int, default=0,
                   help="0 (default): clean logits. k >= 1: a NaN in every k-th row, counts-only impls")
    return p


def run_numerics(devices, dtypes, rows_list, vocabs, min_run_time: float, progress: bool = True,
                 nan_every: int = 0) -> list[dict]:
    """Every (device, dtype, rows, vocab) case; returns the flat list of records."""
    from tqdm.auto import tqdm

    cases = [(d, t, r, v) for d in devices for t in dtypes for r in rows_list for v in vocabs]
    records = []
    for d, t, r, v in tqdm(cases, desc="spec-bench numerics", disable=not progress):
        records += bench_case(d, t, r, v, min_run_time, nan_every)
    return records


def main(argv: list[str] | None = None) -> int:
    """``spec-bench numerics``: writes ``DIR/numerics.json`` and prints a table."""
    from spec_decode.bench.machine import machine_info

    parser = build_parser()
    args = parser.parse_args(argv)
    rows_list = args.rows or (FULL_ROWS if args.full else DEFAULT_ROWS)
    if any(r % ROWS_PER_REQUEST for r in rows_list):
        parser.error(f"--rows: each value must be a multiple of {ROWS_PER_REQUEST} (rows per request)")
    vocabs = args.vocabs or (FULL_VOCABS if args.full else DEFAULT_VOCABS)
    if max(rows_list) * max(vocabs) > MAX_CASE_ENTRIES:
        parser.error(f"--rows {max(rows_list)} x --vocabs {max(vocabs)}: a case of more than {MAX_CASE_ENTRIES} "
                     "logits would not fit in memory")
    dtypes = args.dtypes
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    try:
        out_path = check_out_dir(args.out, outputs=("numerics.json",))
    except BenchInputError as e:
        parser.error(str(e))
    devices = [torch.device("cpu")] if args.device in ("all", "cpu") else []
    if args.device in ("all", "cuda") and torch.cuda.is_available():
        devices.append(torch.device("cuda"))

    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        records = run_numerics(devices, dtypes, rows_list, vocabs, args.min_run_time, nan_every=args.nan_every)
        machine = machine_info(devices[-1])
    finally:
        torch.set_num_threads(threads)
    out = {"machine": machine,
           "config": {"rows": list(rows_list), "vocabs": list(vocabs), "dtypes": list(dtypes),
                      "devices": [d.type for d in devices], "rows_per_request": ROWS_PER_REQUEST,
                      "min_run_time_s": args.min_run_time, "threads": args.threads, "nan_every": args.nan_every,
                      "bytes": "numel * itemsize (one read)", "fraction_of_copy": "copy time / impl time",
                      "vs_nan_only": "impl time / nan_only_torch time"},
           "results": records}
    with open(out_path / "numerics.json", "w") as f:
        json.dump(out, f, indent=2)
    print(markdown_table(records))
    print(f"wrote {out_path / 'numerics.json'}")
    return 0


def markdown_table(records: list[dict]) -> str:
    cuda = any(r["device"] == "cuda" for r in records)
    cols = ["device", "dtype", "rows x V", "impl", "ms", "GB/s", "x copy BW", "x nan_only"] + (["syncs"] if cuda else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        row = [r["device"], r["dtype"], f"{r['rows']} x {r['vocab']}", r["impl"], f"{r['median_ms']:.3f}",
               f"{r['gb_s']:.1f}", f"{r['fraction_of_copy']:.2f}", f"{r['vs_nan_only']:.2f}"]
        if cuda:
            row.append(str(r.get("host_syncs", "-")))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
