"""``spec-bench tune``: sweep the tree shape (num_steps, topk, num_draft_tokens) and name the fastest.

A tree shape may carry a fourth value, the tree's ``score_temperature``
(``SpecDecoder(tree_score_temperature=...)``), written ``6/2/8@0.5``; without it the library's 1.0.

For one drafter (``--method eagle | eagle3 | draft_model``) every shape of the grid gets its own
``SpecDecoder``; all share one loaded target and drafter, and ``ar`` (``method="none"``) runs beside
them as the yardstick. Per temperature, each decoder gets one warm-up call; then the measured calls
run interleaved, prompt by prompt, with the order rotated per prompt (``run.measure_interleaved``,
as ``spec-bench`` does), one prompt per call.

Prompts: held-out prompts from ``--prompts`` (the fixtures' ``prompts.jsonl``), by default those
*after* the ones ``spec-bench`` measures (``--first-prompt 17`` = 16 measured + 1 warm-up), so
that a shape is not tuned on the prompts that later report it.

Writes ``DIR/tune.json`` (rewritten after every temperature) and ``DIR/tune.png``, and prints a
table. ``best`` per temperature is the shape with the highest tokens/s; ``best_chain`` and
``best_tree`` the best of each kind (a chain is ``topk=1``, ``num_draft_tokens = num_steps + 1``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from spec_decode.bench.args import (add_device_arg, add_dtype_arg, add_input_args, add_run_args, add_threads_arg,
                                    csv_list, input_paths, nonneg_float, nonneg_int, out_dir, seed)
from spec_decode.bench.config import (DEFAULT_MAX_NEW_TOKENS, DEFAULT_NUM_PROMPTS, METHOD_SPECS, BenchConfig,
                                      BenchInputError, MethodSpec, check_out_dir, default_dtype_name, fit_seed,
                                      load_prompts)
from spec_decode.bench.machine import torch_threads
from spec_decode.tree_shape import check_score_temperature

# (num_steps, topk, num_draft_tokens): six chains; chains plus one or two side branches (on CPU each
# verified token costs, so that is where a tree can beat a chain); then trees from narrow to wide.
DEFAULT_SHAPES = (
    (2, 1, 3), (3, 1, 4), (4, 1, 5), (5, 1, 6), (6, 1, 7), (7, 1, 8),
    (4, 2, 6), (5, 2, 7), (6, 2, 8),
    (4, 2, 8), (5, 2, 10), (5, 4, 8), (6, 4, 12), (6, 4, 16), (6, 8, 32), (8, 8, 64),
    # trees scored at temperature 0.5 (deeper first choices, fewer siblings)
    (4, 2, 8, 0.5), (5, 2, 8, 0.5), (6, 2, 8, 0.5), (6, 2, 10, 0.5),
)
DRAFTERS = {"eagle": "eagle", "eagle3": "eagle3", "draft_model": "draft_lm"}
"""``--method`` -> the drafter checkpoint it needs (``MethodSpec.drafter``)."""
TUNE_CONFIG_KEYS = ("target", "prompts", "num_prompts", "max_new_tokens", "temperatures", "seed", "threads", "device")
"""The ``BenchConfig`` fields that ``tune.json["config"]`` records (the rest do not apply to a sweep)."""
DEFAULT_TUNE_PROMPTS = 8
DEFAULT_FIRST_PROMPT = DEFAULT_NUM_PROMPTS + 1   # after spec-bench's measured prompts and its warm-up prompt


def shape_key(shape: tuple) -> str:
    """``(5, 4, 8) -> "5/4/8"`` (num_steps/topk/num_draft_tokens), ``(6, 2, 8, 0.5) -> "6/2/8@0.5"``
    (and a score temperature): the JSON key of a shape."""
    key = "/".join(str(v) for v in shape[:3])
    return key if len(shape) == 3 else f"{key}@{shape[3]:g}"


def score_temperature(shape: tuple) -> float | None:
    """The shape's tree score temperature, None when it has none (the library's default)."""
    return shape[3] if len(shape) > 3 else None


def is_chain(shape: tuple) -> bool:
    """True for a chain: ``topk=1`` and ``num_draft_tokens = num_steps + 1`` (one node per depth, root included)."""
    num_steps, topk, num_draft_tokens = shape[:3]
    return topk == 1 and num_draft_tokens == num_steps + 1


def _parse_shape(item: str) -> tuple:
    triple, at, temp = item.partition("@")
    try:
        shape = tuple(int(p) for p in triple.split("/"))
    except ValueError:
        shape = ()
    if len(shape) != 3:
        raise argparse.ArgumentTypeError(f"expected num_steps/topk/num_draft_tokens triples like 5/4/8 (or "
                                         f"6/2/8@0.5 with a tree score temperature), got {item!r}")
    if at and not temp.strip():
        raise argparse.ArgumentTypeError(f"{item!r}: no score temperature after @; give one (6/2/8@0.5) or drop the @")
    if not temp:
        return shape
    try:
        value = check_score_temperature(float(temp), "a shape's score temperature")
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{err} in {item!r}") from None
    if is_chain(shape):
        raise argparse.ArgumentTypeError(f"{item!r}: a chain has no tree to score; drop the @temperature")
    return (*shape, value)


def parse_shapes(text: str) -> tuple[tuple, ...]:
    """``"4/1/5,5/4/8,6/2/8@0.5"`` -> ``((4, 1, 5), (5, 4, 8), (6, 2, 8, 0.5))``; argparse error naming
    ``--shapes`` otherwise."""
    shapes = []
    for item in (s.strip() for s in text.split(",")):
        shapes.append(_parse_shape(item))
    if len(set(shapes)) != len(shapes):
        raise argparse.ArgumentTypeError(f"a shape is listed twice in {text!r}")
    return tuple(shapes)


def base_method_key(method: str) -> str:
    """The ``spec-bench`` method key that uses the drafter of ``method`` (its checks and paths apply).

    Raises BenchInputError naming ``--method`` when ``method`` is not one of ``DRAFTERS``.
    """
    if method not in DRAFTERS:
        raise BenchInputError(f"--method must be one of {', '.join(DRAFTERS)}, got {method!r}")
    return next(k for k, s in METHOD_SPECS.items() if s.drafter == DRAFTERS[method] and s.engine == "ours")


def _best(entries: dict, keys) -> str | None:
    scored = [(entries[k]["tokens_per_s"], k) for k in keys if entries[k]["tokens_per_s"] is not None]
    return max(scored)[1] if scored else None


def run_tune(cfg: BenchConfig, method: str, shapes, first_prompt: int = 0) -> dict:
    """Sweep ``shapes`` for drafter ``method`` at ``cfg.temperatures``; write ``tune.json`` and ``tune.png``.

    ``cfg`` supplies the paths, ``num_prompts``, ``max_new_tokens``, ``dtypes[0]``, ``device``,
    ``seed`` and ``progress``. Raises BenchInputError naming the option on bad input, before
    anything is measured. Returns the results (the layout of ``tune.json``, see ``docs/bench.md``).
    """
    from tqdm.auto import tqdm

    from spec_decode.bench.machine import machine_info
    from spec_decode.bench.methods import ModelCache, checked_load
    from spec_decode.bench.report import plot_tune
    from spec_decode.bench.harness import (add_speedups, check_inputs, measure_interleaved, summarize_calls, temp_key,
                                       write_results)

    out = check_out_dir(cfg.out, outputs=("tune.json", "tune.png"))
    device = torch.device(cfg.device)
    drafter, base = DRAFTERS[method], base_method_key(method)
    if cfg.resolve_methods() != ("ar", base):
        raise BenchInputError(f"--method {method}: {cfg.skipped[base]}")
    vocab = check_inputs(cfg, ("ar", base), first=first_prompt)
    prompts = load_prompts(cfg.prompts, cfg.num_prompts, vocab, first=first_prompt)
    measured = [[p] for p in prompts[:cfg.num_prompts]]
    warm = [prompts[-1]]   # the prompt after the measured ones, when the file has it
    models = ModelCache(cfg, cfg.dtypes[0], device)
    runners = {"ar": models.runner(METHOD_SPECS["ar"])}
    for shape in shapes:
        spec = MethodSpec(shape_key(shape), "ours", method, drafter, *shape[:3],
                          score_temperature=score_temperature(shape))
        runners[spec.key] = checked_load("--shapes", spec.key, lambda: models.runner(spec))
    results = {"machine": machine_info(device),
               "config": {**{k: v for k, v in cfg.to_json().items() if k in TUNE_CONFIG_KEYS}, "method": method,
                          "drafter": str(cfg.drafter_path(drafter)), "dtype": cfg.dtypes[0],
                          "first_prompt": first_prompt, "shapes": [list(s) for s in shapes]},
               "by_temperature": {}, "best": {}}
    total = len(cfg.temperatures) * len(runners) * (1 + len(measured))
    try:
        with tqdm(total=total, desc="spec-bench tune", unit="call", disable=not cfg.progress) as bar:
            for temp in cfg.temperatures:
                for r in runners.values():   # warm-up
                    r.generate(warm, cfg.max_new_tokens, temp, fit_seed(cfg.seed))
                    bar.update(1)
                calls = measure_interleaved(runners, measured, cfg.max_new_tokens, temp, cfg.seed, bar)
                entries = {k: summarize_calls(c) for k, c in calls.items()}
                add_speedups(entries)
                for shape in shapes:
                    entries[shape_key(shape)].update(num_steps=shape[0], topk=shape[1], num_draft_tokens=shape[2],
                                                     score_temperature=score_temperature(shape),
                                                     chain=is_chain(shape))
                keys = [shape_key(s) for s in shapes]
                t = temp_key(temp)
                results["by_temperature"][t] = {
                    "ar": entries.pop("ar"), "shapes": entries, "best": _best(entries, keys),
                    "best_chain": _best(entries, [shape_key(s) for s in shapes if is_chain(s)]),
                    "best_tree": _best(entries, [shape_key(s) for s in shapes if not is_chain(s)])}
                results["best"][t] = results["by_temperature"][t]["best"]
                write_results(results, out, "tune.json")
    except BaseException as e:   # KeyboardInterrupt too: keep the temperatures already swept
        results["error"] = {"type": type(e).__name__, "message": str(e)}
        write_results(results, out, "tune.json")
        raise
    plot_tune(results, out / "tune.png")
    return results


def format_tune(results: dict) -> str:
    """A text table per temperature: tokens/s, x ar, mean accepted length and p50 step per shape."""
    lines = []
    for t, r in results["by_temperature"].items():
        lines.append(f"temperature {t}: ar {r['ar']['tokens_per_s']:.1f} tokens/s; best {r['best']} "
                     f"(best chain {r['best_chain']}, best tree {r['best_tree']})")
        lines.append(f"  {'shape':10s} {'tokens/s':>9s} {'x ar':>6s} {'accepted':>9s} {'p50 ms':>8s}")
        for k, e in r["shapes"].items():
            mark = "  <- best" if k == r["best"] else ""
            lines.append(f"  {k:10s} {_num(e['tokens_per_s'], '9.1f')} {_num(e['speedup_vs_ar'], '6.2f')} "
                         f"{_num(e['mean_accepted_length'], '9.2f')} {_num(e['p50_step_ms'], '8.2f')}{mark}")
    return "\n".join(lines)


def _num(v, spec: str) -> str:
    return "-".rjust(int(spec.split(".")[0])) if v is None else format(v, spec)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spec-bench tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="eagle", choices=tuple(DRAFTERS),
                   help="the drafter to tune: --eagle, --eagle3 or --draft-lm (default eagle)")
    add_input_args(p)
    p.add_argument("--first-prompt", type=nonneg_int, default=DEFAULT_FIRST_PROMPT,
                   help=f"index of the first prompt used (default {DEFAULT_FIRST_PROMPT}: after spec-bench's "
                        "measured and warm-up prompts)")
    add_run_args(p, num_prompts=DEFAULT_TUNE_PROMPTS, max_new_tokens=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES,
                   help="comma list of num_steps/topk/num_draft_tokens, a tree optionally with @score_temperature "
                        "(default: "
                        f"{','.join(shape_key(s) for s in DEFAULT_SHAPES)})")
    p.add_argument("--temperatures", type=csv_list(nonneg_float), default=(0.0, 1.0), help="comma list (default 0,1)")
    add_dtype_arg(p)
    p.add_argument("--seed", type=seed, default=0, help="an integer in [0, 2**63) (default 0)")
    add_threads_arg(p)
    add_device_arg(p)
    p.add_argument("--out", type=out_dir, default=Path("bench_out"), help="output directory (default ./bench_out)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    """``spec-bench tune``; returns the exit code (2 with a message naming the option on bad input)."""
    p = build_parser()
    args = p.parse_args(argv)
    try:
        device = args.device
        dtype = args.dtype or default_dtype_name(device.type)
        cfg = BenchConfig(**input_paths(args), out=args.out, methods=("ar", base_method_key(args.method)),
                          num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                          temperatures=tuple(args.temperatures), dtypes=(dtype,), seed=args.seed,
                          threads=args.threads, device=str(device), nan_rounds=0, progress=not args.no_progress)
    except ValueError as e:   # BenchConfig's checks and resolve_device name the option
        p.error(str(e))
    try:
        with torch_threads(cfg.threads):
            results = run_tune(cfg, args.method, args.shapes, args.first_prompt)
    except BenchInputError as e:
        p.error(str(e))
    print(format_tune(results))
    print(f"wrote {Path(args.out) / 'tune.json'} and {Path(args.out) / 'tune.png'}", file=sys.stderr)
    return 0
