"""Side by side in one process: each removed speed tweak on vs off (monkeypatched), shipped models, fp32, 1 thread.

    taskset -c 0 python tools/tweak_ab.py METHODS ROUNDS      # e.g. ar,eagle_chain,eagle_tree,draft_chain 6

On and off alternate call by call (each prompt alone, at T=0 and T=1); per round, the ratio of the summed
times off / on. Pin it to one CPU (``taskset``): a shared VM's vCPUs differ in speed.

It switches the tweaks issue 42 measured: the cached index tables and the chain drafter's ``prepare_chain``.
Run it from the root of a tree with ``PYTHONPATH=.``. Prints, per tweak, method and temperature, the median
over rounds of the time without it over the time with it. docs/performance.md has the figures.
"""
import sys, time, statistics, functools, torch
torch.set_num_threads(1)
from pathlib import Path
from spec_decode.bench.config import METHOD_SPECS, BenchConfig, load_prompts
from spec_decode.bench.methods import ModelCache
import spec_decode.models.masks as masks, spec_decode.drafting as drafting, samplers.draws as draws
import spec_decode.models.transformer as tr, spec_decode.models.eagle as eg, spec_decode.pipeline as pl
M = Path("fixtures/models")
cfg = BenchConfig(target=M/"tiny-target", draft_lm=M/"tiny-draft", eagle=M/"tiny-eagle", eagle3=M/"tiny-eagle3",
                  prompts=Path("fixtures/prompts.jsonl"), progress=False)
mc = ModelCache(cfg, "fp32", torch.device("cpu"))
prompts = load_prompts(cfg.prompts, 4, 4096)[:4]
orig = dict(pos=masks._positions, bias=masks._bias_values, pool=drafting._pool_depths, chain=drafting._chain_layout,
            race=draws.race_tail, pc_t=tr.Transformer.prepare_chain, pc_e=eg._DraftHead.prepare_chain)
def tables(on):
    masks._positions = orig["pos"] if on else (lambda n, device: torch.arange(n, device=device))
    masks._bias_values = orig["bias"] if on else orig["bias"].__wrapped__
    drafting._pool_depths = orig["pool"] if on else orig["pool"].__wrapped__
    drafting._chain_layout = orig["chain"] if on else orig["chain"].__wrapped__
    draws.race_tail = orig["race"] if on else orig["race"].__wrapped__
def prepare(on):
    if on:
        tr.Transformer.prepare_chain = orig["pc_t"]; eg._DraftHead.prepare_chain = orig["pc_e"]
    else:
        del tr.Transformer.prepare_chain; del eg._DraftHead.prepare_chain
TWEAKS = {"tables": tables, "prepare_chain": prepare}
methods = sys.argv[1].split(",")
rounds = int(sys.argv[2])
runners = {m: mc.runner(METHOD_SPECS[m]) for m in methods}
def run(m, i, T):
    t0 = time.perf_counter(); runners[m].generate([prompts[i]], 32, T, seed=i); return time.perf_counter() - t0
for f in TWEAKS.values():   # warm up both sides of every tweak
    for on in (True, False):
        f(on)
        for m in methods: run(m, 0, 0.0); run(m, 0, 1.0)
    f(True)
# on and off alternate call by call (one prompt alone, one temperature), so the machine's drift hits both alike
res = {}
for r in range(rounds):
    for name, f in TWEAKS.items():
        for m in methods:
            for T in (0.0, 1.0):
                tot = {True: 0.0, False: 0.0}
                for i in range(len(prompts)):
                    for on in ((True, False) if (r + i) % 2 == 0 else (False, True)):
                        f(on)
                        tot[on] += run(m, i, T)
                    f(True)
                res.setdefault((name, m, T), []).append(tot[False] / tot[True])
for name in TWEAKS:
    for m in methods:
        for T in (0.0, 1.0):
            q = statistics.quantiles(res[(name, m, T)], n=4)
            print(f"{name:14s} {m:14s} T={T}: off/on median {statistics.median(res[(name, m, T)]):.3f} (IQR {q[0]:.3f}-{q[2]:.3f})")
