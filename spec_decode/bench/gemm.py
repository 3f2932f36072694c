"""``spec-bench gemm``: the panel kernel (``spec_decode.cpu.cpu_gemm``) against torch's kernels, side by side.

Three parts, one thread (the kernel's arithmetic is float32; bf16 layers run through it in float32):

* the kernel over one forward's projections of the target (its own weights, each packed once, so they
  stream from memory as in a real forward), at ``--kernel-rows`` rows, with float32 and bf16 panels, on
  each ``--isa`` path: GFLOP/s against the core's measured FMA peak on that path
  (``cpu_gemm.fma_peak_gflops``), and the weights' GB/s (one row reads every weight for one FMA each,
  so memory bounds it; a block of rows reuses each weight it loads);

* every projection shape of the target and the EAGLE head (the lm_head included) over a few row
  counts, in float32: the median of ``--repeats`` calls of ``F.linear`` and of the kernel;
* end to end, in ``--dtype``: ``ar`` and ``eagle_chain`` (4/1/5), greedy, with the kernel on and off
  (``set_panel_linears``), prompts interleaved, after a warm-up call each; tokens/s, the ratio of
  on over off, and whether the outputs agree. In bf16 also "f32 panels": the kernel on bf16 weights
  packed in float32 (``panel_dtype=torch.float32``, the same bits from twice the bytes), against
  the default bf16 panels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from spec_decode.bench.args import add_input_args, csv_list, nonneg_int, positive_int
from spec_decode.bench.config import BenchInputError
from spec_decode.bench.machine import torch_threads
from spec_decode.cpu.cpu_gemm import ISAS
from spec_decode.dtypes import DTYPE_NAMES, DTYPES


def projection_shapes(*modules) -> list[tuple[int, int]]:
    """The distinct (in_features, out_features) of every ``Linear`` in ``modules``, in first-seen order."""
    from spec_decode.cpu import Linear

    seen: dict[tuple[int, int], None] = {}
    for module in modules:
        for m in module.modules():
            if isinstance(m, Linear):
                seen.setdefault((m.in_features, m.out_features), None)
    return list(seen)


def median_us(fn, repeats: int) -> float:
    for _ in range(max(5, repeats // 10)):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def time_projections(shapes, rows, repeats: int) -> list[dict]:
    """One dict per (shape, rows): ``f_linear_us``, ``panel_us`` and the largest relative difference."""
    from spec_decode.cpu.cpu_gemm import PanelWeight

    out = []
    gen = torch.Generator().manual_seed(0)
    for in_f, out_f in shapes:
        weight = torch.randn(out_f, in_f, generator=gen)
        packed = PanelWeight(weight)
        for r in rows:
            x = torch.randn(r, in_f, generator=gen)
            ref, got = F.linear(x, weight), packed(x)
            rel = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()  # a report, not a hot path
            out.append({"in": in_f, "out": out_f, "rows": r, "f_linear_us": median_us(lambda: F.linear(x, weight), repeats),
                        "panel_us": median_us(lambda: packed(x), repeats), "max_rel_diff": rel})
    return out


DTYPE_LABELS = {dtype: name for name, dtype in DTYPES.items()}


def forward_panels(target, dtype) -> list:
    """A ``PanelWeight`` of every projection of ``target`` (the lm_head included), weights in ``dtype``, no bias:
    one forward's projections, each packed once."""
    from spec_decode.cpu import Linear
    from spec_decode.cpu.cpu_gemm import PanelWeight

    return [PanelWeight(m.weight.detach().to(dtype)) for m in target.modules() if isinstance(m, Linear)]


def kernel_throughput(panels: list, rows: int, repeats: int, peak_gflops: float) -> dict:
    """One pass over ``panels`` (``forward_panels``) at ``rows`` rows, the median of ``repeats`` passes:
    {"rows", "ms", "gflops", "peak_frac", "weight_gbs"}."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if panels[0]._panels_bf16 else torch.float32
    xs = {K: torch.randn(rows, K, generator=gen).to(dtype) for K in {p.in_features for p in panels}}

    def one_pass():
        for p in panels:
            p(xs[p.in_features])

    seconds = median_us(one_pass, repeats) / 1e6
    flops = sum(2 * rows * p.in_features * p.out_features for p in panels)
    weight_bytes = sum(p.panels.numel() * p.panels.element_size() for p in panels)
    return {"rows": rows, "ms": seconds * 1e3, "gflops": flops / seconds / 1e9,
            "peak_frac": flops / seconds / 1e9 / peak_gflops, "weight_gbs": weight_bytes / seconds / 1e9}


def kernel_report(target, isas, rows, repeats: int) -> list[dict]:
    """``kernel_throughput`` of ``target``'s projections for each path in ``isas``, panel dtype and row count,
    each path against its own measured FMA peak; the path in use is restored after."""
    from spec_decode.cpu import cpu_gemm

    out = []
    try:
        for isa in isas:
            used = cpu_gemm.set_isa(isa)
            peak = cpu_gemm.fma_peak_gflops(used)
            for dtype in (torch.float32, torch.bfloat16):
                panels = forward_panels(target, dtype)
                for r in rows:
                    out.append({"isa": used, "panels": DTYPE_LABELS[dtype], "peak_gflops": peak,
                                **kernel_throughput(panels, r, repeats, peak)})
                del panels
    finally:
        cpu_gemm.set_isa(None)
    return out


def print_kernel_report(report: list[dict]) -> None:
    print("the kernel over one forward's projections of the target, 1 thread (median of passes)")
    print(f"  {'path':>6s} {'panels':>6s} {'rows':>4s} {'ms':>7s} {'GFLOP/s':>8s} {'of peak':>7s} {'weights GB/s':>12s}")
    for r in report:
        print(f"  {r['isa']:>6s} {r['panels']:>6s} {r['rows']:>4d} {r['ms']:7.2f} {r['gflops']:8.1f} "
              f"{r['peak_frac']:6.0%} {r['weight_gbs']:12.1f}")
    for isa in dict.fromkeys(r["isa"] for r in report):
        peak = next(r["peak_gflops"] for r in report if r["isa"] == isa)
        print(f"  {isa} FMA peak, one core, measured: {peak:.1f} GFLOP/s")


def kernel_variants(dtype) -> dict:
    """tag -> ``set_panel_linears`` arguments (on, panel_dtype) of the end-to-end comparison."""
    variants = {"on": (None, None), "off": (False, None)}
    if dtype is torch.bfloat16:
        variants["f32 panels"] = (None, torch.float32)
    return variants


def decoders(target_path, eagle_path, dtype) -> dict:
    """``ar`` and ``eagle_chain`` for each of ``kernel_variants`` (a copy of the models each)."""
    from spec_decode.bench.compile_ab import ar_and_chain
    from spec_decode.cpu import set_panel_linears

    decs = {}
    for tag, (on, panel_dtype) in kernel_variants(dtype).items():
        decs.update(ar_and_chain(target_path, eagle_path, dtype, tag,
                                 prepare=lambda m, on=on, pd=panel_dtype: set_panel_linears(m, on, panel_dtype=pd)))
    return decs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spec-bench gemm", description=__doc__.split("\n\n")[0])
    add_input_args(p)
    p.add_argument("--rows", type=csv_list(positive_int), default=(1, 2, 3, 5, 8, 16),
                   help="comma list (default 1,2,3,5,8,16)")
    p.add_argument("--repeats", type=positive_int, default=1000, help="calls per projection timing (median)")
    p.add_argument("--kernel-rows", type=csv_list(positive_int), default=(1, 4, 6, 12),
                   help="rows of the per-forward kernel part (default 1,4,6,12)")
    p.add_argument("--kernel-repeats", type=positive_int, default=20,
                   help="passes over the forward's projections per figure (median; default 20)")
    p.add_argument("--kernel-only", action="store_true",
                   help="only the per-forward kernel part: the target alone, no drafter loaded")
    p.add_argument("--isa", type=csv_list(choices=tuple(ISAS)), default=None,
                   help="paths of the per-forward kernel part, comma list of avx2,avx512 (default: every path "
                        "this CPU runs; avx2 alone forces the AVX2 path on an AVX-512 CPU)")
    p.add_argument("--num-prompts", type=nonneg_int, default=8, help="prompts of the end-to-end part (0 skips it)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES,
                   help=f"{', '.join(DTYPE_NAMES)}: the models' dtype in the end-to-end part")
    return p


def main(argv: list[str] | None = None) -> int:
    from spec_decode.cpu import cpu_gemm
    from spec_decode.bench.compile_ab import checked_prompts, measure
    from spec_decode.bench.harness import check_models
    from spec_decode.dtypes import torch_dtype

    p = build_parser()
    args = p.parse_args(argv)
    dtype = torch_dtype(args.dtype)
    try:   # the end-to-end part warms up on the prompt after the measured ones
        if args.kernel_only:
            check_models(args.target, {})
        else:
            prompts = checked_prompts(args, extra=1)
    except BenchInputError as e:
        p.error(str(e))
    if not cpu_gemm.available():
        print("the panel kernel is not available on this machine (see spec_decode.cpu.cpu_gemm)")
        return 1
    from spec_decode.models import Transformer

    isas = args.isa or cpu_gemm.runnable_isas()   # default: every path this CPU runs (AVX2 forced too)
    target = Transformer.from_pretrained(args.target, dtype=torch.float32)   # its weights, packed per panel dtype
    with torch_threads(1), torch.inference_mode():
        print_kernel_report(kernel_report(target, isas, args.kernel_rows, args.kernel_repeats))
    del target
    if args.kernel_only:
        return 0
    decs = decoders(args.target, args.eagle, dtype)   # outside inference_mode: its weights are never packed
    shapes = projection_shapes(decs["eagle_chain on"].target, decs["eagle_chain on"].drafter)
    with torch_threads(1), torch.inference_mode():
        rows = time_projections(shapes, args.rows, args.repeats)
    print(f"float32 projections, 1 thread, torch {torch.__version__}, median of {args.repeats} calls (us)")
    print(f"  {'in x out':>12s} {'rows':>4s} {'F.linear':>9s} {'panel':>8s} {'speedup':>7s} {'max rel diff':>12s}")
    for r in rows:
        print(f"  {r['in']:>5d} x {r['out']:<5d}{r['rows']:>4d} {r['f_linear_us']:9.1f} {r['panel_us']:8.1f} "
              f"{r['f_linear_us'] / r['panel_us']:6.2f}x {r['max_rel_diff']:12.1e}")
    if args.num_prompts == 0:
        return 0
    with torch_threads(1):
        seconds, outputs = measure(decs, prompts[:args.num_prompts], prompts[-1], args.max_new_tokens)
    tokens = args.num_prompts * args.max_new_tokens
    print(f"end to end: {args.dtype}, {args.num_prompts} prompts x {args.max_new_tokens} tokens, greedy, 1 thread")
    for name, s in seconds.items():
        print(f"  {name:18s} {tokens / s:7.1f} tokens/s  {seconds['ar off'] / s:5.2f}x ar off")
    print(f"  kernel on over off: ar {seconds['ar off'] / seconds['ar on']:.2f}x, "
          f"eagle_chain {seconds['eagle_chain off'] / seconds['eagle_chain on']:.2f}x; eagle_chain over ar: "
          f"on {seconds['ar on'] / seconds['eagle_chain on']:.2f}x, off {seconds['ar off'] / seconds['eagle_chain off']:.2f}x")
    if "ar f32 panels" in seconds:
        print(f"  bf16 panels over f32 panels: ar {seconds['ar f32 panels'] / seconds['ar on']:.2f}x, eagle_chain "
              f"{seconds['eagle_chain f32 panels'] / seconds['eagle_chain on']:.2f}x; eagle_chain over ar with f32 "
              f"panels {seconds['ar f32 panels'] / seconds['eagle_chain f32 panels']:.2f}x; the same tokens: "
              f"{outputs['ar on'] == outputs['ar f32 panels'] and outputs['eagle_chain on'] == outputs['eagle_chain f32 panels']}")
    same = {tag: outputs[f"eagle_chain {tag}"] == outputs[f"ar {tag}"] for tag in ("on", "off")}
    print(f"  greedy eagle_chain == ar: on {same['on']}, off {same['off']}; ar on == ar off: "
          f"{outputs['ar on'] == outputs['ar off']}")
    return 0
