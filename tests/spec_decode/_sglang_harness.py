"""Run SGLang's real CPU-capable pieces in one process, for the plugin tests.

What cannot run on a CPU-only machine is replaced by the stand-ins in
``sglang_stand_ins/`` (``torchvision``, ``sgl_kernel``), which ``make test-sglang``
puts on the path of every process in ``.venv-sglang`` with a ``.pth`` file.
Nothing here runs at import: tests call ``import_sglang()``, which reports whether
sglang imports at all.
"""

from __future__ import annotations

import importlib.util
import types
from contextlib import ExitStack, contextmanager
from pathlib import Path

STAND_INS = Path(__file__).parent / "sglang_stand_ins"


def import_sglang() -> str | None:
    """Import what the plugin and the tests touch; returns None on success, else the reason."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang not installed"
    try:
        import sglang.srt.layers.sampler  # noqa: F401
        import sglang.srt.managers.scheduler  # noqa: F401
        import sglang.srt.plugins.hook_registry  # noqa: F401
    except ImportError as exc:  # a missing dependency of sglang's import chain
        return f"sglang not importable: {exc} (make test-sglang puts {STAND_INS} on the path)"
    return None


class _SingleProcessGroup:
    """Stands for SGLang's tp group in one process: no collective is ever issued."""

    device_group = None
    world_size = 1
    rank_in_group = 0


@contextmanager
def sglang_cpu_context(sampling_backend: str = "pytorch"):
    """Publish dummy ServerArgs (CPU, ``sampling_backend``) and a one-process tp group."""
    from sglang.srt.runtime_context import get_context, get_parallel

    with ExitStack() as stack:
        stack.enter_context(
            get_context().override_server_args(sampling_backend=sampling_backend, device="cpu")
        )
        stack.enter_context(get_parallel().override(tp_group=_SingleProcessGroup()))
        yield


def make_sampling_info(batch_size: int, vocab_size: int, *, greedy: bool):
    """A real SamplingBatchInfo for plain sampling: temperature 1, no top-k/top-p/min-p."""
    import torch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    return SamplingBatchInfo(
        temperatures=torch.ones(batch_size, 1),
        top_ps=torch.ones(batch_size),
        top_ks=torch.full((batch_size,), vocab_size, dtype=torch.int32),
        min_ps=torch.zeros(batch_size),
        is_all_greedy=greedy,
        is_any_greedy=greedy,
        need_top_p_sampling=False,
        need_top_k_sampling=False,
        need_min_p_sampling=False,
        vocab_size=vocab_size,
        device="cpu",
    )


def make_req(rid: str):
    """A real SGLang Req, as the scheduler holds it (3 prompt tokens, 8 new tokens max)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=8)
    params.normalize(None)  # as the scheduler does on admission (no tokenizer: no stop strings)
    return Req(rid=rid, origin_input_text="", origin_input_ids=[1, 2, 3], sampling_params=params)


def make_model_runner(sampler):
    """A ModelRunner shell holding only what ``ModelRunner.sample`` reads; no model is loaded."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    runner = object.__new__(ModelRunner)
    runner.sampler = sampler
    runner.sampling_observer = None
    runner.watermark_state = None
    runner.ngram_embedding_manager = types.SimpleNamespace(update_after_decode=lambda **_: None)
    return runner


def make_forward_batch(sampling_info, rids):
    """The ForwardBatch fields ``ModelRunner.sample`` reads, for a decode step."""
    import torch

    return types.SimpleNamespace(
        sampling_info=sampling_info,
        return_logprob=False,
        top_logprobs_nums=None,
        token_ids_logprobs=None,
        forward_mode=types.SimpleNamespace(is_decode=lambda: True),
        positions=torch.zeros(len(rids), dtype=torch.int64),
        seq_lens=torch.full((len(rids),), 4, dtype=torch.int64),
        rids=list(rids),
    )


def _owner_and_attr(target: str):
    import pkgutil

    obj_path, attr = target.rsplit(".", 1)
    return pkgutil.resolve_name(obj_path), attr


@contextmanager
def restoring_hook_targets():
    """Snapshot every plugin hook target and the HookRegistry; put both back on exit."""
    from sglang.srt.plugins import hook_registry
    from sglang.srt.plugins.hook_registry import HookRegistry

    from spec_decode import sglang_plugin

    saved = []
    for target in sglang_plugin.HOOK_TARGETS:
        owner, attr = _owner_and_attr(target)
        raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        saved.append((owner, attr, raw))
    HookRegistry.reset()
    try:
        yield
    finally:
        for owner, attr, raw in saved:
            current = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            setattr(owner, attr, raw)
            if current is not raw and not isinstance(owner, type):
                # undo HookRegistry's rebinding of `from module import name` copies
                hook_registry._propagate_patch(current, raw, owner)
        HookRegistry.reset()


@contextmanager
def applied_plugin(nan_policy):
    """Register the plugin and apply it with SGLang's HookRegistry; undo every patch on exit."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from spec_decode import sglang_plugin

    with restoring_hook_targets():
        state = sglang_plugin.register(nan_policy)
        HookRegistry.apply_hooks()
        yield state


def registered_hook(target: str):
    """The safespec hook registered with SGLang's HookRegistry for ``target``."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return next(h for _, h, _ in HookRegistry._hooks[target] if getattr(h, "safespec_hook", False))


class HostReads:
    """Count tensor reads on the host during a step, split by what they read.

    ``copied``: reads of tensors that went through SGLang's result copy
    (``sglang.srt.managers.utils._async_d2h``); on a GPU these read pinned host memory
    after the ``copy_done`` wait SGLang makes anyway. ``device``: every other read, each
    a host sync on a GPU. ``waits``: ``copy_done.synchronize()`` calls (see ``CopyDone``).
    Install with ``install(monkeypatch)``.
    """

    READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self):
        self.copied: list = []
        self.device: list = []
        self._copies: list = []

    def install(self, monkeypatch) -> "HostReads":
        import torch
        from sglang.srt.managers import utils as sglang_utils

        original_d2h = sglang_utils._async_d2h

        def async_d2h(tensor):
            out = original_d2h(tensor)
            self._copies.append(out)
            return out

        monkeypatch.setattr(sglang_utils, "_async_d2h", async_d2h)
        for name in self.READS:
            original = getattr(torch.Tensor, name)

            def spy(tensor, *a, _original=original, _name=name, **k):
                copied = any(tensor is c for c in self._copies)
                (self.copied if copied else self.device).append(_name)
                return _original(tensor, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, spy)
        return self


class CopyDone:
    """Stands for the ``copy_done`` event a scheduler gives each result; counts waits."""

    def __init__(self):
        self.recorded = 0
        self.waits = 0

    def record(self):
        self.recorded += 1

    def synchronize(self):
        self.waits += 1
