"""The SGLang plugin across ranks: TP agreement on two real processes, the PP output ring, the start-up check.

Needs sglang (``make test-sglang``); skipped with "sglang not installed" otherwise.

- Agreement: two processes joined by a gloo group stand for two TP ranks of one batch.
  They call SGLang's real ``ModelRunner.sample`` / ``Sampler`` through the plugin's hooks,
  with a NaN injected on rank 1 only (what a fault on one device, a per-rank grammar mask
  or an LM head that skips the gather looks like). Both ranks must finish the same
  requests in the same step, or SGLang's next collective would hang. A partial NaN on one
  rank only is a disagreement: both ranks end the request, under guard too.
- PP: the counts go through SGLang's real ``add_auxiliary_output_to_pp_tensors`` and the
  real ``SchedulerPPMixin._pp_prepare_tensor_dict`` / ``_pp_prep_batch_result``, in the
  order SGLang's ring sends them (last stage -> stage 0 -> stage 1 ...); every stage
  must abort the request. Four processes (PP 2 x attention-TP 2) send them through
  SGLang's real ``send_tensor_dict`` / ``recv_tensor_dict``, plain and speculative relay.
- Start-up: two processes run SGLang's real ``load_plugins`` and the hooked
  ``Scheduler.init_model_worker`` with rank 1 under ``off``, refused, or without the
  plugin; every rank with the plugin fails within the bounded wait, naming rank 1.
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
    batch = types.SimpleNamespace(reqs=reqs, forward_mode=types.SimpleNamespace(is_idle=lambda: False),
                                  sampling_info=make_sampling_info(len(reqs), VOCAB, greedy=True))
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
            # req-a: partial NaN on this rank only, at its argmax column: sanitized, this rank
            # alone would pick another token. The ranks disagree, so both must end it.
            logits[0, int(logits[0].argmax())] = NAN
        reads = HostReads().install(monkeypatch)
        decode_step(sampler, logits, reqs)
        monkeypatch.undo()
        out["sampler"] = _aborted(reqs)
        out["sampler_host_syncs"] = reads.device
        out["sampler_message"] = {req.rid: req.finished_reason.message for req in reqs if req.finished()}

        reqs = [make_req(rid) for rid in RIDS]
        logits = _logits(len(reqs) * DRAFT_TOKEN_NUM)
        if rank == 1:
            logits[2 * DRAFT_TOKEN_NUM + 1] = NAN  # req-c: a dead tree-node row, on this rank only
            logits[1, int(logits[1].argmax())] = NAN  # req-a: a partial NaN in a tree node, this rank only
        _verify_step(reqs, logits)
        out["verify"] = _aborted(reqs)

        reqs = [make_req(rid) for rid in RIDS]
        logits = _logits(len(reqs))
        if rank == 1:  # +-Inf on this rank only: its argmax moves for req-a and req-c, not req-b
            logits[0, int(logits[0].argmax())] = -float("inf")
            logits[2, int(logits[2].argmin())] = float("inf")
        tokens, _ = decode_step(sampler, logits, reqs)
        out["inf"] = _aborted(reqs)
        out["inf_tokens"] = tokens.tolist()
    return out


def _config_rank(rank: int) -> dict:
    """One rank of the start-up check, with equal configs, then with rank 1 on another policy."""
    import torch.distributed as dist

    outcomes = {}
    for name, policies in (("same", ("guard", "guard")), ("mismatch", ("guard", "abort"))):
        config = {"policy": policies[rank], "safespec": "1.0.0", "sglang": "0.5.23"}
        try:
            sglang_plugin.check_ranks_agree(config, dist.group.WORLD, key=f"test-config-{name}")
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


STARTUP_TIMEOUT_S = 8  # the start-up check's bounded wait in these tests
# Rank 1's start-up in each scenario: its environment when SGLang's load_plugins runs (rank 0: the default, guard).
STARTUP_SCENARIOS = {
    "off": {"SAFESPEC_NAN_POLICY": "off"},
    "refused": {"SAFESPEC_TEST_REFUSE": "1"},  # a required symbol is missing on rank 1 only
    "not-allowed": {"SGLANG_PLUGINS": "other_plugin"},  # rank 1 never loads the plugin: it cannot report
    "bad-policy": {"SAFESPEC_NAN_POLICY": "gaurd"},  # a typo on rank 1 only
}


def _start_rank(rank: int, scenario: str, out_dir: str) -> dict:
    """One scheduler rank's start: SGLang's real ``load_plugins`` (safespec's entry point), then
    ``Scheduler.init_model_worker`` as hooked, which runs the start-up check. Returns the error and
    the seconds it took. A rank without the check goes on as SGLang would (its first TP
    collective), standing here as a wait for rank 0 to finish."""
    import importlib.metadata
    import os
    import time
    from pathlib import Path

    import torch.distributed as dist
    import sglang.srt.plugins as plugins
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache import common
    from sglang.srt.plugins.hook_registry import HookRegistry

    from spec_decode.integrations import sglang_ranks

    monkeypatch = pytest.MonkeyPatch()
    env = STARTUP_SCENARIOS[scenario] if rank == 1 else {}
    for name in ("SAFESPEC_NAN_POLICY", "SGLANG_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(sglang_ranks.STARTUP_TIMEOUT_ENV, str(STARTUP_TIMEOUT_S))
    monkeypatch.setattr(sglang_ranks, "STARTUP_KEY", f"test-start-{scenario}")
    if env.get("SAFESPEC_TEST_REFUSE"):
        monkeypatch.setattr(common, "release_kv_cache", lambda req, tree_cache, *, checkpoint: None)
    entry = importlib.metadata.EntryPoint(
        name="safespec", value="spec_decode.integrations.sglang_plugin:register", group=plugins.GENERAL_PLUGINS_GROUP
    )
    monkeypatch.setattr(plugins, "entry_points", lambda group: [entry] if group == entry.group else [])
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    error = None
    start = time.monotonic()
    try:
        with sglang_ranks_context(dist.group.WORLD), restoring_hook_targets():
            monkeypatch.setattr(Scheduler, "init_model_worker", lambda self: None)  # no model; the hooks run around it
            plugins.load_plugins()
            checked = bool(HookRegistry._hooks.get(sglang_plugin.RANKS_TARGET))
            try:
                Scheduler.init_model_worker(object())
            except sglang_plugin.SGLangPluginError as exc:
                error = str(exc)
    finally:
        monkeypatch.undo()
    elapsed = time.monotonic() - start
    marker = Path(out_dir, f"{scenario}.rank0-done")
    if rank == 0:
        marker.touch()
    else:
        while not marker.exists() and time.monotonic() - start < 6 * STARTUP_TIMEOUT_S:
            time.sleep(0.1)
    os.environ.pop(sglang_ranks.STARTUP_TIMEOUT_ENV, None)
    return {"error": error, "elapsed_s": elapsed, "checked": checked}


def _ranks_main(rank: int, out_dir: str) -> dict:
    """Everything the two-rank tests check, in one spawn (each spawned rank imports sglang once)."""
    return {"guard": _agreement_rank(rank, "guard"), "abort": _agreement_rank(rank, "abort"),
            "raise": _raise_rank(rank), "config": _config_rank(rank),
            "start": {name: _start_rank(rank, name, out_dir) for name in STARTUP_SCENARIOS}}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Each rank's outcomes (``_ranks_main``); a hung collective fails every test that uses it."""
    out_dir = tmp_path_factory.mktemp("ranks")
    return run_ranks(_ranks_main, 2, out_dir, str(out_dir), timeout_s=RANKS_TIMEOUT_S)


@pytest.mark.parametrize("policy", ["guard", "abort"])
def test_ranks_finish_the_same_requests_when_only_one_rank_sees_nan(two_ranks, policy):
    """req-b: dead on rank 1 only; req-a: a partial NaN on rank 1 only, at its argmax column.
    Under guard too, both ranks end req-a: they counted it differently (they disagree)."""
    for rank, out in enumerate(two_ranks):
        out = out[policy]
        assert out["sampler"] == ["req-a", "req-b"], f"rank {rank}"
        assert out["verify"] == ["req-a", "req-c"], f"rank {rank}"
        # Both requests' counts differ between the ranks: the message names the range of their counts.
        assert "the ranks disagree: 0-1 NaN logits and 0-0 dead rows" in out["sampler_message"]["req-a"], out
        assert f"policy '{policy}'" in out["sampler_message"]["req-a"]
        assert out["sampler_host_syncs"] == [], f"rank {rank}: the reduction must not read the device"


@pytest.mark.parametrize("policy", ["guard", "abort"])
def test_ranks_finish_the_same_requests_when_only_one_rank_sees_inf(two_ranks, policy):
    """-Inf at req-a's argmax and +Inf off req-c's on rank 1 only: the ranks' tokens part for those
    two, so both ranks end them (the counts of +-Inf are reduced like NaN); req-b goes on."""
    tokens = [out[policy]["inf_tokens"] for out in two_ranks]
    assert tokens[0][1] == tokens[1][1] and tokens[0][0] != tokens[1][0] and tokens[0][2] != tokens[1][2]
    for rank, out in enumerate(two_ranks):
        assert out[policy]["inf"] == ["req-a", "req-c"], f"rank {rank}"


def test_raise_stops_every_rank_naming_the_request(two_ranks):
    assert [out["raise"] for out in two_ranks] == [{"req-b": 1}, {"req-b": 1}]


def test_start_fails_on_every_rank_when_policies_differ(two_ranks):
    for out in two_ranks:
        assert out["config"]["same"] is None
        message = out["config"]["mismatch"]
        assert message is not None and "rank 0: policy=guard" in message and "rank 1: policy=abort" in message
        assert "safespec=" not in message  # only what differs


@pytest.mark.parametrize("scenario", ["off", "refused"])
def test_start_fails_on_both_ranks_naming_rank_1_when_it_is_off_or_refused(two_ranks, scenario):
    """Rank 1 under ``off``, or refused (a required symbol missing there), still reports: both fail at once."""
    expected = "rank 1: policy=off" if scenario == "off" else "rank 1: policy=refused: missing "
    for rank, out in enumerate(two_ranks):
        start = out["start"][scenario]
        assert start["checked"], f"rank {rank} registered the start-up check"
        assert start["error"] is not None and "rank 0: policy=guard" in start["error"], (rank, start)
        assert expected in start["error"], (rank, start["error"])
        assert start["elapsed_s"] < STARTUP_TIMEOUT_S, (rank, start["elapsed_s"])


def test_start_fails_within_seconds_on_every_rank_when_one_has_a_bad_policy(two_ranks):
    """``SAFESPEC_NAN_POLICY=gaurd`` on rank 1 only: rank 1 still reports, so neither waits out the timeout."""
    for rank, out in enumerate(two_ranks):
        start = out["start"]["bad-policy"]
        assert start["checked"] and start["error"] is not None, (rank, start)
        assert "SAFESPEC_NAN_POLICY" in start["error"] and "'gaurd'" in start["error"], (rank, start["error"])
        assert all(f"'{p.value}'" in start["error"] for p in NanPolicy), start["error"]
        assert start["elapsed_s"] < STARTUP_TIMEOUT_S, (rank, start["elapsed_s"])


def test_start_fails_within_the_timeout_naming_a_rank_without_the_plugin(two_ranks):
    """Rank 1 never loads the plugin (``SGLANG_PLUGINS`` leaves it out): rank 0 fails naming it, not a hang."""
    rank0, rank1 = (out["start"]["not-allowed"] for out in two_ranks)
    assert not rank1["checked"] and rank1["error"] is None
    assert rank0["error"] is not None and "ranks [1] did not report" in rank0["error"], rank0
    assert STARTUP_TIMEOUT_S <= rank0["elapsed_s"] < STARTUP_TIMEOUT_S + 10


def test_rank_config_names_versions(monkeypatch):
    state = sglang_plugin.PluginState(policy=NanPolicy.GUARD)
    config = sglang_plugin.rank_config(state)
    assert set(config) == {"policy", "safespec", "sglang", "torch", "triton"}
    assert config["policy"] == "guard" and config["torch"] == torch.__version__
    refused = sglang_plugin.PluginState(policy=NanPolicy.GUARD, refused="missing x")
    assert sglang_plugin.rank_config(refused)["policy"] == "refused: missing x"


def test_agree_reduces_max_and_spread_in_one_collective(monkeypatch):
    """Two ranks, simulated: MAX of the counts and of their negation in one all-reduce; rows COUNT_ROWS."""
    import torch.distributed as dist

    other = torch.tensor([[0, 2, 1], [0, 1, 0], [1, 0, 0]], dtype=torch.int32)  # what the other rank counted
    issued = []

    def all_reduce(tensor, op=None, group=None):
        issued.append(group)
        tensor.copy_(torch.maximum(tensor, torch.cat((other, -other))))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    mine = torch.tensor([[0, 2, 0], [0, 1, 0], [0, 0, 0]], dtype=torch.int32)
    out = sglang_plugin.agree(mine, ("tp",))
    assert issued == ["tp"]
    assert sglang_plugin.COUNT_ROWS == ("nan", "dead_rows", "inf", "nan_spread", "dead_rows_spread", "inf_spread")
    assert out.tolist() == [[0, 2, 1], [0, 1, 0], [1, 0, 0], [0, 0, 1], [0, 0, 0], [1, 0, 0]]


# ---------------------------------------------------------------- one rank: nothing is issued


def test_one_rank_issues_no_collective(monkeypatch):
    import torch.distributed as dist

    issued = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: issued.append(a))
    counts = torch.ones(2, 3, dtype=torch.int32)
    assert sglang_plugin.agree(counts, (None, None)).tolist() == [[1] * 3, [1] * 3, [0] * 3, [0] * 3]
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
    counts = torch.tensor([[0, 3, 0], [0, 1, 0], [0, 0, 0], [0, 0, 0]], dtype=torch.int32)
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


# ---------------------------------------------------------------- PP x attention-TP 2: SGLang's real transport

PP_ATTN_TP = 2  # ranks 0, 1: stage 0; ranks 2, 3: the last stage (stage 1); attention-TP groups {0, 1}, {2, 3}


def _coordinators(rank: int):
    """SGLang's real ``GroupCoordinator``s (gloo, CPU) for the PP group and the attention-TP group of ``rank``."""
    from sglang.srt.distributed.parallel_state import init_model_parallel_group

    groups = dict(backend="gloo", use_pynccl=False, use_custom_allreduce=False, use_mscclpp=False,
                  use_torch_symm_mem_allreduce=False)
    pp = init_model_parallel_group([[0, 2], [1, 3]], rank, group_name="pp", **groups)
    attn_tp = init_model_parallel_group([[0, 1], [2, 3]], rank, group_name="attn_tp", **groups)
    return pp, attn_tp


def _pp_spec_stage(is_first: bool):
    """A PP scheduler shell for the speculative relay branch of ``_pp_prep_batch_result``."""
    stage = _stage(is_first)
    stage._pp_spec_relay = True
    stage._pp_spec_commit_relayed_accept = lambda *a, **k: None  # KV bookkeeping: not what is tested
    stage._pp_spec_adopt_relayed_tree = lambda *a, **k: None
    return stage


def _last_stage_verify_dict(attn_tp_rank: int, reqs):
    """The last stage of a PP+spec round: the verify hook on this rank's logits (a dead tree-node row of
    req-c on attention-TP rank 1 only), then SGLang's ``_pp_prepare_tensor_dict`` with the spec relay on."""
    logits = _logits(len(reqs) * DRAFT_TOKEN_NUM)
    if attn_tp_rank == 1:
        logits[2 * DRAFT_TOKEN_NUM + 1] = NAN
    batch = types.SimpleNamespace(reqs=reqs, forward_mode=types.SimpleNamespace(is_idle=lambda: False),
                                  sampling_info=make_sampling_info(len(reqs), VOCAB, greedy=True),
                                  return_logprob=False, spec_algorithm=types.SimpleNamespace(is_dspark=lambda: False))
    verify_input = types.SimpleNamespace(draft_token_num=DRAFT_TOKEN_NUM, draft_probs=None)
    logits_output = LogitsProcessorOutput(next_token_logits=logits)
    registered_hook(sglang_plugin.VERIFY_TARGET)(lambda *a, **k: None, verify_input, batch, logits_output, None)
    bs = len(reqs)
    result = GenerationBatchResult(
        logits_output=logits_output, next_token_ids=torch.zeros(bs * DRAFT_TOKEN_NUM, dtype=torch.int64),
        accept_lens=torch.ones(bs, dtype=torch.int32), new_seq_lens=torch.full((bs,), 5, dtype=torch.int64),
        next_draft_input=types.SimpleNamespace(bonus_tokens=torch.zeros(bs, dtype=torch.int64), topk_p=None),
    )
    shell = types.SimpleNamespace(_pp_spec_relay=True)
    return SchedulerPPMixin._pp_prepare_tensor_dict(shell, result, batch)


def _pp_attn_tp_rank(rank: int) -> dict:
    """One of four ranks (PP 2 x attention-TP 2): the last stage samples (and verifies) with a dead row on its
    attention-TP rank 1 only; the dict goes to stage 0 through SGLang's real ``send_tensor_dict`` /
    ``recv_tensor_dict``, which split each tensor across the attention-TP ranks and all-gather it back."""
    import torch.distributed as dist
    from sglang.srt.layers.sampler import Sampler
    from sglang.srt.runtime_context import get_spec

    pp, attn_tp = _coordinators(rank)
    out = {"stage": pp.rank_in_group}
    with sglang_ranks_context(attn_tp.device_group), applied_plugin("guard"), \
            get_spec().override(speculative_num_draft_tokens=DRAFT_TOKEN_NUM):
        for branch in ("plain", "spec"):
            reqs = [make_req(rid) for rid in RIDS]
            if pp.is_last_rank:
                if branch == "plain":
                    logits = _logits(len(reqs))
                    if attn_tp.rank_in_group == 1:
                        logits[1] = NAN  # req-b: dead on this attention-TP rank only
                    tensor_dict = _last_stage_dict(Sampler(), logits, reqs)
                else:
                    tensor_dict = _last_stage_verify_dict(attn_tp.rank_in_group, reqs)
                out[f"{branch}_sent"] = sorted(k for k in tensor_dict if sglang_plugin.PP_TENSOR_PREFIX in k)
                pp.send_tensor_dict(tensor_dict, all_gather_group=attn_tp)  # to stage 0, the ring's next
            else:
                received = pp.recv_tensor_dict(all_gather_group=attn_tp)
                stage = _stage(is_first=True) if branch == "plain" else _pp_spec_stage(is_first=True)
                batch = types.SimpleNamespace(
                    reqs=reqs, return_logprob=False, req_pool_indices=None, input_ids=None,
                    spec_algorithm=types.SimpleNamespace(is_dspark=lambda: False),
                    seq_lens=torch.full((len(reqs),), 4, dtype=torch.int64), seq_lens_cpu=None,
                )
                metadata = types.SimpleNamespace(can_run_cuda_graph=False, fpm_timing=None, fwd_batch=None,
                                                 verify_out_cache_loc=None)
                result = SchedulerPPMixin._pp_prep_batch_result(stage, batch, metadata, PPProxyTensors(received))
                registered_hook(sglang_plugin.RESULT_TARGET)(process_like_sglang, stage, batch, result)
                out[f"{branch}_aborted"] = _aborted(reqs)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def pp_attn_tp_ranks(tmp_path_factory):
    return run_ranks(_pp_attn_tp_rank, 2 * PP_ATTN_TP, tmp_path_factory.mktemp("pp_attn_tp"), timeout_s=RANKS_TIMEOUT_S)


@pytest.mark.parametrize("branch, site, dead", [("plain", "sampler", ["req-b"]), ("spec", "verify", ["req-c"])])
def test_pp_relay_through_sglangs_send_and_recv_tensor_dict_with_attention_tp_2(pp_attn_tp_ranks, branch, site, dead):
    """Each last-stage rank sends half of every tensor, stage 0's ranks all-gather it back: the counts
    (agreed over the last stage's attention-TP ranks) reach both ranks of stage 0, which both abort."""
    for rank, out in enumerate(pp_attn_tp_ranks):
        if out["stage"] == 1:
            (key,) = out[f"{branch}_sent"]  # SGLang prefixes it with its auxiliary-output prefix
            assert key.endswith(f"{sglang_plugin.PP_TENSOR_PREFIX}{site}"), (rank, out)
        else:
            assert out[f"{branch}_aborted"] == dead, (rank, out)


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
        counts = torch.tensor([[0, 0, 4], [0, 0, 1], [0, 0, 0], [0, 0, 0]], dtype=torch.int32)
        sglang_plugin.attach_counts(logits_output, sglang_plugin.NanCountsOnDevice("sampler", RIDS, counts))
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
