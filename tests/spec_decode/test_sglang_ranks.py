"""The SGLang plugin across ranks: TP agreement on two real processes, the PP output ring, the start-up check.

Needs sglang (``make test-sglang``); skipped with "sglang not installed" otherwise.

- Agreement: two processes joined by a gloo group stand for two TP ranks of one batch.
  They call SGLang's real ``ModelRunner.sample`` / ``Sampler`` through the plugin's hooks,
  with a NaN injected on rank 1 only (what a fault on one device, a per-rank grammar mask
  or an LM head that skips the gather looks like). Both ranks must finish the same
  requests in the same step, or SGLang's next collective would hang.
- PP: the counts go through SGLang's real ``add_auxiliary_output_to_pp_tensors`` and the
  real ``SchedulerPPMixin._pp_prepare_tensor_dict`` / ``_pp_prep_batch_result``, in the
  order SGLang's ring sends them (last stage -> stage 0 -> stage 1 ...); every stage
  must abort the request.
"""

from __future__ import annotations

import logging
import re
import types

import pytest
import torch

from _sglang_harness import import_sglang

_SKIP_REASON = import_sglang()
pytestmark = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")

if _SKIP_REASON is None:
    from _sglang_harness import (
        CopyDone,
        HostReads,
        applied_plugin,
        decode_step,
        make_model_runner,
        make_forward_batch,
        make_req,
        make_sampling_info,
        process_like_sglang,
        registered_hook,
        restoring_hook_targets,
        run_ranks,
        sglang_cpu_context,
        sglang_ranks_context,
    )
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.scheduler_pp_mixin import SchedulerPPMixin
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import PPProxyTensors
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.sampling.sampling_observer_pp import add_auxiliary_output_to_pp_tensors

    from numerics import NanPolicy
    from spec_decode.integrations import sglang_plugin

VOCAB = 11
RIDS = ("req-a", "req-b", "req-c")
NAN = float("nan")
DRAFT_TOKEN_NUM = 4
RANKS_TIMEOUT_S = 240  # two spawned processes each import sglang; a hung collective fails the test


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def _aborted(reqs) -> list:
    return sorted(req.rid for req in reqs if isinstance(req.finished_reason, FINISH_ABORT))


# ---------------------------------------------------------------- agreement: two ranks on gloo


def _verify_step(reqs, logits):
    """One EAGLE verify step at the hook boundary, then SGLang's result copy and result processing."""
    batch = types.SimpleNamespace(reqs=reqs, forward_mode=types.SimpleNamespace(is_idle=lambda: False))
    verify_input = types.SimpleNamespace(draft_token_num=DRAFT_TOKEN_NUM, draft_probs=None)
    logits_output = LogitsProcessorOutput(next_token_logits=logits)
    registered_hook(sglang_plugin.VERIFY_TARGET)(lambda *a, **k: None, verify_input, batch, logits_output, None)
    next_token_ids = torch.zeros(len(reqs), dtype=torch.int64)
    result = GenerationBatchResult(logits_output=logits_output, next_token_ids=next_token_ids, copy_done=CopyDone())
    result.copy_to_cpu(return_logprob=False)
    registered_hook(sglang_plugin.RESULT_TARGET)(process_like_sglang, None, batch, result)


def _agreement_rank(rank: int, policy: str) -> dict:
    """One TP rank: a sampler step and a verify step with a NaN on rank 1 only; what it finished."""
    import torch.distributed as dist
    from sglang.srt.layers.sampler import Sampler

    monkeypatch = pytest.MonkeyPatch()
    out = {}
    with sglang_ranks_context(dist.group.WORLD), applied_plugin(policy):
        sampler = Sampler()  # reads SGLang's tp group: its tp_sync_group is the gloo group
        reqs = [make_req(rid) for rid in RIDS]
        logits = _logits(len(reqs))
        if rank == 1:
            logits[1] = NAN  # req-b: a dead row, on this rank only
            logits[0, 3] = NAN  # req-a: partial NaN, on this rank only
        reads = HostReads().install(monkeypatch)
        decode_step(sampler, logits, reqs)
        monkeypatch.undo()
        out["sampler"] = _aborted(reqs)
        out["sampler_host_syncs"] = reads.device

        reqs = [make_req(rid) for rid in RIDS]
        logits = _logits(len(reqs) * DRAFT_TOKEN_NUM)
        if rank == 1:
            logits[2 * DRAFT_TOKEN_NUM + 1] = NAN  # req-c: a dead tree-node row, on this rank only
        _verify_step(reqs, logits)
        out["verify"] = _aborted(reqs)
    return out


def _config_rank(rank: int) -> dict:
    """One rank of the start-up check, with equal configs, then with rank 1 on another policy."""
    import torch.distributed as dist

    outcomes = {}
    for name, policies in (("same", ("guard", "guard")), ("mismatch", ("guard", "abort"))):
        config = {"policy": policies[rank], "safespec": "1.0.0", "sglang": "0.5.23"}
        try:
            sglang_plugin.check_ranks_agree(config, dist.group.WORLD)
            outcomes[name] = None
        except sglang_plugin.SGLangPluginError as exc:
            outcomes[name] = str(exc)
    return outcomes


def _raise_rank(rank: int):
    """One TP rank under ``raise`` with a NaN on rank 1 only: the rids its NanLogitsError names."""
    import torch.distributed as dist
    from sglang.srt.layers.sampler import Sampler

    from numerics import NanLogitsError

    with sglang_ranks_context(dist.group.WORLD), applied_plugin("raise"):
        logits = _logits(len(RIDS))
        if rank == 1:
            logits[1, 2] = NAN
        try:
            decode_step(Sampler(), logits, [make_req(rid) for rid in RIDS])
        except NanLogitsError as exc:
            return exc.nan_counts
    return None


def _ranks_main(rank: int) -> dict:
    """Everything the two-rank tests check, in one spawn (each spawned rank imports sglang once)."""
    return {"guard": _agreement_rank(rank, "guard"), "abort": _agreement_rank(rank, "abort"),
            "raise": _raise_rank(rank), "config": _config_rank(rank)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Each rank's outcomes (``_ranks_main``); a hung collective fails every test that uses it."""
    return run_ranks(_ranks_main, 2, tmp_path_factory.mktemp("ranks"), timeout_s=RANKS_TIMEOUT_S)


@pytest.mark.parametrize("policy, sampler_aborts", [("guard", ["req-b"]), ("abort", ["req-a", "req-b"])])
def test_ranks_finish_the_same_requests_when_only_one_rank_sees_nan(two_ranks, policy, sampler_aborts):
    for rank, out in enumerate(two_ranks):
        out = out[policy]
        assert out["sampler"] == sampler_aborts, f"rank {rank}"
        assert out["verify"] == ["req-c"], f"rank {rank}"
        assert out["sampler_host_syncs"] == [], f"rank {rank}: the reduction must not read the device"


def test_raise_stops_every_rank_naming_the_request(two_ranks):
    assert [out["raise"] for out in two_ranks] == [{"req-b": 1}, {"req-b": 1}]


def test_start_fails_on_every_rank_when_policies_differ(two_ranks):
    for out in two_ranks:
        assert out["config"]["same"] is None
        message = out["config"]["mismatch"]
        assert message is not None and "rank 0: policy=guard" in message and "rank 1: policy=abort" in message
        assert "safespec=" not in message  # only what differs


# ---------------------------------------------------------------- one rank: nothing is issued


def test_one_rank_issues_no_collective(monkeypatch):
    import torch.distributed as dist

    issued = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: issued.append(a))
    counts = torch.ones(2, 3, dtype=torch.int32)
    assert sglang_plugin.agree(counts, (None, None)) is counts
    assert sglang_plugin.verify_groups() == ()  # torch.distributed not initialized: no group
    assert issued == []


@pytest.mark.parametrize("dp_attention, expected", [(False, "tp-group"), (True, "attn-tp-group")])
def test_verify_reduces_over_the_group_eagle_sample_broadcasts_over(monkeypatch, dp_attention, expected):
    import torch.distributed as dist
    from sglang.srt import runtime_context
    from sglang.srt.layers import dp_attention as dpa

    parallel = types.SimpleNamespace(tp_group=types.SimpleNamespace(world_size=4, device_group="tp-group"),
                                     attn_tp_group=types.SimpleNamespace(world_size=2, device_group="attn-tp-group"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dpa, "is_dp_attention_enabled", lambda: dp_attention)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: parallel)
    assert sglang_plugin.verify_groups() == (expected,)
    parallel.tp_group.world_size = parallel.attn_tp_group.world_size = 1  # attention-TP 1 / TP 1
    assert sglang_plugin.verify_groups() == ()


def test_groups_are_the_ones_sglang_itself_syncs_over():
    """The plugin's choice of groups is SGLang's own: the Sampler's sync groups, eagle_sample's broadcast group."""
    import inspect

    from sglang.srt.layers.sampler import Sampler
    from sglang.srt.speculative.eagle_utils import eagle_sample

    init = inspect.getsource(Sampler.__init__)
    assert "self.tp_sync_group = get_parallel().attn_tp_group.device_group" in init
    assert "self.cp_sync_group = get_parallel().attn_cp_group.device_group" in init
    verify = inspect.getsource(inspect.unwrap(eagle_sample))
    broadcast_group = r"get_parallel\(\)\.attn_tp_group\s+if is_dp_attention_enabled\(\)\s+else get_parallel\(\)\.tp_group"
    assert re.search(broadcast_group, verify)
    assert "tp_group.broadcast(accept_index, src=0)" in verify


# ---------------------------------------------------------------- PP: SGLang's output ring


def test_counts_round_trip_through_sglangs_pp_transport():
    counts = torch.tensor([[0, 3, 0], [0, 1, 0]], dtype=torch.int32)
    output = sglang_plugin.NanCountsOnDevice("sampler", RIDS, counts)
    tensors = {"next_token_ids": torch.zeros(3, dtype=torch.int64)}
    add_auxiliary_output_to_pp_tensors(tensors, output)  # raises for an output without to_pp_tensors
    (back,) = sglang_plugin.NanCountsOnDevice.from_pp_tensors(tensors, RIDS)
    assert back.site == "sampler" and back.rids == RIDS and torch.equal(back.counts, counts)


def _last_stage_dict(sampler, logits, reqs):
    """The last stage: a sampler step, then SGLang's ``_pp_prepare_tensor_dict`` of its result."""
    runner = make_model_runner(sampler)
    forward_batch = make_forward_batch(make_sampling_info(len(reqs), VOCAB, greedy=True), [r.rid for r in reqs])
    logits_output = LogitsProcessorOutput(next_token_logits=logits)
    next_token_ids = ModelRunner.sample(runner, logits_output, forward_batch)
    result = GenerationBatchResult(logits_output=logits_output, next_token_ids=next_token_ids)
    batch = types.SimpleNamespace(reqs=reqs, return_logprob=False)
    return SchedulerPPMixin._pp_prepare_tensor_dict(types.SimpleNamespace(_pp_spec_relay=False), result, batch)


def _stage(is_first: bool, observer=None):
    """A PP scheduler shell holding what ``_pp_prep_batch_result`` reads."""
    return types.SimpleNamespace(
        pp_group=types.SimpleNamespace(is_first_rank=is_first),
        tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(sampling_observer=observer)),
        _pp_spec_relay=False,
        future_map=types.SimpleNamespace(stash=lambda *a, **k: None),
    )


def _receive_and_process(stage, pp_outputs, reqs):
    """One stage: SGLang's ``_pp_prep_batch_result`` on the received dict, then the result processing."""
    batch = types.SimpleNamespace(
        reqs=reqs, return_logprob=False, req_pool_indices=None, input_ids=None,
        spec_algorithm=types.SimpleNamespace(is_dspark=lambda: False),
    )
    metadata = types.SimpleNamespace(can_run_cuda_graph=False, fpm_timing=None, fwd_batch=None)
    result = SchedulerPPMixin._pp_prep_batch_result(stage, batch, metadata, pp_outputs)
    registered_hook(sglang_plugin.RESULT_TARGET)(process_like_sglang, stage, batch, result)


@pytest.mark.parametrize("pp_size", [2, 3])
def test_pp_ring_every_stage_aborts_the_dead_request(pp_size):
    """Last stage samples; its dict goes to stage 0, which hands it on to stage 1, ... as SGLang's ring does."""
    with sglang_cpu_context(), applied_plugin("guard"):
        from sglang.srt.layers.sampler import Sampler

        logits = _logits(len(RIDS))
        logits[1] = NAN  # req-b: a dead row
        tensor_dict = _last_stage_dict(Sampler(), logits, [make_req(rid) for rid in RIDS])
        pp_outputs = PPProxyTensors(tensor_dict)  # one dict object, relayed stage to stage
        aborted = []
        for stage in range(pp_size):
            reqs = [make_req(rid) for rid in RIDS]  # each stage holds its own Req objects
            _receive_and_process(_stage(is_first=stage == 0), pp_outputs, reqs)
            aborted.append(_aborted(reqs))
            assert any(sglang_plugin.PP_TENSOR_PREFIX in key for key in pp_outputs.tensors), "relayed on"
    assert aborted == [["req-b"]] * pp_size


class _PPObserverOutput:
    """Another plugin's PP-capable auxiliary output (SGLang's sampling-observer protocol)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def to_pp_tensors(self):
        return {"other": self.tensor}

    def copy_to_host(self, copy_tensor):
        return _PPObserverHost(copy_tensor(self.tensor))


class _PPObserverHost:
    def __init__(self, tensor):
        self.tensor = tensor

    def consume(self, batch, commits):
        pass


class _PPObserver:
    def from_pp_tensors(self, tensors):
        return _PPObserverOutput(tensors["other"])


def test_pp_ring_carries_the_counts_beside_another_plugins_output():
    """A composite with another output would not pass SGLang's transport: the counts travel beside it."""
    from sglang.srt.managers.auxiliary_output import CompositeHostAuxiliaryOutput

    with sglang_cpu_context(), applied_plugin("guard"):
        reqs = [make_req(rid) for rid in RIDS]
        logits_output = LogitsProcessorOutput(next_token_logits=_logits(3))
        logits_output.auxiliary_device_output = _PPObserverOutput(torch.arange(3))
        counts = torch.tensor([[0, 0, 4], [0, 0, 1]], dtype=torch.int32)
        sglang_plugin._attach(logits_output, sglang_plugin.NanCountsOnDevice("sampler", RIDS, counts))
        result = GenerationBatchResult(logits_output=logits_output, next_token_ids=torch.zeros(3, dtype=torch.int64))
        batch = types.SimpleNamespace(reqs=reqs, return_logprob=False)
        tensors = SchedulerPPMixin._pp_prepare_tensor_dict(types.SimpleNamespace(_pp_spec_relay=False), result, batch)
        stage_reqs = [make_req(rid) for rid in RIDS]
        batch = types.SimpleNamespace(reqs=stage_reqs, return_logprob=False, req_pool_indices=None, input_ids=None,
                                      spec_algorithm=types.SimpleNamespace(is_dspark=lambda: False))
        metadata = types.SimpleNamespace(can_run_cuda_graph=False, fpm_timing=None, fwd_batch=None)
        stage = _stage(is_first=True, observer=_PPObserver())
        out = SchedulerPPMixin._pp_prep_batch_result(stage, batch, metadata, PPProxyTensors(tensors))
        assert isinstance(out.auxiliary_host_output, CompositeHostAuxiliaryOutput)
        assert torch.equal(out.auxiliary_host_output.outputs[0].tensor, torch.arange(3))  # the other plugin's, intact
        registered_hook(sglang_plugin.RESULT_TARGET)(process_like_sglang, None, batch, out)
    assert _aborted(stage_reqs) == ["req-c"]


def test_with_pp_relay_guard_stays_guard_under_pp():
    with restoring_hook_targets():
        state = sglang_plugin.register("guard")
    assert state.pp_relay_missing is None
    sglang_plugin.fall_back_without_pp_relay(state, pp_size=4)
    assert state.policy is NanPolicy.GUARD


def test_without_pp_relay_guard_falls_back_to_sanitize_once(monkeypatch, caplog):
    monkeypatch.delattr(SchedulerPPMixin, "_pp_prep_batch_result")
    with restoring_hook_targets(), caplog.at_level(logging.WARNING, logger=sglang_plugin.__name__):
        state = sglang_plugin.register("guard")
        from sglang.srt.plugins.hook_registry import HookRegistry

        assert not set(sglang_plugin.PP_HOOK_TARGETS) & set(HookRegistry._hooks)
        sglang_plugin.fall_back_without_pp_relay(state, pp_size=1)
        assert state.policy is NanPolicy.GUARD  # no PP: nothing changes
        sglang_plugin.fall_back_without_pp_relay(state, pp_size=2)
        sglang_plugin.fall_back_without_pp_relay(state, pp_size=2)
    assert state.policy is NanPolicy.SANITIZE
    warnings_ = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings_) == 1
    assert "falls back to 'sanitize' under pp_size=2" in warnings_[0] and "_pp_prep_batch_result" in warnings_[0]


def test_ranks_hook_checks_the_world_group_and_pp_size(monkeypatch):
    """The start-up hook reads SGLang's world CPU group and pp_size from its parallel context."""
    seen = {}
    monkeypatch.setattr(sglang_plugin, "check_ranks_agree",
                        lambda config, group: seen.update(config=config, group=group))
    world = types.SimpleNamespace(cpu_group="world-cpu-group")
    from sglang.srt.runtime_context import get_parallel

    with applied_plugin("abort") as state, get_parallel().override(world_group=world, pp_size=1):
        registered_hook(sglang_plugin.RANKS_TARGET)(None, object())
    assert seen["group"] == "world-cpu-group"
    assert seen["config"] == sglang_plugin.rank_config(state) and seen["config"]["policy"] == "abort"
