"""Interleaved speed comparison of two source trees over the benchmark's methods of ours.

    python tools/speed_ab.py BASE_TREE NEW_TREE [--dtypes fp32,bf16] [--workers 3] [--trials 8]
                             [--prompts 4] [--tokens 32] [--methods a,b] [--temperatures 0,1]
                             [--suite tiny|smollm2]

For each dtype it starts ``--workers`` pairs of long-lived worker processes, one per tree and pair,
each with ``PYTHONPATH`` set to its tree and one torch thread. A worker loads that tree's shipped models
(``fixtures/models``; ``--suite smollm2``: SmolLM2-135M-Instruct, that tree's EAGLE-3 head for it and the
HumanEval prompts) once and warms every method up. One timing of a method sums its ``generate`` calls
over every prompt alone, at each of ``--temperatures`` (T=0 and T=1 by default), seeded, ``ignore_eos``,
as ``spec-bench`` runs by default; the driver sends each call to the two workers of a pair in turn (ABBA
order), so only one worker runs at a time and the two trees' calls are a fraction of a second apart. A shared VM's speed drifts by tens of
percent over seconds; interleaving call by call makes that drift hit both trees alike. Both workers of a
pair are pinned to the same CPU (pair w to the w-th CPU, round robin): the vCPUs of a shared VM differ
in speed, and a process that stays on a slower one would bias its tree. Several pairs of processes
average out what still differs between processes (allocation addresses, cache placement).

Prints, per dtype and method, each tree's median seconds, NEW / BASE over the summed seconds and as the
median over all pairs of timings with its interquartile range (below 1: the new tree is faster).
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
import json, os, sys, time
os.sched_setaffinity(0, {int(sys.argv[6])})
import torch
torch.set_num_threads(1)
from pathlib import Path
from spec_decode.bench.config import METHOD_SPECS, BenchConfig, load_prompts
from spec_decode.bench.methods import ModelCache
root, dtype, n, tokens = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
only = sys.argv[5].split(",") if sys.argv[5] else None
M = root / "fixtures" / "models"
if sys.argv[7] == "smollm2":   # the real model, its shipped EAGLE-3 head, HumanEval
    from spec_decode.bench.prompt_sets import smollm2_prompt_file
    from spec_decode.fixtures import smollm2_target_dir
    models_of = dict(target=smollm2_target_dir(), draft_lm=None, eagle=None, eagle3=M / "smollm2-eagle3",
                     prompts=smollm2_prompt_file("humaneval"))
else:
    models_of = dict(target=M / "tiny-target", draft_lm=M / "tiny-draft", eagle=M / "tiny-eagle",
                     eagle3=M / "tiny-eagle3", prompts=root / "fixtures" / "prompts.jsonl")
ours = tuple(k for k, s in METHOD_SPECS.items() if s.engine == "ours" and (only is None or k in only))
cfg = BenchConfig(**models_of, methods=ours, dtypes=(dtype,), progress=False)
models = ModelCache(cfg, dtype, torch.device("cpu"))
prompts = load_prompts(cfg.prompts, n, models.get("target").config.vocab_size)[:n]
keys = list(cfg.resolve_methods())   # without the methods whose drafter this suite lacks
runners = {k: models.runner(METHOD_SPECS[k]) for k in keys}
for k in keys:   # warm-up: kernels, panels, packed weights
    runners[k].generate(prompts[:1], tokens, 0.0, seed=0)
    runners[k].generate(prompts[:1], tokens, 1.0, seed=0)
print(json.dumps([keys, len(prompts)]), flush=True)
for line in sys.stdin:
    k, i, T = line.split()
    t0 = time.perf_counter()
    runners[k].generate([prompts[int(i)]], tokens, float(T), seed=int(i))
    print(json.dumps(time.perf_counter() - t0), flush=True)
'''


CPUS = sorted(os.sched_getaffinity(0))


class Worker:
    """One long-lived process timing methods of one tree on request."""

    def __init__(self, tree: Path, dtype: str, prompts: int, tokens: int, methods: str, cpu: int, suite: str):
        env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tree), dtype, str(prompts), str(tokens),
                                      methods, str(cpu), suite], env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.keys, self.prompts = json.loads(self._read())

    def _read(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return line

    def time(self, key: str, prompt: int, temperature: float) -> float:
        """Seconds of one ``generate`` call: prompt ``prompt`` alone, at ``temperature``, seeded with its index."""
        self.proc.stdin.write(f"{key} {prompt} {temperature}\n")
        self.proc.stdin.flush()
        return json.loads(self._read())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def units(prompts: int, temperatures: tuple[float, ...]) -> list[tuple[int, float]]:
    """The calls one timing of a method sums: each prompt at each temperature."""
    return [(i, t) for i in range(prompts) for t in temperatures]


def compare(args: argparse.Namespace, dtype: str) -> dict[str, dict[str, list[float]]]:
    """Seconds per method and tree, each list holding one timing per (worker pair, trial), paired by index."""
    times: dict[str, dict[str, list[float]]] = {}
    for w in range(args.workers):
        cpu = CPUS[w % len(CPUS)]
        pair = {name: Worker(getattr(args, name), dtype, args.prompts, args.tokens, args.methods, cpu, args.suite)
                for name in ("base", "new")}
        for trial in range(args.trials):
            for key in pair["new"].keys:
                total = {"base": 0.0, "new": 0.0}
                for u, (prompt, temperature) in enumerate(units(pair["new"].prompts, args.temperatures)):
                    order = ("base", "new") if (trial + w + u) % 2 == 0 else ("new", "base")
                    for name in order:
                        total[name] += pair[name].time(key, prompt, temperature)
                for name, t in total.items():
                    times.setdefault(key, {"base": [], "new": []})[name].append(t)
        for worker in pair.values():
            worker.close()
        print(f"  {dtype}: worker pair {w + 1}/{args.workers} done (load {os.getloadavg()[0]:.2f})", flush=True)
    return times


def report(dtype: str, times: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> None:
    print(f"\n{dtype}: new/base per method, over {args.workers} worker pairs x {args.trials} trials "
          f"({args.prompts} prompts x {args.tokens} tokens at T={','.join(f'{t:g}' for t in args.temperatures)}"
          f"{', SmolLM2-135M-Instruct on HumanEval' if args.suite == 'smollm2' else ''})")
    print("| method | base s (median) | new s (median) | new/base, summed s | new/base, median of pairs | IQR |\n"
          "|---|---|---|---|---|---|")
    for key, t in times.items():
        ratios = sorted(n / b for b, n in zip(t["base"], t["new"]))
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"| {key} | {statistics.median(t['base']):.3f} | {statistics.median(t['new']):.3f} | "
              f"{sum(t['new']) / sum(t['base']):.3f} | {statistics.median(ratios):.3f} | {q1:.3f}-{q3:.3f} |",
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--workers", type=int, default=3, help="pairs of worker processes per dtype")
    ap.add_argument("--trials", type=int, default=8, help="timings per method and worker")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--temperatures", type=lambda s: tuple(float(t) for t in s.split(",")), default=(0.0, 1.0),
                    help="comma list: the temperatures each timing sums (default 0,1)")
    ap.add_argument("--suite", choices=("tiny", "smollm2"), default="tiny",
                    help="tiny: the shipped tiny models (default); smollm2: the real model and its EAGLE-3 head")
    ap.add_argument("--methods", default="", help="comma list of method keys (default: every method of ours)")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    for dtype in args.dtypes.split(","):
        report(dtype, compare(args, dtype), args)
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
