"""Side by side in one process: the batch-invariant CPU routes against the fastest ones (``batch_invariant=False``).

    PYTHONPATH=. taskset -c 0 python tools/invariant_ab.py METHODS ROUNDS [DTYPES] [PROMPTS] [TOKENS] [MODEL]
    # the tiny models: ar,eagle_chain,eagle_tree,eagle3_tree,draft_chain,eagle_lookup,eagle_auto 6 bf16,fp32 4 32
    # SmolLM2-135M-Instruct as the target (methods without a drafter): ar,lookup 6 bf16,fp32 4 32 smollm2

One torch thread, the shipped models (``fixtures/models``; MODEL ``smollm2``: SmolLM2 from the smollm2 extra
as the target), loaded once per dtype and switched in place with ``spec_decode.models.set_batch_invariant``
(target and drafters alike). The two settings alternate call by call (each prompt alone, at T=0 and T=1,
seeded, ``ignore_eos``; ABBA order by round and prompt), so a shared VM's drift hits both alike; pin it to
one CPU (``taskset``): a shared VM's vCPUs differ in speed. Greedy tokens are checked against ``ar``'s
under the invariant routes (they must be equal in both dtypes).

Prints, per dtype, method and temperature, the median over rounds of (invariant time / fastest time):
above 1, the invariant routes are slower. docs/performance.md keeps the figures.
"""
import statistics
import sys
import time
from pathlib import Path

import torch

from spec_decode.bench.config import METHOD_SPECS, BenchConfig, load_prompts
from spec_decode.bench.methods import ModelCache
from spec_decode.models import set_batch_invariant

torch.set_num_threads(1)
M = Path("fixtures/models")
methods = sys.argv[1].split(",")
rounds = int(sys.argv[2])
dtypes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["bf16", "fp32"]
num_prompts = int(sys.argv[4]) if len(sys.argv) > 4 else 4
tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 32
target = M / "tiny-target"
if len(sys.argv) > 6 and sys.argv[6] == "smollm2":
    from spec_decode import fixtures

    target = fixtures.smollm2_target_dir()
cfg = BenchConfig(target=target, draft_lm=M / "tiny-draft", eagle=M / "tiny-eagle",
                  eagle3=M / "tiny-eagle3", prompts=Path("fixtures/prompts.jsonl"), progress=False)
prompts = load_prompts(cfg.prompts, num_prompts, 4096)[:num_prompts]

for dtype in dtypes:
    mc = ModelCache(cfg, dtype, torch.device("cpu"))
    runners = {m: mc.runner(METHOD_SPECS[m]) for m in methods}
    models = [m for m in mc._models.values() if isinstance(m, torch.nn.Module)]

    def switch(on: bool) -> None:
        for model in models:
            set_batch_invariant(model, on)

    def run(m: str, i: int, T: float) -> float:
        t0 = time.perf_counter()
        runners[m].generate([prompts[i]], tokens, T, seed=i)
        return time.perf_counter() - t0

    for on in (True, False):   # warm up both settings: panels, packed weights, kernels
        switch(on)
        for m in methods:
            run(m, 0, 0.0)
            run(m, 0, 1.0)
    switch(True)
    ar = [runners["ar"].generate([p], tokens, 0.0, seed=0).tokens[0] for p in prompts] if "ar" in runners else None
    res = {}
    for r in range(rounds):
        for m in methods:
            for T in (0.0, 1.0):
                tot = {True: 0.0, False: 0.0}
                for i in range(len(prompts)):
                    for on in ((True, False) if (r + i) % 2 == 0 else (False, True)):
                        switch(on)
                        tot[on] += run(m, i, T)
                res.setdefault((m, T), []).append(tot[True] / tot[False])
    switch(True)
    for (m, T), ratios in res.items():
        same = ""
        if ar is not None and T == 0.0:
            out = [runners[m].generate([p], tokens, 0.0, seed=0).tokens[0] for p in prompts]
            same = "  greedy==ar" if out == ar else "  GREEDY DIFFERS FROM AR"
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"{dtype} {m:>22} T={T:g}  invariant/fastest {statistics.median(ratios):.3f}  "
              f"(IQR {q[0]:.3f}-{q[2]:.3f}){same}", flush=True)
