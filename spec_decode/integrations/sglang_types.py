"""The SGLang plugin's state and the NaN counts it hands to SGLang (device, host and PP forms).

Words as in ``spec_decode.integrations.sglang_plugin``'s glossary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from http import HTTPStatus

import torch

from numerics import NanPolicy

logger = logging.getLogger("spec_decode.integrations.sglang_plugin")

COUNTED = ("nan", "dead_rows", "inf")
"""What each rank counts per request: NaN entries, dead rows, +-Inf entries. Each can change the
token a rank emits, so all three are reduced across the ranks."""
COUNT_ROWS = COUNTED + tuple(f"{name}_spread" for name in COUNTED)
"""Rows of the int32 [6, num_reqs] counts tensor that rides the result copy: the MAX over the
ranks of each of ``COUNTED``, then how far apart the ranks' counts were (MAX - MIN; 0 in one
process)."""
ABORT_STATUS = HTTPStatus.INTERNAL_SERVER_ERROR
ABORT_ERR_TYPE = "NanLogitsError"
ABORTING_POLICIES = (NanPolicy.ABORT, NanPolicy.GUARD)
PP_TENSOR_PREFIX = "safespec_nan_counts."
"""Name of a site's counts in ``to_pp_tensors`` (SGLang prefixes it with its own output prefix)."""


class SGLangPluginError(RuntimeError):
    """The plugin refused to register (a hook target or a required symbol is missing), or the
    ranks' start-up check failed."""


@dataclass
class PluginState:
    """What the hooks share: the policy and the per-process warning flags."""

    policy: NanPolicy
    counts_backend: str = "auto"
    warned_partial_nan: bool = False
    announced: bool = False
    pp_relay_missing: str | None = None  # why the PP hooks could not register, if they could not
    warned_pp_rows: bool = False
    ranks_checked: bool = False
    refused: str | None = None  # why register refused; such a state only reports to the start-up check
    start_error: str | None = None  # raised by the start-up check on every rank (a bad SAFESPEC_NAN_POLICY)


@dataclass(frozen=True)
class NanCountsOnHost:
    """SGLang ``HostAuxiliaryOutput``: one site's counts after SGLang's result copy.

    Shape:
        counts: int32 [6, len(rids)] on the host (rows ``COUNT_ROWS``).
    """

    site: str
    rids: tuple
    counts: torch.Tensor

    def consume(self, batch, commits) -> None:
        """Nothing: the ``Req.update_finish_state`` hook reads the counts earlier in the step."""


@dataclass(frozen=True)
class NanCountsOnDevice:
    """SGLang ``DeviceAuxiliaryOutput``: one site's counts, copied with the sampled tokens.

    Shape:
        counts: int32 [6, len(rids)] on the logits' device (rows ``COUNT_ROWS``), a fresh
            tensor (never a CUDA-graph buffer).
    """

    site: str
    rids: tuple
    counts: torch.Tensor

    def copy_to_host(self, copy_tensor) -> NanCountsOnHost:
        return NanCountsOnHost(self.site, self.rids, copy_tensor(self.counts))

    def to_pp_tensors(self) -> dict:
        """SGLang ``PipelineParallelAuxiliaryOutput``: the counts, named by site, for the PP ring."""
        return {PP_TENSOR_PREFIX + self.site: self.counts}

    @classmethod
    def from_pp_tensors(cls, tensors, rids) -> list:
        """The inverse of ``to_pp_tensors`` on a receiving stage: one output per site found.

        ``tensors``: a stage's received output dict (keys as SGLang's transport wrote them);
        ``rids``: the requests of the batch that ran the forward, in row order.
        """
        outputs = []
        for key, counts in tensors.items():
            _, found, site = key.partition(PP_TENSOR_PREFIX)
            if found:
                outputs.append(cls(site, tuple(rids), counts))
        return outputs


def abort_message(policy: NanPolicy, rid: str, site: str, num_nans: int, dead_rows: int,
                  disagreement: str | None = None) -> str:
    """The ``FINISH_ABORT`` message of a request aborted by ``policy`` at ``site``."""
    if disagreement is not None:
        what = disagreement
    elif policy is NanPolicy.GUARD:
        what = f"{dead_rows} dead logit rows (no finite value)"
    else:
        what = f"{num_nans} NaN logits"
    return (
        f"safespec: request {rid} aborted by the safespec NaN policy '{policy.value}': {what} "
        f"at SGLang {site}; its KV is kept out of the prefix cache"
    )


def describe_disagreement(counts, spreads) -> str:
    """One request's counts over the ranks, as ranges (min-max) of NaN, dead rows and +-Inf."""
    (nans, dead, infs), (nan_spread, dead_spread, inf_spread) = counts, spreads
    return (f"the ranks disagree: {nans - nan_spread}-{nans} NaN logits and {dead - dead_spread}-{dead} dead rows "
            f"and {infs - inf_spread}-{infs} +-Inf logits across the ranks")


def decide_aborts(state: PluginState, host: NanCountsOnHost) -> dict:
    """Return {rid: abort message} for one site's host counts under ``state.policy``.

    Reads host memory only (SGLang's copy, after its ``copy_done`` wait). A request the
    ranks counted differently (NaN, dead rows or +-Inf) is aborted and logged, naming it and
    the ranks' counts. Under guard, partial NaN every rank saw alike is logged once per process.
    """
    aborts = {}
    partial = []
    # Host memory: SGLang already waited for this copy (copy_done) before processing the result.
    for rid, *values in zip(host.rids, *host.counts.tolist()):
        counts, spreads = values[:len(COUNTED)], values[len(COUNTED):]
        num_nans, dead_rows, _ = counts
        trigger = dead_rows if state.policy is NanPolicy.GUARD else num_nans
        if any(spreads):
            disagreement = describe_disagreement(counts, spreads)
            logger.error("safespec: request %s at SGLang %s: %s; aborting it on every rank", rid, host.site,
                         disagreement)
            aborts[rid] = abort_message(state.policy, rid, host.site, num_nans, dead_rows, disagreement)
        elif trigger:
            aborts[rid] = abort_message(state.policy, rid, host.site, num_nans, dead_rows)
        elif num_nans:
            partial.append(f"{rid} ({num_nans} NaN)")
    if aborts:
        logger.error("safespec: non-finite logits at SGLang %s; aborting %s", host.site, ", ".join(aborts))
    if partial and not state.warned_partial_nan:
        state.warned_partial_nan = True
        logger.warning(
            "safespec: NaN logits sanitized at SGLang %s for %s (policy 'guard' aborts dead rows only; "
            "warned once per process)",
            host.site,
            ", ".join(partial),
        )
    return aborts


def mark_aborted(req, message: str, withheld: int = 0) -> None:
    """Finish ``req`` with ``FINISH_ABORT`` at its finish check and bar its KV from the radix cache.

    SGLang's own "abort a running request" path: ``to_finish`` is consumed by
    ``Req.update_finish_state``; ``skip_radix_cache_insert`` makes ``release_kv_cache``
    free the KV without inserting it into the tree. ``withheld``: how many tokens at the
    end of ``req.output_ids`` came from the corrupted step; ``finished_len`` ends the
    output before them, so no stream chunk carries them. A finish already pending (a client
    abort in the same step) keeps its reason, but the KV stays out of the tree and the
    corrupted tokens are withheld all the same.
    """
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.skip_radix_cache_insert = True
    if req.finished():
        return
    if req.to_finish is None:
        req.to_finish = FINISH_ABORT(message, ABORT_STATUS, ABORT_ERR_TYPE)
    if withheld and req.finished_len is None:
        req.finished_len = max(len(req.output_ids) - withheld, 0)


def host_counts(result) -> list:
    """Every ``NanCountsOnHost`` of ``result``; a copy SGLang did not make is made here (synced)."""
    host = getattr(result, "auxiliary_host_output", None)
    if host is None:
        logits_output = getattr(result, "logits_output", None)
        device = getattr(logits_output, "auxiliary_device_output", None)
        if device is None:
            return []
        # Host sync, a fallback only: a result path that skipped SGLang's copy (none in 0.5.23's
        # plain, overlap or spec paths; under PP, pp_recv_hook copies) would otherwise drop the counts.
        host = device.copy_to_host(lambda t: t.cpu())
    outputs = getattr(host, "outputs", (host,))
    return [o for o in outputs if isinstance(o, NanCountsOnHost)]


def attach_counts(logits_output, device_counts: NanCountsOnDevice) -> None:
    """Append ``device_counts`` to the step's auxiliary device output (dropping a stale one of ours)."""
    from sglang.srt.managers.auxiliary_output import CompositeDeviceAuxiliaryOutput, append_auxiliary_output

    current = logits_output.auxiliary_device_output
    outputs = current.outputs if isinstance(current, CompositeDeviceAuxiliaryOutput) else (current,)
    # A CUDA-graph runner may hand back a reused LogitsProcessorOutput: never carry last step's counts.
    kept = [o for o in outputs if o is not None and not isinstance(o, NanCountsOnDevice)]
    current = None
    for output in kept:
        current = append_auxiliary_output(current, output)
    logits_output.auxiliary_device_output = append_auxiliary_output(current, device_counts)
