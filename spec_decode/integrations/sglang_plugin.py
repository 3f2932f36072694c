"""SGLang plugin: safespec's NaN policy at SGLang's sampler and EAGLE verify sites.

Supported: sglang 0.5.23. SGLang's ``load_plugins`` calls ``register`` through the entry point
``safespec`` of ``sglang.srt.plugins`` (allow-listed with ``SGLANG_PLUGINS=safespec``); ``register``
only *registers* hooks with SGLang's ``HookRegistry``, which ``load_plugins`` applies afterwards.

Glossary (words as in ``numerics.policy``: NaN, Inf, non-finite, dead row):
    site: where logits are decided on, after SGLang's penalties, ``logit_bias`` and grammar mask
        and before watermarking, at both sites. ``sampler``: ``ModelRunner._preprocess_logits``,
        one row per request (prefill and plain decode). ``verify``: ``eagle_sample``, the EAGLE
        target logits of the draft tree, ``draft_token_num`` rows per request.
    rid: SGLang's request id (``Req.rid``); errors and aborts name it.
    counts: per request, its NaN entries, dead rows and +-Inf entries at one site and step, the
        MAX over the ranks, and how far apart the ranks' counts were (the spread)
        (int32 ``[6, num_reqs]`` on the device, rows ``COUNT_ROWS``, ``NanCountsOnDevice``).
    ride: the counts travel as a ``DeviceAuxiliaryOutput`` on the step's ``LogitsProcessorOutput``,
        in the device-to-host copy of the sampled ids (``copy_to_cpu``): no extra sync.
    agree: the counts and their negation are all-reduced with MAX in one collective over the
        ranks that must agree (``tp_sync_group``/``cp_sync_group``; at verify, ``eagle_sample``'s
        group), so every rank decides alike; nothing when the group has one rank.
    disagree: the ranks counted a request differently (a spread above 0), so their tokens may
        differ: corruption, aborted on every rank under guard and abort.
    relay: under pipeline parallelism the counts ride the stage-to-stage output dict round the
        ring (``NanCountsOnDevice.to_pp_tensors``), so every stage aborts the same requests.
    abort: the request finishes with ``FINISH_ABORT`` (HTTP 500, err_type
        ``NanLogitsError``, a message naming the rid and the policy) and
        ``skip_radix_cache_insert``, so its KV is freed instead of entering the radix
        (prefix) cache. Other requests keep running.

Policy (``SAFESPEC_NAN_POLICY`` or ``register(nan_policy=...)``, ``numerics.NanPolicy``; what each
guarantees across ranks: ``docs/sglang.md``): ``off`` registers the start-up check only;
``sanitize`` cleans in place with no collective, so it cannot make ranks agree; ``guard`` (default)
counts, sanitizes and aborts dead rows and requests the ranks disagree on; ``abort`` aborts any NaN;
``raise`` reads the counts on the host (one sync per call) and raises ``NanLogitsError``.

Ranks: at start-up every rank, under ``off`` or refused too, reports its policy and versions
through the process group's store with a bounded wait (``sglang_ranks.check_ranks_agree``): a
mismatch, or a rank that never reports, fails the start on every rank naming them. Under
``pp_size > 1`` without SGLang's PP output path (``PP_HOOK_TARGETS``), ``guard``/``abort`` fall back
to ``sanitize`` with one warning.

Layout: the hooks and ``register`` here; the state and the counts' forms in ``sglang_types``;
agreement across ranks and the PP relay in ``sglang_ranks`` (names re-exported here).

Draft side: where rejection sampling reads them, ``verify_input.draft_probs`` rows holding NaN, Inf
or negative entries are cleaned in place before ``eagle_sample`` (those entries -> 0, the row
renormalised; a row with no mass left is all zeros, so SGLang rejects its drafts). Other rows keep
their bits. No host sync.

Refused: beam search requests (SGLang rejects them with the plugin's message) and, under guard and
abort, PD disaggregation and a bad ``SAFESPEC_NAN_POLICY`` (the start-up check fails on every rank).
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import pkgutil
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from numerics import NanPolicy, nonfinite_counts_per_request, raise_if_nan_logits, sanitize_nan_logits
from samplers import clean_probs
from spec_decode.integrations.sglang_ranks import (add_counts_to_pp_tensors, agree, attach_relayed_counts,
                                                   check_ranks_agree, fall_back_without_pp_relay, rank_config,
                                                   sampler_groups, unsupported_mode, verify_groups, detach_counts)
from spec_decode.integrations.sglang_types import (  # noqa: F401 (re-exported: COUNT_ROWS, ABORT_*, abort_message)
    ABORT_ERR_TYPE, ABORT_STATUS, ABORTING_POLICIES, COUNT_ROWS, PP_TENSOR_PREFIX, NanCountsOnDevice, NanCountsOnHost,
    PluginState, SGLangPluginError, abort_message, attach_counts, decide_aborts, host_counts, mark_aborted)

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG_VERSION = "0.5.23"

SAMPLER_TARGET = "sglang.srt.layers.sampler.Sampler._preprocess_logits"
SAMPLE_CONTEXT_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.sample"
PREPROCESS_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner._preprocess_logits"
BEAM_TARGET = "sglang.srt.beam_search.coordinator.BeamCoordinator.validate_and_init"
VERIFY_TARGET = "sglang.srt.speculative.eagle_utils.eagle_sample"
RESULT_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
FINISH_TARGET = "sglang.srt.managers.schedule_batch.Req.update_finish_state"
ANNOUNCE_TARGET = "sglang.srt.managers.scheduler.configure_scheduler_process"
RANKS_TARGET = "sglang.srt.managers.scheduler.Scheduler.init_model_worker"
PP_SEND_TARGET = "sglang.srt.managers.scheduler_pp_mixin.SchedulerPPMixin._pp_prepare_tensor_dict"
PP_RECV_TARGET = "sglang.srt.managers.scheduler_pp_mixin.SchedulerPPMixin._pp_prep_batch_result"
PP_HOOK_TARGETS = (PP_SEND_TARGET, PP_RECV_TARGET)
"""Optional: without them the plugin registers, and falls back to sanitize under ``pp_size > 1``."""
HOOK_TARGETS = (
    SAMPLER_TARGET, SAMPLE_CONTEXT_TARGET, PREPROCESS_TARGET, VERIFY_TARGET, RESULT_TARGET, FINISH_TARGET,
    ANNOUNCE_TARGET, RANKS_TARGET, BEAM_TARGET,
) + PP_HOOK_TARGETS
PP_REQUIRED_SYMBOLS = ("sglang.srt.sampling.sampling_observer_pp.add_auxiliary_output_to_pp_tensors",)

# Read, not hooked: (symbol, attribute its code must read). The abort path relies on
# update_finish_state consuming ``to_finish``, release_kv_cache honouring
# ``skip_radix_cache_insert`` and copy_to_cpu copying the auxiliary device output;
# a release that renamed any would abort without its guarantees, so the plugin refuses.
REQUIRED_SYMBOLS = (
    ("sglang.srt.managers.schedule_batch.FINISH_ABORT", None),
    # The verify hook applies these itself, in eagle_sample's order, then hides them from it.
    (VERIFY_TARGET, "acc_additive_penalties"),
    (VERIFY_TARGET, "acc_scaling_penalties"),
    (VERIFY_TARGET, "logit_bias"),
    (FINISH_TARGET, "to_finish"),
    ("sglang.srt.mem_cache.common.release_kv_cache", "skip_radix_cache_insert"),
    ("sglang.srt.managers.utils.GenerationBatchResult.copy_auxiliary_output_to_cpu", "auxiliary_device_output"),
    ("sglang.srt.managers.auxiliary_output.append_auxiliary_output", None),
    ("sglang.srt.plugins.hook_registry.HookRegistry.register", None),
    ("sglang.srt.plugins.hook_registry.HookType.AROUND", None),
)

# Speculative algorithms whose target logits reach tokens without passing a hooked site
# (docs/sglang.md, "Coverage"). Configuring one logs a single warning at startup.
UNCOVERED_ALGORITHMS = {
    "DFLASH": "dflash_worker_v2 verifies with its own argmax / tree sampling",
    "DSPARK": "dspark_components.dspark_verify verifies with its own row argmax",
    "UNO": "chain mode samples in uno_worker_v2 / uno_utils.run_uno_sampling (tree mode is covered)",
}

VERIFY_BIASES = ("acc_additive_penalties", "acc_scaling_penalties", "logit_bias")
"""``SamplingBatchInfo`` fields ``eagle_sample`` adds to (or scales) the verify logits before its argmax."""
ROW_LABEL = "row{}"
"""Label of a sampler row when the batch's rids are unknown (no ModelRunner.sample context)."""


@dataclass
class _SampleCall:
    """One ``ModelRunner.sample`` call: its rids, and the counts the sampler hook left.

    ``counted``: the preprocess hook already applied the policy in this call, before any
    watermark rewrote the logits. ``Sampler._preprocess_logits`` then leaves what it is handed
    alone (the watermarked logits, and the pre-watermark copy for logprobs): the counts and
    their all-reduce happen once per call.
    """

    rids: list | None
    counts: torch.Tensor | None = None
    counted: bool = False


@dataclass
class _ResultInProcess:
    """The result whose ``Scheduler.process_batch_result`` is running, and its decisions."""

    result: object
    aborts: dict | None = None  # rid -> abort message, built on the first finish check


_SAMPLE_CALL: contextvars.ContextVar = contextvars.ContextVar("safespec_sglang_sample", default=None)
_RESULT: contextvars.ContextVar = contextvars.ContextVar("safespec_sglang_result", default=None)


def _resolve(dotted: str):
    """Import ``dotted``'s module and return the attribute, as HookRegistry will."""
    obj_path, attr = dotted.rsplit(".", 1)
    return getattr(pkgutil.resolve_name(obj_path), attr)


def _missing(entries) -> list:
    """Each (dotted, attribute its code must read) of ``entries`` that is absent, described."""
    missing = []
    for dotted, must_read in entries:
        try:
            obj = _resolve(dotted)
        except (ImportError, AttributeError, ValueError) as exc:
            missing.append(f"{dotted} ({type(exc).__name__}: {exc})")
            continue
        # Unwrap: another plugin's hook may already wrap the function.
        code = getattr(inspect.unwrap(obj), "__code__", None)
        if must_read is not None and (code is None or must_read not in code.co_names):
            missing.append(f"{dotted} no longer reads .{must_read}")
    return missing


def pp_relay_missing() -> str | None:
    """Why the counts cannot ride SGLang's PP output ring, or None when they can."""
    missing = _missing([(t, None) for t in PP_HOOK_TARGETS + PP_REQUIRED_SYMBOLS])
    return "; ".join(missing) or None


def check_compatibility() -> None:
    """Raise ``SGLangPluginError`` naming every missing hook target or required symbol.

    Imports the target modules (as ``HookRegistry.apply_hooks`` would) and registers
    nothing, so a refusal leaves SGLang untouched. A different sglang version only
    logs a warning: the symbol check is what decides.
    """
    required = [(t, None) for t in HOOK_TARGETS if t not in PP_HOOK_TARGETS]
    missing = _missing(required + list(REQUIRED_SYMBOLS))
    if missing:
        raise SGLangPluginError(
            f"safespec SGLang plugin supports sglang {SUPPORTED_SGLANG_VERSION}; refusing to "
            f"register (no NaN policy applied; only the start-up check). Missing: {'; '.join(missing)}"
        )
    import sglang

    version = getattr(sglang, "__version__", "unknown")
    if version != SUPPORTED_SGLANG_VERSION:
        logger.warning(
            "safespec SGLang plugin is tested with sglang %s, found %s; all hook targets exist.",
            SUPPORTED_SGLANG_VERSION,
            version,
        )


def count_and_sanitize(state: PluginState, logits: torch.Tensor, cu_num_rows: torch.Tensor, rids: list, site: str,
                       groups=()):
    """Apply ``state.policy`` to ``logits`` in place; return the device counts to ride the result copy.

    Shape:
        logits: [num_rows, V]; cu_num_rows: [len(rids) + 1] on logits.device.
        returns: int32 [6, len(rids)] (rows ``COUNT_ROWS``) under abort/guard, else None.

    ``groups``: the ranks that run the same batch and must decide alike (``agree``).
    On NaN: sanitize -> sanitized, warned once (async); raise -> sanitized, then
    ``NanLogitsError`` naming the corrupted rids (one host sync); abort/guard ->
    sanitized, counts returned without a host sync.
    """
    if state.policy is NanPolicy.SANITIZE:
        sanitize_nan_logits(logits, f"sglang {site}")
        return None
    counts = nonfinite_counts_per_request(logits, cu_num_rows, sanitize=True, backend=state.counts_backend)
    stacked = agree(torch.stack((counts.nan, counts.dead_rows, counts.inf)), groups)
    if state.policy is NanPolicy.RAISE:
        # Host sync: raise must know before SGLang commits this step's tokens; one int32 per request.
        raise_if_nan_logits(dict(zip(rids, stacked[0].tolist())))
        return None
    return stacked


def clean_draft_probs(draft_probs: torch.Tensor) -> None:
    """Clean the rows of ``draft_probs`` that hold NaN, Inf or negative entries, in place. No host sync.

    Shape:
        draft_probs: [bs, num_steps, V] float (same storage afterwards: it may be a graph buffer).

    A bad row becomes ``samplers``' ``clean_probs`` of it (those entries 0, renormalised; no
    mass left: all zeros, so SGLang rejects its drafts). Every other row keeps its bits, so
    rejection sampling on clean draft probabilities is SGLang's own.
    """
    clean, bad = clean_probs(draft_probs, zero_rows="zero")
    draft_probs.copy_(torch.where(bad.unsqueeze(-1), clean, draft_probs))


def _draft_probs_used(verify_input) -> bool:
    """Whether ``eagle_sample`` will hand ``verify_input.draft_probs`` to rejection sampling."""
    from sglang.srt.runtime_context import get_spec

    draft_probs = getattr(verify_input, "draft_probs", None)
    if draft_probs is None or not draft_probs.is_floating_point() or draft_probs.numel() == 0:
        return False
    return bool(get_spec().speculative_use_rejection_sampling)


def apply_verify_biases(logits: torch.Tensor, sampling_info, draft_token_num: int, grammar_mask) -> None:
    """SGLang's ``eagle_sample`` steps before its argmax, in its order and with its ops, on ``logits`` in place.

    Shape:
        logits: [bs * draft_token_num, V]; the per-request penalties and ``logit_bias``: [bs, V].
    """
    from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

    if sampling_info.acc_additive_penalties is not None:
        logits.add_(torch.repeat_interleave(sampling_info.acc_additive_penalties, draft_token_num, dim=0))
    if sampling_info.acc_scaling_penalties is not None:
        apply_scaling_penalties(logits, torch.repeat_interleave(sampling_info.acc_scaling_penalties,
                                                                draft_token_num, dim=0))
    if sampling_info.logit_bias is not None:
        logits.add_(torch.repeat_interleave(sampling_info.logit_bias, draft_token_num, dim=0))
    if grammar_mask is not None:
        grammar_mask.apply(logits)


@contextmanager
def verify_biases_applied(sampling_info):
    """Hide ``VERIFY_BIASES`` from ``eagle_sample`` (the hook applied them); put them back after."""
    saved = {name: getattr(sampling_info, name) for name in VERIFY_BIASES}
    for name in saved:
        setattr(sampling_info, name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(sampling_info, name, value)


def beam_refusal(state: PluginState) -> str:
    """SGLang's error for a beam search request (``beam_width > 1``) while the plugin is on."""
    return (
        f"Beam search is not supported with the safespec NaN policy '{state.policy.value}': SGLang's beam "
        "coordinator picks tokens by topk on logits copied before safespec sees them, and beam requests skip "
        "the finish check where safespec aborts. Send beam_width=1, or serve with SAFESPEC_NAN_POLICY=off"
    )


def announce(state: PluginState, server_args) -> None:
    """Log the policy line, and one warning if an uncovered speculative algorithm is configured.

    Runs in each scheduler process right after SGLang configured its logging (``load_plugins``
    runs before that, so a line logged by ``register`` is lost).
    """
    if state.announced:
        return
    state.announced = True
    logger.info(
        "safespec SGLang plugin: NaN policy '%s' at the sampler and EAGLE verify (eagle_sample)",
        state.policy.value,
    )
    algorithm = str(getattr(server_args, "speculative_algorithm", None) or "").upper()
    if algorithm in UNCOVERED_ALGORITHMS:
        logger.warning(
            "safespec SGLang plugin does not cover --speculative-algorithm %s: %s; its target logits "
            "reach tokens without the NaN policy '%s' (see safespec docs/sglang.md, Coverage)",
            algorithm,
            UNCOVERED_ALGORITHMS[algorithm],
            state.policy.value,
        )


def make_hooks(state: PluginState) -> dict:
    """Build the hook callables (target -> hook) bound to ``state``.

    Each hook has HookRegistry's AROUND signature ``hook(original_fn, *args, **kwargs)``
    except the finish hook, a BEFORE hook ``hook(req, *args, **kwargs)``, and the
    announce and ranks hooks, AFTER hooks ``hook(result, *args, **kwargs)`` (``hook_types``).
    """
    hooks = {**_logits_hooks(state), **_scheduler_hooks(state), **_pp_hooks(state)}
    for hook in hooks.values():
        hook.safespec_hook = True
    return hooks


def _count_sampler_rows(state: PluginState, logits: torch.Tensor, call: _SampleCall, groups) -> None:
    """Apply the policy to one sampler call's [batch, V] logits; keep its counts on ``call``."""
    call.counted = True
    num_rows = logits.shape[0]
    if call.rids is None or len(call.rids) != num_rows:
        if state.policy in ABORTING_POLICIES:  # no request to finish: sanitize and warn (async)
            sanitize_nan_logits(logits, "sglang sampler (no request ids)")
            return
        call.rids = [ROW_LABEL.format(i) for i in range(num_rows)]
    cu_num_rows = torch.arange(num_rows + 1, device=logits.device, dtype=torch.int32)
    call.counts = count_and_sanitize(state, logits, cu_num_rows, list(call.rids), "sampler", groups)


def _logits_hooks(state: PluginState) -> dict:
    """The hooks at the sampler site: counted after SGLang's logits bias, before any watermark."""

    def preprocess_hook(original_fn, runner, logits_output, sampling_info, *args, **kwargs):
        """SGLang's penalties, logit_bias and grammar mask, then the policy, before ``sample`` watermarks."""
        observer_state = original_fn(runner, logits_output, sampling_info, *args, **kwargs)
        call = _SAMPLE_CALL.get()
        if call is None:  # compute_logprobs_only: no token is picked, so sanitize only
            sanitize_nan_logits(logits_output.next_token_logits, "sglang logprobs")
        elif not call.counted:
            groups = sampler_groups(getattr(runner, "sampler", None))
            _count_sampler_rows(state, logits_output.next_token_logits, call, groups)
        return observer_state

    def sampler_hook(original_fn, sampler, logits, sampling_info):
        """Only where ``preprocess_hook`` did not decide (a ``Sampler`` outside ``ModelRunner.sample``)."""
        call = _SAMPLE_CALL.get() or _SampleCall(rids=None)  # no rids: rows are labelled, never finished
        if not call.counted:  # else decided before any watermark: leave the logits as SGLang has them
            _count_sampler_rows(state, logits, call, sampler_groups(sampler))
        return original_fn(sampler, logits, sampling_info)

    def sample_context_hook(original_fn, runner, logits_output, forward_batch, *args, **kwargs):
        """Expose the batch's rids to ``preprocess_hook``; attach its counts to the step's result."""
        call = _SampleCall(rids=getattr(forward_batch, "rids", None))
        token = _SAMPLE_CALL.set(call)
        try:
            next_token_ids = original_fn(runner, logits_output, forward_batch, *args, **kwargs)
        finally:
            _SAMPLE_CALL.reset(token)
        if call.counts is not None:
            attach_counts(logits_output, NanCountsOnDevice("sampler", tuple(call.rids), call.counts))
        return next_token_ids

    return {PREPROCESS_TARGET: preprocess_hook, SAMPLER_TARGET: sampler_hook,
            SAMPLE_CONTEXT_TARGET: sample_context_hook, **_verify_hooks(state)}


def _verify_hooks(state: PluginState) -> dict:
    """The hook at EAGLE verify: the policy on the logits ``eagle_sample`` picks from."""

    def verify_hook(original_fn, verify_input, batch, logits_output, *args, **kwargs):
        """SGLang's penalties, logit_bias and grammar mask, the policy, the draft probs, then verify."""
        if batch.forward_mode.is_idle():
            return original_fn(verify_input, batch, logits_output, *args, **kwargs)
        grammar_mask = args[0] if args else kwargs.pop("grammar_mask", None)
        args = (None,) + args[1:] if args else args  # applied here, not again by eagle_sample
        logits = logits_output.next_token_logits  # [bs * draft_token_num, V]
        apply_verify_biases(logits, batch.sampling_info, verify_input.draft_token_num, grammar_mask)
        rids = [req.rid for req in batch.reqs]
        # EAGLE verifies the same number of tree nodes for every request; built on the
        # device from host ints, so no sync.
        cu_num_rows = verify_input.draft_token_num * torch.arange(
            len(rids) + 1, device=logits.device, dtype=torch.int32
        )
        counts = count_and_sanitize(state, logits, cu_num_rows, rids, "verify", verify_groups())
        if _draft_probs_used(verify_input):
            clean_draft_probs(verify_input.draft_probs)
        with verify_biases_applied(batch.sampling_info):
            out = original_fn(verify_input, batch, logits_output, *args, **kwargs)
        if counts is not None:
            attach_counts(logits_output, NanCountsOnDevice("verify", tuple(rids), counts))
        return out

    return {VERIFY_TARGET: verify_hook}


def _scheduler_hooks(state: PluginState) -> dict:
    """The hooks in the scheduler: the result being processed, the finish check, start-up."""

    def result_hook(original_fn, scheduler, batch, result, *args, **kwargs):
        """Expose the result being processed to ``finish_hook`` (reads nothing here)."""
        token = _RESULT.set(_ResultInProcess(result))
        try:
            return original_fn(scheduler, batch, result, *args, **kwargs)
        finally:
            _RESULT.reset(token)

    def finish_hook(req, *args, **kwargs):
        """Abort ``req`` before SGLang's finish check when its counts say so."""
        current = _RESULT.get()
        if current is None:
            return None
        if current.aborts is None:  # first finish check of this result: SGLang's copy_done wait is behind us
            current.aborts = {}
            for host in host_counts(current.result):
                current.aborts.update(decide_aborts(state, host))
        message = current.aborts.get(req.rid)
        if message is not None:  # a client abort pending in the same step keeps its reason (mark_aborted)
            # update_finish_state(new_accepted_len=1): this step's tokens are already appended.
            new_accepted_len = args[0] if args else kwargs.get("new_accepted_len", 1)
            mark_aborted(req, message, withheld=new_accepted_len)
        return None

    def announce_hook(result, server_args, *args, **kwargs):
        """After SGLang configured the scheduler's logging: the policy line and coverage warning."""
        announce(state, server_args)
        return None

    def ranks_hook(result, scheduler, *args, **kwargs):
        """After the model worker (and torch.distributed) started: ranks agree, PP fallback."""
        from sglang.srt.runtime_context import get_parallel

        if state.ranks_checked:
            return None
        state.ranks_checked = True
        parallel = get_parallel()
        # Every rank reports first, so a rank that cannot start never leaves the others waiting.
        check_ranks_agree(rank_config(state), parallel.world_group.cpu_group)
        error = state.start_error or unsupported_mode(state, getattr(scheduler, "server_args", None))
        if error is not None:
            raise SGLangPluginError(error)
        if state.refused is None:
            fall_back_without_pp_relay(state, parallel.pp_size)
        return None

    def beam_hook(original_fn, coordinator, req, recv_req, *args, **kwargs):
        """Refuse a beam search request: SGLang answers it with this error (HTTP 400) before any forward."""
        return beam_refusal(state)

    return {RESULT_TARGET: result_hook, FINISH_TARGET: finish_hook, ANNOUNCE_TARGET: announce_hook,
            RANKS_TARGET: ranks_hook, BEAM_TARGET: beam_hook}


def _pp_hooks(state: PluginState) -> dict:
    """The PP relay: the last stage sends the counts round the ring, every stage rebuilds them."""

    def pp_send_hook(original_fn, scheduler, result, batch, *args, **kwargs):
        """Last stage: put the counts in the output dict SGLang sends round the PP ring."""
        ours = detach_counts(getattr(result, "logits_output", None))
        tensor_dict = original_fn(scheduler, result, batch, *args, **kwargs)
        add_counts_to_pp_tensors(tensor_dict, ours)
        return tensor_dict

    def pp_recv_hook(original_fn, scheduler, batch, mb_metadata, pp_outputs, *args, **kwargs):
        """Every stage: rebuild the counts beside SGLang's result; leave them in the dict for the next stage."""
        tensors = pp_outputs.tensors
        # Out of SGLang's sight while it rebuilds its own outputs (its first stage pops every
        # auxiliary output and needs a sampling observer for them), back in for the relay.
        ours = {key: tensors.pop(key) for key in [k for k in tensors if PP_TENSOR_PREFIX in k]}
        try:
            result = original_fn(scheduler, batch, mb_metadata, pp_outputs, *args, **kwargs)
        finally:
            tensors.update(ours)
        if ours:
            # Rows follow the composition that ran the forward (SGLang's PP+spec snapshot, if any).
            forward_batch = getattr(mb_metadata, "fwd_batch", None)
            forward_batch = batch if forward_batch is None else forward_batch
            rids = [req.rid for req in forward_batch.reqs]
            attach_relayed_counts(state, result, NanCountsOnDevice.from_pp_tensors(ours, rids))
        return result

    return {PP_SEND_TARGET: pp_send_hook, PP_RECV_TARGET: pp_recv_hook}


def hook_types() -> dict:
    """target -> SGLang ``HookType`` of each hook in ``make_hooks``."""
    from sglang.srt.plugins.hook_registry import HookType

    types_ = {target: HookType.AROUND for target in HOOK_TARGETS}
    types_[FINISH_TARGET] = HookType.BEFORE
    types_[ANNOUNCE_TARGET] = HookType.AFTER
    types_[RANKS_TARGET] = HookType.AFTER
    return types_


def _already_registered(registry) -> bool:
    hooks = getattr(registry, "_hooks", {})
    return any(getattr(h, "safespec_hook", False) for t in HOOK_TARGETS for _, h, _ in hooks.get(t, ()))


def _register_start_up_check_only(state: PluginState) -> None:
    """Register only the start-up check's hook, so that this rank still reports (under ``off``, or refused).

    Where even that target is missing, nothing is registered; the other ranks then fail
    their start-up check naming this rank (it never reports).
    """
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry

        _resolve(RANKS_TARGET)
        if _already_registered(HookRegistry):
            return
        hook = _scheduler_hooks(state)[RANKS_TARGET]
        hook.safespec_hook = True
        HookRegistry.register(RANKS_TARGET, hook, hook_types()[RANKS_TARGET])
    except (ImportError, AttributeError, ValueError) as exc:
        logger.warning("safespec SGLang plugin: cannot register the start-up check (%s: %s)", type(exc).__name__, exc)


def register(nan_policy: NanPolicy | str | None = None) -> PluginState | None:
    """SGLang plugin entry point: register safespec's hooks with ``HookRegistry``.

    The policy is ``nan_policy`` if given, else ``$SAFESPEC_NAN_POLICY``, else
    ``guard``. ``off`` registers only the start-up check (``Scheduler.init_model_worker``),
    so the rank still reports its policy to the others. Every target is resolved first;
    if one is missing, registers only the start-up check (reporting ``refused: <why>``)
    and raises ``SGLangPluginError`` naming it (SGLang's ``load_plugins`` logs the error,
    applies what was registered and serves without the policy). Calling it again in the
    same process is a no-op. An unknown policy registers only the start-up check, which fails
    the start on every rank, and raises ``SGLangPluginError`` naming ``SAFESPEC_NAN_POLICY``
    and the allowed values. The policy line is logged by each scheduler once SGLang
    configured its logging (``announce``).

    Returns the shared ``PluginState``, or None when nothing was registered.
    """
    try:
        policy = NanPolicy.resolve(nan_policy)
    except ValueError as exc:  # reported to the other ranks, and raised by the start-up check on every rank
        _register_start_up_check_only(PluginState(policy=NanPolicy.OFF, refused=str(exc), start_error=str(exc)))
        raise SGLangPluginError(f"safespec SGLang plugin: {exc}; the start-up check fails this rank") from exc
    if policy is NanPolicy.OFF:
        logger.info("safespec SGLang plugin: policy off, only the start-up check registered")
        state = PluginState(policy=policy)
        _register_start_up_check_only(state)
        return state
    try:
        check_compatibility()
    except SGLangPluginError as exc:
        why = str(exc).partition("Missing: ")[2] or str(exc)
        _register_start_up_check_only(PluginState(policy=policy, refused=f"missing {why}"))
        raise
    from sglang.srt.environ import envs
    from sglang.srt.plugins.hook_registry import HookRegistry

    if _already_registered(HookRegistry):
        logger.debug("safespec SGLang plugin: hooks already registered")
        return None
    if envs.SGLANG_ENABLE_NAN_LOGITS_CHECK.get():
        logger.warning(
            "SGLANG_ENABLE_NAN_LOGITS_CHECK asserts on NaN before safespec's hooks run; "
            "unset it to let SAFESPEC_NAN_POLICY=%s act",
            policy.value,
        )
    state = PluginState(policy=policy, pp_relay_missing=pp_relay_missing())
    types_ = hook_types()
    for target, hook in make_hooks(state).items():
        if state.pp_relay_missing is not None and target in PP_HOOK_TARGETS:
            continue  # nothing to hook; fall_back_without_pp_relay acts under pp_size > 1
        HookRegistry.register(target, hook, types_[target])
    logger.debug("safespec SGLang plugin: policy %s on %s", policy.value, ", ".join(HOOK_TARGETS))
    return state
