"""``spec-bench profile``: where one decoding step spends its time (cProfile over real ``generate`` calls).

Prints milliseconds per verify step for the pipeline's stages (catch-up, drafting, target forward,
verification, the NaN pass, the host copy, cache commits, bookkeeping), then the top functions by
own time. Stage names are the pipeline's function names; a stage the pipeline no longer has is
simply not listed. cProfile adds per-call overhead, so compare stages with each other, not with
``spec-bench`` timings.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from spec_decode.bench.config import METHOD_SPECS, default_fixtures_dir

# (function name, file suffix, label), in pipeline order.
STAGES = (
    ("_spec_step", "pipeline.py", "whole speculative step"),
    ("target_forward", "profile_step.py", "target forward (prefill, verify, ar step)"),
    ("drafter_forward", "profile_step.py", "drafter forward (catch-up + drafting)"),
    ("_ar_step", "pipeline.py", "whole autoregressive step"),
    ("_catch_up", "pipeline.py", "catch-up: drafter on last step's tokens"),
    ("draft_tree", "drafting.py", "drafting: tree expansion (incl. head forwards)"),
    ("_select_tree", "drafting.py", "  of which: select/re-rank tree"),
    ("_poison_kv", "pipeline.py", "fault hook (kv)"),
    ("_nan_pass", "pipeline.py", "NaN count + sanitize pass"),
    ("tree_verify", "tree.py", "tree_verify (sampler)"),
    ("_to_host", "pipeline.py", "host copy (the step's one sync)"),
    ("commit", "model.py", "KVCache.commit (target + drafter)"),
    ("features", "pipeline.py", "drafter features"),
    ("_finish_step", "pipeline.py", "bookkeeping: policy, append, finish"),
    ("keep", "pipeline.py", "drop finished rows"),
)


def _wrap_forward(module, name: str) -> None:
    """Route ``module``'s forward through a function named ``name`` so that cProfile reports it apart.

    The wrapper is an instance attribute (``nn.Module.__call__`` looks ``forward`` up on the instance),
    so only this decoder's module is affected.
    """
    inner = module.forward

    def wrapper(*args, **kwargs):
        return inner(*args, **kwargs)

    wrapper.__code__ = wrapper.__code__.replace(co_name=name)
    module.forward = wrapper


def profile_method(key: str, cfg_paths: dict, prompts: list[list[int]], max_new_tokens: int, dtype: torch.dtype,
                   top: int = 20) -> str:
    """Profile greedy ``generate`` of method ``key`` over ``prompts`` (one call each); return the report text."""
    from spec_decode.pipeline import SpecDecoder

    spec = METHOD_SPECS[key]
    if spec.engine != "ours":
        raise ValueError(f"--method: profile covers our methods only, got {key!r}")
    draft = cfg_paths.get(spec.drafter) if spec.drafter else None
    tree = {} if spec.drafter is None else dict(num_steps=spec.num_steps, topk=spec.topk,
                                                num_draft_tokens=spec.num_draft_tokens)
    dec = SpecDecoder.from_pretrained(cfg_paths["target"], draft, method=spec.method, dtype=dtype,
                                      nan_policy="sanitize", **tree)
    _wrap_forward(dec.target, "target_forward")
    if dec.drafter is not None:
        _wrap_forward(dec.drafter.module, "drafter_forward")
    dec.generate(prompts[:1], max_new_tokens=max_new_tokens)   # warm-up
    prof = cProfile.Profile()
    accepted = []
    t0 = time.perf_counter()
    prof.enable()
    for p in prompts:
        accepted += dec.generate([p], max_new_tokens=max_new_tokens)[0].accepted_lengths
    prof.disable()
    wall = time.perf_counter() - t0
    steps = max(1, len(accepted))
    stats = pstats.Stats(prof)
    lines = [f"{key}: {len(prompts)} prompts x {max_new_tokens} tokens, {steps} steps, "
             f"mean accepted length {sum(accepted) / steps:.2f}, {wall / steps * 1e3:.2f} ms/step under cProfile"]
    found = {}
    for (file, _line, fn), (_cc, nc, _tt, ct, _callers) in stats.stats.items():
        for name, suffix, label in STAGES:
            if fn == name and file.endswith(suffix):
                n, c = found.get(label, (0, 0.0))
                found[label] = (n + nc, c + ct)
    for _name, _suffix, label in STAGES:
        if label in found:
            n, ct = found[label]
            lines.append(f"  {label:48s} {ct * 1e3 / steps:8.3f} ms/step {ct / wall * 100:6.1f}%  ({n} calls)")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines.append(buf.getvalue())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from spec_decode.bench.config import load_prompts
    from spec_decode.model import ModelConfig

    fx = default_fixtures_dir()
    p = argparse.ArgumentParser(prog="spec-bench profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="eagle_tree", help="ar, draft_chain, eagle_chain, eagle_tree, eagle3_tree")
    p.add_argument("--target", type=Path, default=fx / "models/tiny-target")
    p.add_argument("--draft-lm", type=Path, default=fx / "models/tiny-draft")
    p.add_argument("--eagle", type=Path, default=fx / "models/tiny-eagle")
    p.add_argument("--eagle3", type=Path, default=fx / "models/tiny-eagle3")
    p.add_argument("--prompts", type=Path, default=fx / "prompts.jsonl")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.method not in METHOD_SPECS or METHOD_SPECS[args.method].engine != "ours":
        p.error(f"--method: expected one of our methods, got {args.method!r}")
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        p.error("--num-prompts and --max-new-tokens must be >= 1")
    vocab = ModelConfig.from_pretrained(args.target).vocab_size
    prompts = load_prompts(args.prompts, args.num_prompts, vocab)[:args.num_prompts]
    paths = {"target": args.target, "draft_lm": args.draft_lm, "eagle": args.eagle, "eagle3": args.eagle3}
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        print(profile_method(args.method, paths, prompts, args.max_new_tokens, dtype))
    finally:
        torch.set_num_threads(threads)
    return 0
