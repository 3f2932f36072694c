"""SGLang plugin: safespec's NaN policy at SGLang's sampler and EAGLE verify sites.

Supported: sglang 0.5.23. SGLang's ``load_plugins`` calls ``register`` through the entry point
``safespec`` of ``sglang.srt.plugins`` (allow-listed with ``SGLANG_PLUGINS=safespec``); ``register``
only *registers* hooks with SGLang's ``HookRegistry``, which ``load_plugins`` applies afterwards.

Glossary (words as in ``numerics.policy``: NaN, Inf, non-finite, dead row):
    site: where logits are handled. ``sampler``: ``Sampler._preprocess_logits``, one
        row per request (prefill and plain decode). ``verify``: ``eagle_sample``, the
        EAGLE target logits of the draft tree, ``draft_token_num`` rows per request.
    rid: SGLang's request id (``Req.rid``); errors and aborts name it.
    counts: per request, its NaN entries and its dead rows at one site and step, the MAX
        over the ranks, and how far apart the ranks' counts were (the spread)
        (int32 ``[4, num_reqs]`` on the device, rows ``COUNT_ROWS``, ``NanCountsOnDevice``).
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

Draft side: under every policy but ``off``, ``verify_input.draft_probs`` are cleaned in place before
``eagle_sample`` (NaN, Inf and negatives -> 0, rows renormalised; a row with no mass left is all
zeros, so SGLang rejects its drafts). No host sync.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import pkgutil
from dataclasses import dataclass
from http import HTTPStatus

import torch

from numerics import NanPolicy, nonfinite_counts_per_request, raise_if_nan_logits, sanitize_nan_logits
from samplers import clean_probs
from spec_decode.integrations.sglang_ranks import (add_counts_to_pp_tensors, agree, attach_relayed_counts,
                                                   check_ranks_agree, fall_back_without_pp_relay, rank_config,
                                                   sampler_groups, verify_groups, detach_counts)
from spec_decode.integrations.sglang_types import (  # noqa: F401 (COUNT_ROWS: re-exported)
    ABORTING_POLICIES, COUNT_ROWS, PP_TENSOR_PREFIX, NanCountsOnDevice, NanCountsOnHost, PluginState, SGLangPluginError)

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG_VERSION = "0.5.23"
PLUGIN_NAME = "safespec"

SAMPLER_TARGET = "sglang.srt.layers.sampler.Sampler._preprocess_logits"
SAMPLE_CONTEXT_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.sample"
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
    SAMPLER_TARGET, SAMPLE_CONTEXT_TARGET, VERIFY_TARGET, RESULT_TARGET, FINISH_TARGET, ANNOUNCE_TARGET, RANKS_TARGET,
) + PP_HOOK_TARGETS
PP_REQUIRED_SYMBOLS = ("sglang.srt.sampling.sampling_observer_pp.add_auxiliary_output_to_pp_tensors",)

# Read, not hooked: (symbol, attribute its code must read). The abort path relies on
# update_finish_state consuming ``to_finish``, release_kv_cache honouring
# ``skip_radix_cache_insert`` and copy_to_cpu copying the auxiliary device output;
# a release that renamed any would abort without its guarantees, so the plugin refuses.
REQUIRED_SYMBOLS = (
    ("sglang.srt.managers.schedule_batch.FINISH_ABORT", None),
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

ABORT_STATUS = HTTPStatus.INTERNAL_SERVER_ERROR
ABORT_ERR_TYPE = "NanLogitsError"
ROW_LABEL = "row{}"
"""Label of a sampler row when the batch's rids are unknown (no ModelRunner.sample context)."""


@dataclass
class _SampleCall:
    """One ``ModelRunner.sample`` call: its rids, and the counts the sampler hook left.

    ``counted``: the sampler hook already applied the policy in this call. SGLang's
    ``Sampler.forward`` preprocesses a second tensor (the pre-watermark logits, when a
    watermark and logprobs are on); that one is only sanitized, so the counts and their
    all-reduce happen once per call and the sampled logits' counts decide.
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


def mark_aborted(req, message: str, withheld: int = 0) -> None:
    """Finish ``req`` with ``FINISH_ABORT`` at its finish check and bar its KV from the radix cache.

    SGLang's own "abort a running request" path: ``to_finish`` is consumed by
    ``Req.update_finish_state``; ``skip_radix_cache_insert`` makes ``release_kv_cache``
    free the KV without inserting it into the tree. ``withheld``: how many tokens at the
    end of ``req.output_ids`` came from the corrupted step; ``finished_len`` ends the
    output before them, so no stream chunk carries them.
    """
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.skip_radix_cache_insert = True
    if not req.finished():
        req.to_finish = FINISH_ABORT(message, ABORT_STATUS, ABORT_ERR_TYPE)
        if withheld and req.finished_len is None:
            req.finished_len = max(len(req.output_ids) - withheld, 0)



def count_and_sanitize(state: PluginState, logits: torch.Tensor, cu_num_rows: torch.Tensor, rids: list, site: str,
                       groups=()):
    """Apply ``state.policy`` to ``logits`` in place; return the device counts to ride the result copy.

    Shape:
        logits: [num_rows, V]; cu_num_rows: [len(rids) + 1] on logits.device.
        returns: int32 [4, len(rids)] (rows ``COUNT_ROWS``) under abort/guard, else None.

    ``groups``: the ranks that run the same batch and must decide alike (``agree``).
    On NaN: sanitize -> sanitized, warned once (async); raise -> sanitized, then
    ``NanLogitsError`` naming the corrupted rids (one host sync); abort/guard ->
    sanitized, counts returned without a host sync.
    """
    if state.policy is NanPolicy.SANITIZE:
        sanitize_nan_logits(logits, f"sglang {site}")
        return None
    counts = nonfinite_counts_per_request(logits, cu_num_rows, sanitize=True, backend=state.counts_backend)
    stacked = agree(torch.stack((counts.nan, counts.dead_rows)), groups)
    if state.policy is NanPolicy.RAISE:
        # Host sync: raise must know before SGLang commits this step's tokens; one int32 per request.
        raise_if_nan_logits(dict(zip(rids, stacked[0].tolist())))
        return None
    return stacked


def _disagreement(num_nans: int, dead_rows: int, nan_spread: int, dead_spread: int) -> str:
    """The ranks' counts of one request, as a range over the ranks (min-max)."""
    return (f"the ranks disagree: {num_nans - nan_spread}-{num_nans} NaN logits and "
            f"{dead_rows - dead_spread}-{dead_rows} dead rows across the ranks")


def decide_aborts(state: PluginState, host: NanCountsOnHost) -> dict:
    """Return {rid: abort message} for one site's host counts under ``state.policy``.

    Reads host memory only (SGLang's copy, after its ``copy_done`` wait). A request the
    ranks counted differently is aborted and logged, naming it and the ranks' counts.
    Under guard, partial NaN every rank saw alike is logged once per process.
    """
    aborts = {}
    partial = []
    # Host memory: SGLang already waited for this copy (copy_done) before processing the result.
    for rid, num_nans, dead_rows, nan_spread, dead_spread in zip(host.rids, *host.counts.tolist()):
        trigger = dead_rows if state.policy is NanPolicy.GUARD else num_nans
        if nan_spread or dead_spread:
            disagreement = _disagreement(num_nans, dead_rows, nan_spread, dead_spread)
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


def _host_counts(result) -> list:
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


def _attach(logits_output, device_counts: NanCountsOnDevice) -> None:
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


def _clean_draft_probs(verify_input) -> None:
    """Clean ``verify_input.draft_probs`` in place (same storage: it may be a graph buffer). No host sync.

    Shape:
        draft_probs: [bs, num_steps, V] float.
    """
    draft_probs = getattr(verify_input, "draft_probs", None)
    if draft_probs is None or not draft_probs.is_floating_point() or draft_probs.numel() == 0:
        return
    clean, _ = clean_probs(draft_probs, zero_rows="zero")
    draft_probs.copy_(clean)


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


def _row_rids(num_rows: int) -> tuple:
    """Return (labels, call): the batch's rids when ModelRunner.sample supplied them."""
    call = _SAMPLE_CALL.get()
    if call is not None and call.rids is not None and len(call.rids) == num_rows:
        return list(call.rids), call
    return [ROW_LABEL.format(i) for i in range(num_rows)], None


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


def _logits_hooks(state: PluginState) -> dict:
    """The hooks at the two logits sites: the sampler (with its rids' context) and EAGLE verify."""

    def sampler_hook(original_fn, sampler, logits, sampling_info):
        """Policy on the sampler's [batch, V] logits, then SGLang's own preprocessing."""
        num_rows = logits.shape[0]
        rids, call = _row_rids(num_rows)
        if call is None and state.policy in ABORTING_POLICIES:
            # No request to finish: sanitize and warn (async), as the sanitize policy does.
            sanitize_nan_logits(logits, "sglang sampler (no request ids)")
            return original_fn(sampler, logits, sampling_info)
        if call is not None and call.counted:
            # Second tensor of this sampler call (pre-watermark logits for logprobs): the
            # first call's counts decide; counting again would all-reduce again.
            sanitize_nan_logits(logits, warn=False)
            return original_fn(sampler, logits, sampling_info)
        if call is not None:
            call.counted = True
        cu_num_rows = torch.arange(num_rows + 1, device=logits.device, dtype=torch.int32)
        counts = count_and_sanitize(state, logits, cu_num_rows, rids, "sampler", sampler_groups(sampler))
        if counts is not None:
            call.counts = counts
        return original_fn(sampler, logits, sampling_info)

    def sample_context_hook(original_fn, runner, logits_output, forward_batch, *args, **kwargs):
        """Expose the batch's rids to ``sampler_hook``; attach its counts to the step's result."""
        call = _SampleCall(rids=getattr(forward_batch, "rids", None))
        token = _SAMPLE_CALL.set(call)
        try:
            next_token_ids = original_fn(runner, logits_output, forward_batch, *args, **kwargs)
        finally:
            _SAMPLE_CALL.reset(token)
        if call.counts is not None:
            _attach(logits_output, NanCountsOnDevice("sampler", tuple(call.rids), call.counts))
        return next_token_ids

    def verify_hook(original_fn, verify_input, batch, logits_output, *args, **kwargs):
        """Policy on the EAGLE verify logits [bs * draft_token_num, V] and the draft probs, then verify."""
        if batch.forward_mode.is_idle():
            return original_fn(verify_input, batch, logits_output, *args, **kwargs)
        _clean_draft_probs(verify_input)
        logits = logits_output.next_token_logits  # [bs * draft_token_num, V]
        rids = [req.rid for req in batch.reqs]
        # EAGLE verifies the same number of tree nodes for every request; built on the
        # device from host ints, so no sync.
        cu_num_rows = verify_input.draft_token_num * torch.arange(
            len(rids) + 1, device=logits.device, dtype=torch.int32
        )
        counts = count_and_sanitize(state, logits, cu_num_rows, rids, "verify", verify_groups())
        out = original_fn(verify_input, batch, logits_output, *args, **kwargs)
        if counts is not None:
            _attach(logits_output, NanCountsOnDevice("verify", tuple(rids), counts))
        return out

    return {SAMPLER_TARGET: sampler_hook, SAMPLE_CONTEXT_TARGET: sample_context_hook, VERIFY_TARGET: verify_hook}


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
            for host in _host_counts(current.result):
                current.aborts.update(decide_aborts(state, host))
        message = current.aborts.get(req.rid)
        if message is not None and req.to_finish is None:
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
        check_ranks_agree(rank_config(state), parallel.world_group.cpu_group)
        if state.refused is None:
            fall_back_without_pp_relay(state, parallel.pp_size)
        return None

    return {RESULT_TARGET: result_hook, FINISH_TARGET: finish_hook, ANNOUNCE_TARGET: announce_hook,
            RANKS_TARGET: ranks_hook}


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
    same process is a no-op. The policy line is logged by each scheduler once SGLang
    configured its logging (``announce``).

    Returns the shared ``PluginState``, or None when nothing was registered.
    """
    policy = NanPolicy.resolve(nan_policy)
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
