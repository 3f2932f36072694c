"""``spec-bench compile``: eager against ``SpecDecoder(compile=True)``, side by side in one run.

Two copies of the target and the EAGLE head, one compiled in place; ``ar`` and ``eagle_chain`` (4/1/5)
on each, greedy, prompts interleaved (every decoder runs prompt i before any runs prompt i+1), after
one warm-up call each (which pays the compilation). Prints tokens/s, the ratios to eager ``ar``, and
whether the greedy outputs agree (speculative against ``ar`` of the same kind). Every call generates
exactly ``--max-new-tokens`` tokens (EOS ignored).
"""

from __future__ import annotations

import argparse
import time

import torch

from spec_decode.bench.args import add_input_args, add_run_args, add_threads_arg
from spec_decode.bench.config import METHOD_SPECS, BenchInputError, check_room, load_prompts
from spec_decode.bench.machine import torch_threads
from spec_decode.dtypes import DTYPE_NAMES, torch_dtype


def ar_and_chain(target_path, eagle_path, dtype, tag: str, *, compile: bool = False, prepare=None) -> dict:
    """``ar`` and ``eagle_chain`` (4/1/5) over their own copy of the models, named ``"ar <tag>"`` and
    ``"eagle_chain <tag>"``. ``prepare(module)``, when given, runs on the target and the head first.
    Returns {name: SpecDecoder}."""
    from spec_decode import SpecDecoder
    from spec_decode.models.eagle import load_drafter
    from spec_decode.models import Transformer

    target = Transformer.from_pretrained(target_path, dtype=dtype)
    head = load_drafter(eagle_path, target, method="eagle", dtype=dtype)
    if prepare is not None:
        for module in (target, head):
            prepare(module)
    chain = METHOD_SPECS["eagle_chain"]
    return {f"ar {tag}": SpecDecoder(target, None, method="none", compile=compile),
            f"eagle_chain {tag}": SpecDecoder(target, head, method="eagle", num_steps=chain.num_steps, topk=chain.topk,
                                              num_draft_tokens=chain.num_draft_tokens, compile=compile)}


def decoders(target_path, eagle_path, dtype, compile: bool) -> dict:
    """``ar_and_chain`` tagged "compiled" or "eager"."""
    return ar_and_chain(target_path, eagle_path, dtype, "compiled" if compile else "eager", compile=compile)


def measure(decs: dict, prompts, warm, max_new_tokens: int) -> tuple[dict, dict]:
    """Interleaved greedy calls. Returns ({name: seconds}, {name: outputs})."""
    for dec in decs.values():
        dec.generate([warm], max_new_tokens=max_new_tokens, ignore_eos=True)
    seconds, outputs = dict.fromkeys(decs, 0.0), {k: [] for k in decs}
    for prompt in prompts:
        for name, dec in decs.items():
            t0 = time.perf_counter()
            outputs[name] += [r.token_ids for r in dec.generate([prompt], max_new_tokens=max_new_tokens,
                                                                 ignore_eos=True)]
            seconds[name] += time.perf_counter() - t0
    return seconds, outputs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spec-bench compile", description=__doc__.split("\n\n")[0])
    add_input_args(p)
    add_run_args(p, num_prompts=16, max_new_tokens=64)
    p.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES, help=f"{', '.join(DTYPE_NAMES)} (default fp32)")
    add_threads_arg(p, default=1)
    return p


def checked_prompts(args, extra: int = 0) -> list[list[int]]:
    """Check the target and the EAGLE head (``run.check_models``) and read ``args.num_prompts + extra`` prompts
    (and the one after, when present; none when ``args.num_prompts`` is 0) whose longest must leave room for
    ``args.max_new_tokens``, without loading a model. Raises BenchInputError naming the option at fault."""
    from spec_decode.bench.harness import check_models

    config = check_models(args.target, {"eagle": args.eagle})
    if not args.num_prompts:
        return []
    prompts = load_prompts(args.prompts, args.num_prompts + extra, config.vocab_size)
    check_room(args.max_new_tokens, config.max_position_embeddings, prompts)
    return prompts


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    dtype = torch_dtype(args.dtype)
    try:
        prompts = checked_prompts(args)
    except BenchInputError as e:
        p.error(str(e))
    with torch_threads(args.threads):
        decs = {**decoders(args.target, args.eagle, dtype, False), **decoders(args.target, args.eagle, dtype, True)}
        seconds, outputs = measure(decs, prompts[:args.num_prompts], prompts[-1], args.max_new_tokens)
    tokens = args.num_prompts * args.max_new_tokens
    base = tokens / seconds["ar eager"]
    print(f"{args.dtype}, {args.num_prompts} prompts x {args.max_new_tokens} tokens, greedy, "
          f"{args.threads} thread(s), torch {torch.__version__}")
    for name, s in seconds.items():
        print(f"  {name:22s} {tokens / s:7.1f} tokens/s  {tokens / s / base:5.2f}x eager ar")
    print(f"  compiled over eager: ar {seconds['ar eager'] / seconds['ar compiled']:.2f}x, "
          f"eagle_chain {seconds['eagle_chain eager'] / seconds['eagle_chain compiled']:.2f}x")
    print(f"  greedy eagle_chain == ar: eager {outputs['eagle_chain eager'] == outputs['ar eager']}, "
          f"compiled {outputs['eagle_chain compiled'] == outputs['ar compiled']}")
    return 0
