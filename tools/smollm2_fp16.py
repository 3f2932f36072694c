"""fp16 verification on the real model: does SmolLM2-135M-Instruct overflow on the benchmark's prompts?

For each prompt set (``spec_decode.bench.prompt_sets``), the first ``--num-prompts`` prompts:
1. fp32 greedy ``ar`` for ``--max-new-tokens`` tokens, then one fp32 forward over prompt + reply that
   records the largest |value| of the residual stream (after every layer) and of the logits;
2. the same requests with fp16 verification under ``nan_policy="guard"``: the NaN events it records
   and whether its tokens equal fp32's.
Prints one line per prompt and a summary per set against fp16's largest finite value (65,504).

    python tools/smollm2_fp16.py --num-prompts 16 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json

import torch

from spec_decode import SpecDecoder, fixtures
from spec_decode.bench.prompt_sets import smollm2_prompt_file
from spec_decode.models import Transformer

FP16_MAX = torch.finfo(torch.float16).max


def largest_activation(model: Transformer, tokens: list[int]) -> tuple[float, float]:
    """(max |residual stream| over every layer, max |logit|) of one fp32 forward over ``tokens``."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = model(ids, model.new_cache(1, len(tokens)), aux_layers=tuple(range(model.config.num_hidden_layers)))
    return max(a.abs().max().item() for a in out.aux_hidden), out.logits.abs().max().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(1)
    target_dir = fixtures.smollm2_target_dir()
    fp32 = Transformer.from_pretrained(target_dir, dtype=torch.float32)
    fp16 = SpecDecoder.from_pretrained(target_dir, None, method="none", dtype="fp16", device="cpu",
                                       nan_policy="guard")
    ar32 = SpecDecoder(fp32, None, method="none")
    for name in ("humaneval", "chat"):
        path = smollm2_prompt_file(name)
        prompts = [json.loads(line)["token_ids"] for line in open(path)][:args.num_prompts]
        worst, events, equal = 0.0, 0, 0
        for i, prompt in enumerate(prompts):
            (r32,) = ar32.generate([prompt], max_new_tokens=args.max_new_tokens, ignore_eos=True)
            resid, logit = largest_activation(fp32, prompt + r32.token_ids)
            (r16,) = fp16.generate([prompt], max_new_tokens=args.max_new_tokens, ignore_eos=True)
            worst = max(worst, resid, logit)
            events += len(r16.nan_events)
            equal += r16.token_ids == r32.token_ids
            print(f"{name}[{i}] max|residual| {resid:9.1f}  max|logit| {logit:6.1f}  fp16 NaN events "
                  f"{len(r16.nan_events)}  finish {r16.finish_reason}  fp16 tokens == fp32: "
                  f"{r16.token_ids == r32.token_ids}", flush=True)
        print(f"== {name}: {len(prompts)} prompts x {args.max_new_tokens} tokens; largest |activation| {worst:.1f} "
              f"= {worst / FP16_MAX:.3f} of fp16's limit; fp16 NaN events {events}; fp16 tokens equal fp32's on "
              f"{equal}/{len(prompts)} prompts", flush=True)


if __name__ == "__main__":
    main()
