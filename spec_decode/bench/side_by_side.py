"""``spec-bench`` without a subcommand: every method side by side (``run.run_bench``), a table and a plot.

Bad input exits with status 2 and a one-line message naming the option (argparse's ``error``), before any
model loads: values when parsed (``spec_decode.bench.args``), then the files the run will read
(``run.check_inputs``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from spec_decode.bench.args import (add_compile_arg, add_device_arg, add_input_args, add_run_args, add_threads_arg,
                                    check_anchor_installed, csv_list, input_paths, missing_bench_extra, nonneg_float,
                                    nonneg_int, out_dir, positive_int, seed, target_gguf)
from spec_decode.bench.config import (DEFAULT_MAX_NEW_TOKENS, DEFAULT_METHODS, DEFAULT_NUM_PROMPTS, BENCH_DTYPES,
                                      METHOD_KEYS, BenchConfig, BenchInputError, default_dtype_name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spec-bench",
        description="Compare autoregressive, HF generate/assisted and our speculative methods side by side, each "
                    "generating exactly --max-new-tokens tokens per prompt (ignoring EOS); "
                    "measure the cost of NaN safety. Subcommands: 'spec-bench numerics -h', "
                    "'spec-bench gpu-check -h', 'spec-bench profile -h', 'spec-bench tune -h', "
                    "'spec-bench compile -h', 'spec-bench gemm -h'. A real model: 'spec-bench --suite smollm2 -h'.")
    add_input_args(p)
    add_run_args(p, num_prompts=DEFAULT_NUM_PROMPTS, max_new_tokens=DEFAULT_MAX_NEW_TOKENS)
    extra = ",".join(k for k in METHOD_KEYS if k not in DEFAULT_METHODS)
    p.add_argument("--methods", type=csv_list(choices=METHOD_KEYS), default=DEFAULT_METHODS,
                   help=f"comma list of {','.join(METHOD_KEYS)} (default: all but {extra})")
    p.add_argument("--out", type=out_dir, default=Path("bench_out"), help="output directory (default ./bench_out)")
    p.add_argument("--dtype", type=csv_list(choices=BENCH_DTYPES), default=None,
                   help="comma list of fp32,bf16; the first is the headline (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--temperatures", type=csv_list(nonneg_float), default=(0.0, 1.0),
                   help="comma list (default 0,1)")
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="prompts per generate call for our methods, at most --num-prompts (default 1 = latency "
                        "setting; HF is always 1)")
    p.add_argument("--seed", type=seed, default=0, help="an integer in [0, 2**63) (default 0)")
    add_threads_arg(p)
    add_device_arg(p)
    p.add_argument("--nan-rounds", type=nonneg_int, default=3,
                   help="rounds of the off/sanitize/abort/guard comparison (0 = skip)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_compile_arg(p)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig of parsed arguments; ValueError naming the option on bad values."""
    dtypes = args.dtype or (default_dtype_name(args.device.type),)
    return BenchConfig(
        **input_paths(args), out=args.out, methods=tuple(args.methods), num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens, temperatures=tuple(args.temperatures), dtypes=tuple(dtypes),
        batch_size=args.batch_size, seed=args.seed, threads=args.threads, device=str(args.device),
        nan_rounds=args.nan_rounds, progress=not args.no_progress, compile=args.compile, gguf=target_gguf(args.target))


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' per-call notices (loading bars, deprecations) for the run; restore after."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


def _busy(threads: int) -> bool:
    """True when other processes already keep the cores busy enough that ``threads`` would oversubscribe."""
    if not hasattr(os, "getloadavg"):
        return False
    return os.getloadavg()[0] + threads > (os.cpu_count() or 1) + 0.5


def main(argv: list[str] | None = None) -> int:
    """The end-to-end benchmark (``spec-bench`` without a subcommand); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--suite" or a.startswith("--suite=") for a in argv):
        from spec_decode.bench import suites

        return suites.main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        check_anchor_installed(cfg.methods)
    except ValueError as e:   # BenchInputError too
        parser.error(str(e))
    import torch

    from spec_decode.bench.report import markdown_table
    from spec_decode.bench.harness import run_bench

    from spec_decode.bench.machine import torch_threads

    threads = torch.get_num_threads()
    if cfg.threads is None and cfg.device == "cpu" and threads > 1 and _busy(threads):
        print(f"note: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {threads} torch threads "
              "oversubscribe a busy CPU (tiny models can run 10-100x slower). Consider --threads 1.",
              file=sys.stderr)
    needs_hf = any(m.startswith("hf_") for m in cfg.methods)
    missing = missing_bench_extra(("transformers",)) if needs_hf else None
    if missing:
        parser.error(f"--methods: the hf_ methods need transformers; {missing.split('error: ', 1)[1]}")
    try:
        with torch_threads(cfg.threads), _quiet_transformers() if needs_hf else contextlib.nullcontext():
            results = run_bench(cfg)
    except BenchInputError as e:
        parser.error(str(e))   # exits with status 2
    except Exception:
        if (Path(cfg.out) / "results.json").is_file():
            print(f"spec-bench: failed; what was measured is in {Path(cfg.out) / 'results.json'}", file=sys.stderr)
        raise
    print(markdown_table(results))
    for key, why in cfg.skipped.items():
        print(f"skipped {key}: {why}")
    print(f"wrote {Path(cfg.out) / 'results.json'} and {Path(cfg.out) / 'results.png'}")
    return 0
