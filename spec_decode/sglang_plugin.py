"""SGLang plugin: safespec's NaN policy at SGLang's sampler and EAGLE verify sites.

Supported: sglang 0.5.23. SGLang's ``load_plugins`` calls ``register`` through the
entry point ``safespec = "spec_decode.sglang_plugin:register"`` in the group
``sglang.srt.plugins`` (allow-listed with ``SGLANG_PLUGINS=safespec``). ``register``
only *registers* hooks with SGLang's ``HookRegistry``; ``load_plugins`` applies them
right after every plugin ran.

Glossary:
    site: where logits are handled. ``sampler``: ``Sampler._preprocess_logits``, one
        row per request (prefill and plain decode). ``verify``: ``eagle_sample``, the
        EAGLE target logits of the draft tree, ``draft_token_num`` rows per request.
    rid: SGLang's request id (``Req.rid``); errors and aborts name it.
    abort: the request finishes with ``FINISH_ABORT`` (HTTP 500, err_type
        ``NanLogitsError``) and ``skip_radix_cache_insert``, so its KV is freed
        instead of entering the radix (prefix) cache. Other requests keep running.

Policy (``SAFESPEC_NAN_POLICY`` or ``register(nan_policy=...)``, see ``numerics.NanPolicy``):
    off: register no hook; SGLang behaves as without the plugin.
    sanitize: in place, NaN -> -1e30, +-Inf -> +-1e30, one-shot async warning. No host sync.
    raise: count NaN per request, read the counts on the host (one sync per call),
        raise ``NanLogitsError`` naming the rids. In SGLang that stops the scheduler.
    abort: count and sanitize in one pass, read the counts (one sync per call), abort
        only the corrupted requests.
"""

from __future__ import annotations

import contextvars
import logging
import pkgutil
import inspect
from dataclasses import dataclass, field
from http import HTTPStatus

import torch

from numerics import NanPolicy, nan_counts_per_request, raise_if_nan_logits, sanitize_nan_logits

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG_VERSION = "0.5.23"
PLUGIN_NAME = "safespec"

SAMPLER_TARGET = "sglang.srt.layers.sampler.Sampler._preprocess_logits"
SAMPLE_CONTEXT_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.sample"
VERIFY_TARGET = "sglang.srt.speculative.eagle_utils.eagle_sample"
FINISH_TARGET = "sglang.srt.managers.schedule_batch.Req.update_finish_state"
HOOK_TARGETS = (SAMPLER_TARGET, SAMPLE_CONTEXT_TARGET, VERIFY_TARGET, FINISH_TARGET)

# Read, not hooked: (symbol, attribute its code must read). The abort path relies on
# update_finish_state consuming ``to_finish`` and release_kv_cache honouring
# ``skip_radix_cache_insert``; a release that renamed either would abort without
# keeping the KV out of the cache, so the plugin refuses instead.
REQUIRED_SYMBOLS = (
    ("sglang.srt.managers.schedule_batch.FINISH_ABORT", None),
    (FINISH_TARGET, "to_finish"),
    ("sglang.srt.mem_cache.common.release_kv_cache", "skip_radix_cache_insert"),
    ("sglang.srt.plugins.hook_registry.HookRegistry.register", None),
    ("sglang.srt.plugins.hook_registry.HookType.AROUND", None),
)

ABORT_STATUS = HTTPStatus.INTERNAL_SERVER_ERROR
ABORT_ERR_TYPE = "NanLogitsError"
ROW_LABEL = "row{}"
"""Label of a sampler row when the batch's rids are unknown (no ModelRunner.sample context)."""

_SAMPLE_RIDS: contextvars.ContextVar = contextvars.ContextVar("safespec_sglang_rids", default=None)


class SGLangPluginError(RuntimeError):
    """The plugin refused to register: a hook target or a required symbol is missing."""


@dataclass
class PluginState:
    """What the hooks share: the policy and the rids waiting to be aborted.

    ``pending_aborts`` maps rid -> abort message. The sampler site only knows rids;
    the ``Req.update_finish_state`` hook turns an entry into an abort in the same
    step's result processing, before SGLang frees or caches the request's KV.
    """

    policy: NanPolicy
    counts_backend: str = "auto"
    pending_aborts: dict = field(default_factory=dict)


def _resolve(dotted: str):
    """Import ``dotted``'s module and return the attribute, as HookRegistry will."""
    obj_path, attr = dotted.rsplit(".", 1)
    return getattr(pkgutil.resolve_name(obj_path), attr)


def check_compatibility() -> None:
    """Raise ``SGLangPluginError`` naming every missing hook target or required symbol.

    Imports the target modules (as ``HookRegistry.apply_hooks`` would) and registers
    nothing, so a refusal leaves SGLang untouched. A different sglang version only
    logs a warning: the symbol check is what decides.
    """
    missing = []
    for dotted, must_read in [(t, None) for t in HOOK_TARGETS] + list(REQUIRED_SYMBOLS):
        try:
            obj = _resolve(dotted)
        except (ImportError, AttributeError, ValueError) as exc:
            missing.append(f"{dotted} ({type(exc).__name__}: {exc})")
            continue
        # Unwrap: another plugin's hook may already wrap the function.
        code = getattr(inspect.unwrap(obj), "__code__", None)
        if must_read is not None and (code is None or must_read not in code.co_names):
            missing.append(f"{dotted} no longer reads .{must_read}")
    if missing:
        raise SGLangPluginError(
            f"safespec SGLang plugin supports sglang {SUPPORTED_SGLANG_VERSION}; refusing to "
            f"register (nothing applied). Missing: {'; '.join(missing)}"
        )
    import sglang

    version = getattr(sglang, "__version__", "unknown")
    if version != SUPPORTED_SGLANG_VERSION:
        logger.warning(
            "safespec SGLang plugin is tested with sglang %s, found %s; all hook targets exist.",
            SUPPORTED_SGLANG_VERSION,
            version,
        )


def _abort_message(rid: str, num_nans: int, site: str) -> str:
    return (
        f"safespec: {num_nans} NaN logits for request {rid} at SGLang {site}; "
        f"request aborted by the safespec NaN policy 'abort'; its KV is kept out of the prefix cache"
    )


def mark_aborted(req, message: str) -> None:
    """Finish ``req`` with ``FINISH_ABORT`` at its next finish check and bar its KV from the radix cache.

    SGLang's own "abort a running request" path: ``to_finish`` is consumed by
    ``Req.update_finish_state``; ``skip_radix_cache_insert`` makes ``release_kv_cache``
    free the KV without inserting it into the tree.
    """
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.skip_radix_cache_insert = True
    if not req.finished():
        req.to_finish = FINISH_ABORT(message, ABORT_STATUS, ABORT_ERR_TYPE)


def _apply_policy(
    state: PluginState, logits: torch.Tensor, cu_num_rows: torch.Tensor, rids: list, site: str
) -> list:
    """Sanitize ``logits`` in place under ``state.policy``; return [(index, rid, count)] to abort.

    Shape:
        logits: [num_rows, V]; cu_num_rows: [len(rids) + 1] on logits.device.

    On NaN: sanitize -> sanitized, warned once; raise -> sanitized, then
    ``NanLogitsError`` naming the corrupted rids; abort -> sanitized, the corrupted
    requests are returned for the caller to abort.
    """
    if state.policy is NanPolicy.SANITIZE:
        sanitize_nan_logits(logits, f"sglang {site}")
        return []
    counts = nan_counts_per_request(logits, cu_num_rows, sanitize=True, backend=state.counts_backend)
    # Host sync: raise/abort must know which requests are corrupted before SGLang
    # commits this step's tokens; one int32 per request.
    host_counts = counts.tolist()
    if not any(host_counts):
        return []
    if state.policy is NanPolicy.RAISE:
        raise_if_nan_logits(dict(zip(rids, host_counts)))
    corrupted = [(i, rid, n) for i, (rid, n) in enumerate(zip(rids, host_counts)) if n]
    logger.error(
        "safespec: NaN logits at SGLang %s; aborting %s",
        site,
        ", ".join(f"{rid} ({n} NaN)" for _, rid, n in corrupted),
    )
    return corrupted


def _row_rids(num_rows: int) -> tuple:
    """Return (labels, known): the batch's rids when ModelRunner.sample supplied them."""
    rids = _SAMPLE_RIDS.get()
    if rids is not None and len(rids) == num_rows:
        return list(rids), True
    return [ROW_LABEL.format(i) for i in range(num_rows)], False


def make_hooks(state: PluginState) -> dict:
    """Build the four hook callables (target -> hook) bound to ``state``.

    Each hook has HookRegistry's AROUND signature ``hook(original_fn, *args, **kwargs)``
    except the finish hook, a BEFORE hook ``hook(req, *args, **kwargs)``.
    """

    def sampler_hook(original_fn, sampler, logits, sampling_info):
        """Policy on the sampler's [batch, V] logits, then SGLang's own preprocessing."""
        num_rows = logits.shape[0]
        rids, known = _row_rids(num_rows)
        cu_num_rows = torch.arange(num_rows + 1, device=logits.device, dtype=torch.int32)
        for _, rid, n in _apply_policy(state, logits, cu_num_rows, rids, "sampler"):
            if known:
                state.pending_aborts[rid] = _abort_message(rid, n, "sampler")
            else:  # sanitized, but there is no request to finish
                logger.error("safespec: cannot abort %s: no request ids for this sampler call", rid)
        return original_fn(sampler, logits, sampling_info)

    def sample_context_hook(original_fn, runner, logits_output, forward_batch, *args, **kwargs):
        """Expose the batch's rids to ``sampler_hook`` for the duration of the sample call."""
        token = _SAMPLE_RIDS.set(getattr(forward_batch, "rids", None))
        try:
            return original_fn(runner, logits_output, forward_batch, *args, **kwargs)
        finally:
            _SAMPLE_RIDS.reset(token)

    def verify_hook(original_fn, verify_input, batch, logits_output, *args, **kwargs):
        """Policy on the EAGLE verify logits [bs * draft_token_num, V], then SGLang's verify."""
        if batch.forward_mode.is_idle():
            return original_fn(verify_input, batch, logits_output, *args, **kwargs)
        logits = logits_output.next_token_logits  # [bs * draft_token_num, V]
        reqs = batch.reqs
        # EAGLE verifies the same number of tree nodes for every request; built on the
        # device from host ints, so no sync.
        cu_num_rows = verify_input.draft_token_num * torch.arange(
            len(reqs) + 1, device=logits.device, dtype=torch.int32
        )
        rids = [req.rid for req in reqs]
        for i, rid, n in _apply_policy(state, logits, cu_num_rows, rids, "verify"):
            mark_aborted(reqs[i], _abort_message(rid, n, "verify"))
        return original_fn(verify_input, batch, logits_output, *args, **kwargs)

    def finish_hook(req, *args, **kwargs):
        """Turn a pending sampler-site abort into SGLang's ``to_finish`` before it is checked."""
        if state.pending_aborts:
            message = state.pending_aborts.pop(req.rid, None)
            if message is not None:
                mark_aborted(req, message)
        return None

    for hook in (sampler_hook, sample_context_hook, verify_hook, finish_hook):
        hook.safespec_hook = True
    return {
        SAMPLER_TARGET: sampler_hook,
        SAMPLE_CONTEXT_TARGET: sample_context_hook,
        VERIFY_TARGET: verify_hook,
        FINISH_TARGET: finish_hook,
    }


def _already_registered(registry) -> bool:
    hooks = getattr(registry, "_hooks", {})
    return any(getattr(h, "safespec_hook", False) for t in HOOK_TARGETS for _, h, _ in hooks.get(t, ()))


def register(nan_policy: NanPolicy | str | None = None) -> PluginState | None:
    """SGLang plugin entry point: register safespec's hooks with ``HookRegistry``.

    The policy is ``nan_policy`` if given, else ``$SAFESPEC_NAN_POLICY``, else
    ``sanitize``. ``off`` registers nothing. Every target is resolved first; if one
    is missing, raises ``SGLangPluginError`` naming it and registers nothing
    (SGLang's ``load_plugins`` logs the error and serves without the plugin).
    Calling it again in the same process is a no-op.

    Returns the shared ``PluginState``, or None when nothing was registered.
    """
    policy = NanPolicy.resolve(nan_policy)
    if policy is NanPolicy.OFF:
        logger.info("safespec SGLang plugin: policy off, no hooks registered")
        return None
    check_compatibility()
    from sglang.srt.environ import envs
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if _already_registered(HookRegistry):
        logger.info("safespec SGLang plugin: hooks already registered")
        return None
    if envs.SGLANG_ENABLE_NAN_LOGITS_CHECK.get():
        logger.warning(
            "SGLANG_ENABLE_NAN_LOGITS_CHECK asserts on NaN before safespec's hooks run; "
            "unset it to let SAFESPEC_NAN_POLICY=%s act",
            policy.value,
        )
    state = PluginState(policy=policy)
    hooks = make_hooks(state)
    for target, hook in hooks.items():
        hook_type = HookType.BEFORE if target == FINISH_TARGET else HookType.AROUND
        HookRegistry.register(target, hook, hook_type)
    logger.info("safespec SGLang plugin: policy %s on %s", policy.value, ", ".join(HOOK_TARGETS))
    return state
