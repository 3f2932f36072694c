"""Test-only SGLang plugin: a dead logit row on one tensor-parallel rank only.

Found by SGLang's ``load_plugins`` through ``safespec_test_faults-0.0.0.dist-info`` beside
this file (this folder is on the path of every process in ``.venv-sglang``). Inert unless
``$SAFESPEC_TEST_NAN_ON_RANK`` is ``"<tp rank>:<rid>[:argmax]"`` (several, comma-separated):
then, on that rank only, the request's row of the sampler logits becomes all NaN (a dead
row), or with ``:argmax`` only its largest logit becomes NaN (a partial NaN that changes
the greedy token), before ``ModelRunner.sample`` runs (so before safespec's sampler hook),
as a fault on one device would. The other ranks see clean logits: only safespec's
agreement makes them finish the request too.
"""

from __future__ import annotations

import os

FAULT_ENV = "SAFESPEC_TEST_NAN_ON_RANK"
TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.sample"


def register() -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    faults = {}  # rid -> (tp rank, mode)
    for item in spec.split(","):
        rank, rid, *mode = item.split(":")
        faults[rid] = (int(rank), mode[0] if mode else "row")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def plant_nan(original_fn, runner, logits_output, forward_batch, *args, **kwargs):
        from sglang.srt.runtime_context import get_parallel

        rids = getattr(forward_batch, "rids", None) or []
        for rid, (rank, mode) in faults.items():
            if get_parallel().tp_rank == rank and rid in rids:
                row = logits_output.next_token_logits[rids.index(rid)]
                if mode == "argmax":
                    row[row.argmax()] = float("nan")
                else:
                    row.fill_(float("nan"))
        return original_fn(runner, logits_output, forward_batch, *args, **kwargs)

    HookRegistry.register(TARGET, plant_nan, HookType.AROUND)
