"""Run SGLang's real CPU-capable pieces in one process, or in two joined by gloo, for the plugin tests.

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

    from spec_decode.integrations import sglang_plugin

    saved = []
    for target in sglang_plugin.HOOK_TARGETS:
        owner, attr = _owner_and_attr(target)
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if raw is not None:  # a test may have removed a target to see the plugin do without it
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

    from spec_decode.integrations import sglang_plugin

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


def process_like_sglang(scheduler, batch, result):
    """What ``process_batch_result_decode`` does with a plain decode result, in order:
    wait for the copy, read the token ids from the host copy, commit, check finish."""
    if result.copy_done is not None:
        result.copy_done.synchronize()
    for req, token in zip(batch.reqs, result.next_token_ids.tolist()):
        if req.finished():
            continue
        req.output_ids.append(token)
        req.update_finish_state()


def decode_step(sampler, logits, reqs, *, greedy=True):
    """One decode step of ``reqs`` through SGLang's sample, result copy and result processing.

    Run inside ``applied_plugin``: the result is processed through the plugin's hook on
    ``Scheduler.process_batch_result``. Returns (token ids, the result's CopyDone)."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.model_runner import ModelRunner

    from spec_decode.integrations import sglang_plugin

    runner = make_model_runner(sampler)
    rids = [req.rid for req in reqs]
    forward_batch = make_forward_batch(make_sampling_info(len(reqs), logits.shape[-1], greedy=greedy), rids)
    logits_output = LogitsProcessorOutput(next_token_logits=logits)
    next_token_ids = ModelRunner.sample(runner, logits_output, forward_batch)
    result = GenerationBatchResult(logits_output=logits_output, next_token_ids=next_token_ids, copy_done=CopyDone())
    result.copy_to_cpu(return_logprob=False)  # SGLang's one device-to-host copy of the step
    batch = types.SimpleNamespace(reqs=reqs)
    registered_hook(sglang_plugin.RESULT_TARGET)(process_like_sglang, None, batch, result)
    return next_token_ids, result.copy_done


class RankGroup:
    """Stands for SGLang's ``GroupCoordinator`` over a real torch.distributed group (gloo in tests)."""

    def __init__(self, group):
        import torch.distributed as dist

        self.device_group = self.cpu_group = group
        self.world_size = dist.get_world_size(group)
        self.rank_in_group = dist.get_rank(group)


@contextmanager
def sglang_ranks_context(group, sampling_backend: str = "pytorch"):
    """Publish dummy ServerArgs (CPU) and ``group`` as SGLang's tp group and world group.

    The widths SGLang checks against the group (tp, attention-TP, MoE-TP) are set to its size.
    """
    from sglang.srt.runtime_context import get_context, get_parallel

    g = RankGroup(group)
    widths = dict(tp_size=g.world_size, attn_tp_size=g.world_size, moe_tp_size=g.world_size)
    ranks = dict(tp_rank=g.rank_in_group, attn_tp_rank=g.rank_in_group, moe_tp_rank=g.rank_in_group)
    with ExitStack() as stack:
        stack.enter_context(
            get_context().override_server_args(sampling_backend=sampling_backend, device="cpu")
        )
        stack.enter_context(get_parallel().override(**widths, **ranks, tp_group=g, world_group=g, pp_size=1))
        yield


def _rank_main(fn, rank: int, world_size: int, store_path: str, out_dir: str, args) -> None:
    """Body of one spawned rank: join a gloo group, run ``fn(rank, *args)``, write its JSON result."""
    import json
    import traceback

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        out = {"result": fn(rank, *args)}
    except Exception as exc:  # reported to the parent, which fails the test with it
        out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


def run_ranks(fn, world_size: int, tmp_path, *args, timeout_s: float = 300.0) -> list:
    """Run ``fn(rank, *args)`` in ``world_size`` spawned processes joined by one gloo group.

    ``fn`` must be importable by name (a module-level function). Returns each rank's JSON
    result, in rank order; raises ``TimeoutError`` naming the ranks still running after
    ``timeout_s`` (a hang, killed), and ``RuntimeError`` with a rank's traceback if one failed.
    """
    import json
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    store = Path(tmp_path) / "gloo_store"
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, str(store), str(tmp_path), args))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.1))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    if hung:
        raise TimeoutError(f"ranks {hung} still running after {timeout_s:.0f} s (a collective hung)")
    outs = []
    for rank in range(world_size):
        path = Path(tmp_path) / f"rank{rank}.json"
        if not path.exists():
            raise RuntimeError(f"rank {rank} wrote no result (exit code {procs[rank].exitcode})")
        out = json.loads(path.read_text())
        if "error" in out:
            raise RuntimeError(f"rank {rank}: {out['traceback']}")
        outs.append(out["result"])
    return outs


def agree_cost_rank(rank: int, calls: int, batch: int) -> dict:
    """One rank of the reduction's cost: seconds per ``sglang_plugin.agree`` call on the world
    group, and per call with no group (what one rank pays). Run with ``run_ranks``; the
    command and figures are in docs/sglang.md."""
    import time

    import torch
    import torch.distributed as dist

    from spec_decode.integrations import sglang_plugin

    counts = torch.zeros(3, batch, dtype=torch.int32)  # [3, num_reqs] (nan, dead_rows, inf), as the hooks reduce it
    for _ in range(10):  # warm-up
        sglang_plugin.agree(counts, (dist.group.WORLD,))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        sglang_plugin.agree(counts, (dist.group.WORLD,))
    reduced = (time.perf_counter() - start) / calls
    start = time.perf_counter()
    for _ in range(calls):
        sglang_plugin.agree(counts, (None,))
    return {"reduced_s": reduced, "one_rank_s": (time.perf_counter() - start) / calls}


@contextmanager
def eagle_sample_on_cpu(*, rejection_sampling: bool):
    """SGLang's real ``eagle_sample`` runnable on CPU tensors; yields the ``target_predict`` it computed.

    Greedy (``rejection_sampling=False``): SGLang's CPU path (``eagle_utils._is_cpu`` set), its argmax; only the tree walk
    (``verify_tree_greedy_func``, an ``sgl_kernel`` op on CPU) is replaced by a recorder that
    accepts nothing. Rejection sampling: SGLang's GPU path (its softmax and its Triton
    ``chain_speculative_sampling_triton``, under ``TRITON_INTERPRET=1``), chosen by clearing
    ``_is_cpu``. Server args are published with the rejection-sampling switch.
    """
    import pytest
    from sglang.srt.runtime_context import get_context
    from sglang.srt.speculative import eagle_utils

    seen = {}

    def tree_greedy(predicts, accept_index, accept_token_num, target_predict, **_):
        seen["target_predict"] = target_predict.clone()
        accept_token_num.zero_()
        return predicts, accept_index, accept_token_num

    monkeypatch = pytest.MonkeyPatch()
    try:
        monkeypatch.setattr(eagle_utils, "verify_tree_greedy_func", tree_greedy)
        monkeypatch.setattr(eagle_utils, "_is_cpu", not rejection_sampling)
        with sglang_cpu_context(), get_context().override_server_args(
                speculative_use_rejection_sampling=rejection_sampling, device="cpu"):
            yield seen
    finally:
        monkeypatch.undo()


def eagle_verify_case(bs: int, draft_token_num: int, vocab: int, seed: int = 0):
    """Seeded chain-tree inputs of ``eagle_sample``: (verify_input, batch, logits_output), all clean.

    Penalties (additive and scaling) and ``logit_bias`` are set, so SGLang's own steps before its
    argmax all run. ``batch.reqs`` are real ``Req`` named ``r0`` ... Shape: logits
    [bs * draft_token_num, vocab]; draft_probs [bs, draft_token_num - 1, vocab].
    """
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    g = torch.Generator().manual_seed(seed)
    info = make_sampling_info(bs, vocab, greedy=False)
    info.acc_additive_penalties = 0.1 * torch.randn(bs, vocab, generator=g)
    info.acc_scaling_penalties = 1 + torch.rand(bs, vocab, generator=g)
    info.logit_bias = torch.randn(bs, vocab, generator=g)
    steps = draft_token_num - 1
    nodes = torch.arange(draft_token_num)
    verify_input = types.SimpleNamespace(
        draft_token_num=draft_token_num, max_tree_depth=draft_token_num, tree_topk=1,
        draft_token=torch.randint(0, vocab, (bs * draft_token_num,), generator=g),
        retrieve_index=torch.arange(bs * draft_token_num).view(bs, draft_token_num),
        retrieve_next_token=torch.where(nodes < steps, nodes + 1, -1).repeat(bs, 1),
        retrieve_next_sibling=torch.full((bs, draft_token_num), -1),
        draft_probs=torch.softmax(2 * torch.randn(bs, steps, vocab, generator=g), -1),
    )
    batch = types.SimpleNamespace(
        reqs=[make_req(f"r{i}") for i in range(bs)], device="cpu", sampling_info=info,
        forward_mode=types.SimpleNamespace(is_idle=lambda: False), seq_lens=torch.full((bs,), 4),
        return_logprob=False,
    )
    logits_output = LogitsProcessorOutput(next_token_logits=torch.randn(bs * draft_token_num, vocab, generator=g))
    return verify_input, batch, logits_output
