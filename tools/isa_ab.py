"""End to end, in one process: the invariant panel kernel's AVX-512 path against its AVX2 path
(``spec_decode.cpu.cpu_gemm.set_isa``), SmolLM2 bf16 and fp32, `ar` and `lookup`, calls alternated.

    taskset -c 1 python tools/isa_ab.py   # docs/performance.md keeps the figures
"""
import json
import statistics
import time

import torch

torch.set_num_threads(1)
from spec_decode import SpecDecoder
from spec_decode.cpu import cpu_gemm
from spec_decode.bench.prompt_sets import smollm2_prompt_file
from spec_decode.fixtures import smollm2_target_dir
from spec_decode.models import Transformer
d = smollm2_target_dir()
prompts = [json.loads(l)["token_ids"] for l in open(smollm2_prompt_file("humaneval"))][:4]
for dt in (torch.bfloat16, torch.float32):
    target = Transformer.from_pretrained(d, dtype=dt)
    for name, dec in (("ar", SpecDecoder(target, None, method="none")),
                      ("lookup", SpecDecoder(target, None, method="none", lookup_ngram=3))):
        ratios, toks = [], {}
        for rnd in range(3):
            for i, p in enumerate(prompts):
                t = {}
                order = ("avx2", None) if (rnd + i) % 2 == 0 else (None, "avx2")
                for isa in order:
                    cpu_gemm.set_isa(isa)
                    s = time.perf_counter()
                    r = dec.generate([p], max_new_tokens=64, ignore_eos=True)[0]
                    t[isa] = time.perf_counter() - s
                    toks.setdefault((isa, i), r.token_ids)
                ratios.append(t[None] / t["avx2"])
        cpu_gemm.set_isa(None)
        same = all(toks[("avx2", i)] == toks[(None, i)] for i in range(len(prompts)))
        print(f"{dt} {name}: avx512/avx2 time median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f} max {max(ratios):.3f}); same tokens: {same}", flush=True)
