"""Interleaved speed comparison of two source trees over the benchmark's methods of ours.

    python tools/speed_ab.py BASE_TREE NEW_TREE [--dtypes fp32,bf16] [--rounds 4] [--prompts 4] [--tokens 32] [--methods a,b]

Each measurement is a fresh subprocess with ``PYTHONPATH`` set to one tree and one torch thread: it
loads the shipped models (``fixtures/models`` of that tree) once, warms every method up, then times
``generate`` per method (each prompt alone, as ``spec-bench`` does by default, at T=0 and T=1, seeded,
``ignore_eos``). Trees alternate within each round (ABBA order across rounds), so drift on a shared
machine hits both alike. Prints, per dtype and method, the median over rounds of each tree's time and
NEW / BASE (below 1: the new tree is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r'''
import json, sys, time
import torch
torch.set_num_threads(1)
from pathlib import Path
from spec_decode.bench.config import METHOD_SPECS, BenchConfig, load_prompts
from spec_decode.bench.methods import ModelCache
root, dtype, n, tokens = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
only = sys.argv[5].split(",") if sys.argv[5] else None
M = root / "fixtures" / "models"
cfg = BenchConfig(target=M / "tiny-target", draft_lm=M / "tiny-draft", eagle=M / "tiny-eagle",
                  eagle3=M / "tiny-eagle3", prompts=root / "fixtures" / "prompts.jsonl", dtypes=(dtype,), progress=False)
models = ModelCache(cfg, dtype, torch.device("cpu"))
prompts = load_prompts(cfg.prompts, n, models.get("target").config.vocab_size)[:n]
keys = [k for k, s in METHOD_SPECS.items() if s.engine == "ours" and (only is None or k in only)]
runners = {k: models.runner(METHOD_SPECS[k]) for k in keys}
for k in keys:   # warm-up: kernels, panels, packed weights
    runners[k].generate(prompts[:1], tokens, 0.0, seed=0)
    runners[k].generate(prompts[:1], tokens, 1.0, seed=0)
out = {}
for k in keys:
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        for T in (0.0, 1.0):
            runners[k].generate([p], tokens, T, seed=i)
    out[k] = time.perf_counter() - t0
print(json.dumps(out))
'''


def measure(tree: Path, dtype: str, prompts: int, tokens: int, methods: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", WORKER, str(tree), dtype, str(prompts), str(tokens), methods],
                         env=env,
                         cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--methods", default="", help="comma list of method keys (default: every method of ours)")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    for dtype in args.dtypes.split(","):
        times = {"base": [], "new": []}
        for r in range(args.rounds):
            order = ("base", "new") if r % 2 == 0 else ("new", "base")
            for name in order:
                times[name].append(measure(getattr(args, name), dtype, args.prompts, args.tokens, args.methods))
            print(f"  {dtype} round {r + 1}/{args.rounds} done (load {os.getloadavg()[0]:.2f})", flush=True)
        print(f"\n{dtype}: seconds per method (median of {args.rounds} rounds; {args.prompts} prompts x "
              f"{args.tokens} tokens at T=0 and T=1)")
        print(f"| method | base s | new s | new/base | per-round new/base |\n|---|---|---|---|---|")
        for key in times["base"][0]:
            b = statistics.median(t[key] for t in times["base"])
            n = statistics.median(t[key] for t in times["new"])
            rounds = " ".join(f"{tn[key] / tb[key]:.3f}" for tb, tn in zip(times["base"], times["new"]))
            print(f"| {key} | {b:.3f} | {n:.3f} | {n / b:.3f} | {rounds} |", flush=True)
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
