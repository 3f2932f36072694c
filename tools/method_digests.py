"""Print one digest per spec-bench method of ours: the tokens of 4 prompts x 32 new tokens, T=0 and T=1.

Run it on two trees to check that a change keeps every output bit for bit:
    PYTHONPATH=<tree> python tools/method_digests.py [--dtype fp32]
Greedy (T=0) outputs are also checked against ``ar`` (the line ends in ``greedy==ar``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

from spec_decode.bench.config import METHOD_SPECS, BenchConfig, load_prompts
from spec_decode.bench.methods import ModelCache

ROOT = Path.cwd()   # run from the root of the tree under test
MODELS = ROOT / "fixtures" / "models"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = BenchConfig(target=MODELS / "tiny-target", draft_lm=MODELS / "tiny-draft", eagle=MODELS / "tiny-eagle",
                      eagle3=MODELS / "tiny-eagle3", prompts=ROOT / "fixtures" / "prompts.jsonl",
                      dtypes=(args.dtype,), progress=False)
    models = ModelCache(cfg, args.dtype, torch.device("cpu"))
    vocab = models.get("target").config.vocab_size
    prompts = load_prompts(cfg.prompts, args.prompts, vocab)[:args.prompts]
    ours = [k for k, s in METHOD_SPECS.items() if s.engine == "ours"]
    greedy_ar = None
    for key in ours:
        runner = models.runner(METHOD_SPECS[key])
        outs = {t: runner.generate(prompts, args.tokens, t, seed=1234).tokens for t in (0.0, 1.0)}
        if key == "ar":
            greedy_ar = outs[0.0]
        digest = hashlib.sha256(json.dumps(outs[0.0] + outs[1.0]).encode()).hexdigest()[:16]
        print(f"{key:24s} {digest}  greedy==ar: {outs[0.0] == greedy_ar}", flush=True)


if __name__ == "__main__":
    main()
