"""The SGLang plugin across processes: ranks that run one batch agree on its counts, pipeline
stages relay them, and every rank runs the same configuration.

Words as in ``spec_decode.integrations.sglang_plugin``'s glossary (agree, relay).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import time

import torch
import torch.distributed as dist

from numerics import NanPolicy
from spec_decode.integrations.sglang_types import ABORTING_POLICIES, NanCountsOnDevice, PluginState, SGLangPluginError

logger = logging.getLogger("spec_decode.integrations.sglang_plugin")


def _has_peers(group) -> bool:
    """Whether ``group`` (a torch ProcessGroup, or None) joins this process with another one."""
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def agree(counts: torch.Tensor, groups) -> torch.Tensor:
    """Reduce ``counts`` over every rank of each group of ``groups``: the MAX and the spread (MAX - MIN).

    Shape:
        counts: int32 [k, num_reqs] (rows ``COUNTED``: nan, dead_rows, inf), the same requests
            in the same order on every rank.
        returns: int32 [2k, num_reqs] (rows ``COUNT_ROWS``): the MAX of each row over the
            ranks, then each row's spread over the ranks (0 where every rank counted alike).

    A request with NaN or +-Inf on any rank then counts so on every rank, and a request the
    ranks counted differently shows a spread, so every rank takes the same decision. The
    MIN rides in the same all-reduce as MAX of the negated counts: one collective per
    group. Groups with one rank are skipped: nothing is issued (the spread is 0). On the
    stream: a device collective is enqueued like SGLang's own sampler all-reduce; no host sync.
    """
    rows = counts.shape[0]
    reduced = torch.cat((counts, -counts))  # [2k, num_reqs]: MAX over ranks gives (max, -min)
    for group in groups:
        if _has_peers(group):
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    reduced[rows:] += reduced[:rows]  # -min + max: the spread
    return reduced


def sampler_groups(sampler) -> tuple:
    """The groups whose ranks must agree at the sampler: SGLang's own sampler sync groups."""
    return (getattr(sampler, "tp_sync_group", None), getattr(sampler, "cp_sync_group", None))


def verify_groups() -> tuple:
    """The group ``eagle_sample`` broadcasts its accept results over (attention-TP under DP attention)."""
    if not (dist.is_available() and dist.is_initialized()):
        return ()  # one process: no peer to agree with (and SGLang publishes no groups)
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    group = parallel.attn_tp_group if is_dp_attention_enabled() else parallel.tp_group
    return (group.device_group,) if group.world_size > 1 else ()


def detach_counts(logits_output) -> list:
    """Take every ``NanCountsOnDevice`` out of ``logits_output``'s auxiliary device output; return them.

    SGLang's PP transport takes one auxiliary output; a composite with another plugin's
    would not pass it, so the counts travel beside it (``add_counts_to_pp_tensors``).
    """
    from sglang.srt.managers.auxiliary_output import CompositeDeviceAuxiliaryOutput, append_auxiliary_output

    current = getattr(logits_output, "auxiliary_device_output", None)
    if current is None:
        return []
    outputs = current.outputs if isinstance(current, CompositeDeviceAuxiliaryOutput) else (current,)
    ours = [o for o in outputs if isinstance(o, NanCountsOnDevice)]
    if ours:
        rest = None
        for output in outputs:
            if not isinstance(output, NanCountsOnDevice):
                rest = append_auxiliary_output(rest, output)
        logits_output.auxiliary_device_output = rest
    return ours


def add_counts_to_pp_tensors(tensor_dict: dict, outputs) -> None:
    """Add each of ``outputs`` (``NanCountsOnDevice``) to a PP output dict with SGLang's own transport."""
    from sglang.srt.sampling.sampling_observer_pp import add_auxiliary_output_to_pp_tensors

    for output in outputs:
        add_auxiliary_output_to_pp_tensors(tensor_dict, output)


def attach_relayed_counts(state: PluginState, result, outputs) -> None:
    """Give ``result`` (a stage's rebuilt ``GenerationBatchResult``) host copies of the relayed counts.

    The copy is SGLang's own ``_async_d2h`` on the current (copy) stream, before SGLang records
    the event it waits for ahead of processing this result: no host sync. Counts whose
    columns do not match the batch's requests cannot name a request; they are dropped with
    one warning (the logits were sanitized on the last stage).
    """
    from sglang.srt.managers import utils as sglang_utils
    from sglang.srt.managers.auxiliary_output import CompositeHostAuxiliaryOutput

    usable = [o for o in outputs if o.counts.shape[-1] == len(o.rids)]  # shapes are host metadata
    if len(usable) < len(outputs) and not state.warned_pp_rows:
        state.warned_pp_rows = True
        logger.warning("safespec: relayed NaN counts do not match the batch's requests; not acted on (warned once)")
    if not usable:
        return
    result.copy_auxiliary_output_to_cpu()  # SGLang's own outputs first: it skips the copy once a host output is set
    host = [o.copy_to_host(sglang_utils._async_d2h) for o in usable]
    existing = result.auxiliary_host_output
    before = () if existing is None else getattr(existing, "outputs", (existing,))
    result.auxiliary_host_output = CompositeHostAuxiliaryOutput(tuple(before) + tuple(host))


STARTUP_TIMEOUT_ENV = "SAFESPEC_SGLANG_STARTUP_TIMEOUT_S"
DEFAULT_STARTUP_TIMEOUT_S = 600.0
"""How long a rank waits at start-up for every other rank's report. Ranks reach the check
after loading the model, so it covers the spread of their load times."""
STARTUP_KEY = "safespec_sglang_startup"
_POLL_S = 0.05


def startup_timeout_s() -> float:
    """The start-up check's bounded wait: ``$SAFESPEC_SGLANG_STARTUP_TIMEOUT_S``, else the default."""
    value = os.environ.get(STARTUP_TIMEOUT_ENV)
    return float(value) if value else DEFAULT_STARTUP_TIMEOUT_S


def _version(module: str) -> str:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def rank_config(state: PluginState) -> dict:
    """What every rank must share: its policy (or why it refused), safespec's, SGLang's, torch's and triton's versions."""
    import sglang

    from spec_decode import __version__

    policy = state.policy.value if state.refused is None else f"refused: {state.refused}"
    return {"policy": policy, "safespec": __version__, "sglang": getattr(sglang, "__version__", "unknown"),
            "torch": torch.__version__, "triton": _version("triton")}


def _gather_through_store(config: dict, group, timeout_s: float, key: str) -> list:
    """Every rank's ``config`` (rank order) through the process group's store, waiting at most ``timeout_s``.

    Each rank writes its own key and polls for the others'; a rank that never writes (no
    plugin at all) makes every waiting rank raise, naming it. A collective would instead
    block until the group's own timeout, or, with gloo's ``monitored_barrier``, bound
    only rank 0's wait.
    """
    store = dist.distributed_c10d._get_default_store()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    keys = [f"{key}/{world}/{r}" for r in range(world)]
    store.set(keys[rank], json.dumps(config))
    deadline = time.monotonic() + timeout_s
    missing = [r for r in range(world) if r != rank]
    while True:
        missing = [r for r in missing if not store.check([keys[r]])]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    if missing:
        raise SGLangPluginError(
            f"safespec SGLang plugin: rank {rank}: ranks {missing} did not report to the start-up check within "
            f"{timeout_s:g} s (${STARTUP_TIMEOUT_ENV}): the safespec plugin is not loaded there (SGLANG_PLUGINS leaves "
            "it out, or safespec is not installed on that node), or that rank is still loading its model"
        )
    return [json.loads(store.get(k)) for k in keys]


def check_ranks_agree(config: dict, group, timeout_s: float | None = None, key: str | None = None) -> None:
    """Raise ``SGLangPluginError`` naming each rank's value when the ranks of ``group`` differ on ``config``,
    or naming the ranks that did not report within ``timeout_s`` (default ``startup_timeout_s()``).

    Once at start-up, through the process group's store (``key``, default ``STARTUP_KEY``,
    names the exchange: one key per exchange and rank, never reused in one process group);
    nothing when ``group`` has one rank. A rank under ``off``, or whose plugin refused to
    register, still reports (``policy=off``, ``policy=refused: <why>``).
    """
    if not _has_peers(group):
        return
    timeout_s = startup_timeout_s() if timeout_s is None else timeout_s
    configs = _gather_through_store(config, group, timeout_s, key or STARTUP_KEY)
    differing = sorted(key_ for key_ in config if len({str(c.get(key_)) for c in configs}) > 1)
    if differing:
        by_rank = "; ".join(
            f"rank {rank}: " + ", ".join(f"{k}={c.get(k)}" for k in differing) for rank, c in enumerate(configs)
        )
        raise SGLangPluginError(
            f"safespec SGLang plugin: the ranks disagree on {', '.join(differing)} ({by_rank}); set "
            "SAFESPEC_NAN_POLICY and SGLANG_PLUGINS alike and install the same safespec, sglang, torch and "
            "triton on every node"
        )


def fall_back_without_pp_relay(state: PluginState, pp_size: int) -> None:
    """Under ``pp_size > 1`` without the PP relay, turn guard/abort into sanitize, with one warning."""
    if pp_size <= 1 or state.pp_relay_missing is None or state.policy not in ABORTING_POLICIES:
        return
    logger.warning(
        "safespec SGLang plugin: NaN policy '%s' falls back to 'sanitize' under pp_size=%d: the pipeline "
        "stages cannot all see the NaN counts, so they could not finish the same requests (%s)",
        state.policy.value,
        pp_size,
        state.pp_relay_missing,
    )
    state.policy = NanPolicy.SANITIZE


def unsupported_mode(state: PluginState, server_args) -> str | None:
    """Why this server cannot start under ``state.policy``, or None: PD disaggregation under guard/abort.

    A prefill server hands a request's first token and KV to the decode server without SGLang's
    finish check, where the plugin aborts, and the decode server's KV offload ignores
    ``skip_radix_cache_insert``: an abort could not keep a dead row from being served.
    """
    mode = str(getattr(server_args, "disaggregation_mode", None) or "null")
    if mode == "null" or state.refused is not None or state.policy not in ABORTING_POLICIES:
        return None
    return (
        f"safespec SGLang plugin: refusing --disaggregation-mode {mode} under the NaN policy "
        f"'{state.policy.value}': a dead row at prefill would reach the decode server, since SGLang's PD "
        "prefill sends the token and KV without the finish check where safespec aborts. Serve PD "
        "disaggregation with SAFESPEC_NAN_POLICY=sanitize or off (docs/sglang.md, Coverage)"
    )
