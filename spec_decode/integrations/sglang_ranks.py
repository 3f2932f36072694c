"""The SGLang plugin across processes: ranks that run one batch agree on its counts, pipeline
stages relay them, and every rank runs the same configuration.

Words as in ``spec_decode.integrations.sglang_plugin``'s glossary (agree, relay).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from numerics import NanPolicy
from spec_decode.integrations.sglang_types import ABORTING_POLICIES, NanCountsOnDevice, PluginState, SGLangPluginError

logger = logging.getLogger("spec_decode.integrations.sglang_plugin")


def _has_peers(group) -> bool:
    """Whether ``group`` (a torch ProcessGroup, or None) joins this process with another one."""
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def agree(counts: torch.Tensor, groups) -> torch.Tensor:
    """Make ``counts`` the element-wise MAX over every rank of each group of ``groups``, in place.

    Shape:
        counts: int32 [2, num_reqs], the same requests in the same order on every rank.

    A request with NaN on any rank then counts as NaN on all of them, so all finish it in
    the same step. Groups with one rank are skipped: nothing is issued. On the stream: a
    device collective is enqueued like SGLang's own sampler all-reduce; no host sync.
    """
    for group in groups:
        if _has_peers(group):
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    return counts


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


def _detach_counts(logits_output) -> list:
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


def rank_config(state: PluginState) -> dict:
    """What every rank must share: the plugin's policy and version, and SGLang's version."""
    import sglang

    from spec_decode import __version__

    return {"policy": state.policy.value, "safespec": __version__, "sglang": getattr(sglang, "__version__", "unknown")}


def check_ranks_agree(config: dict, group) -> None:
    """Raise ``SGLangPluginError`` naming each rank's value when the ranks of ``group`` differ on ``config``.

    One ``all_gather_object`` on ``group`` (a CPU/gloo group), once at start-up; nothing
    when ``group`` has one rank.
    """
    if not _has_peers(group):
        return
    configs = [None] * dist.get_world_size(group)
    dist.all_gather_object(configs, config, group=group)
    differing = sorted(key for key in config if len({str(c.get(key)) for c in configs}) > 1)
    if differing:
        by_rank = "; ".join(
            f"rank {rank}: " + ", ".join(f"{key}={c.get(key)}" for key in differing) for rank, c in enumerate(configs)
        )
        raise SGLangPluginError(
            f"safespec SGLang plugin: the ranks disagree on {', '.join(differing)} ({by_rank}); set "
            "SAFESPEC_NAN_POLICY and install the same safespec and sglang on every node"
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
