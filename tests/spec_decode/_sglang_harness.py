"""Run SGLang's real CPU-capable pieces in one process, for the plugin tests.

Stubs only what cannot run on a CPU-only machine: ``torchvision``, whose PyPI
wheel needs SGLang's CUDA torch build; sglang imports it at module level for
vision preprocessing that these tests never reach. Nothing here runs at import:
tests call ``import_sglang()``, which installs the stub and reports whether
sglang imports at all.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from contextlib import ExitStack, contextmanager

TORCHVISION = "torchvision"


class _StubAttr:
    """Stands for any torchvision attribute; fails loudly if actually used."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "_StubAttr":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _StubAttr(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is stubbed in the safespec SGLang test harness")

    def __mro_entries__(self, bases):  # allows `class X(torchvision.Foo)` at import time
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _StubAttr(f"{self.__name__}.{attr}")


class _TorchvisionStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision`` and every ``torchvision.*`` submodule as a stub module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == TORCHVISION or fullname.startswith(TORCHVISION + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []  # a package, so submodule imports resolve through us
        module.__version__ = "0.0.0+safespec-stub"
        return module

    def exec_module(self, module):
        pass


def install_torchvision_stub() -> bool:
    """Put the stub finder first on ``sys.meta_path`` unless a real torchvision imports.

    Returns True when the stub is in use.
    """
    if any(isinstance(f, _TorchvisionStubFinder) for f in sys.meta_path):
        return True
    if TORCHVISION in sys.modules:
        return False
    try:
        importlib.import_module(TORCHVISION)
        return False
    except Exception:  # the CUDA-only wheel fails with OSError/RuntimeError, absent -> ImportError
        sys.modules.pop(TORCHVISION, None)
    sys.meta_path.insert(0, _TorchvisionStubFinder())
    return True


def import_sglang() -> str | None:
    """Import what the plugin and the tests touch; returns None on success, else the reason."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang not installed"
    install_torchvision_stub()
    try:
        import sglang.srt.layers.sampler  # noqa: F401
        import sglang.srt.plugins.hook_registry  # noqa: F401
    except ImportError as exc:  # a missing pure-Python dependency of sglang's import chain
        return f"sglang not importable: {exc}"
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
