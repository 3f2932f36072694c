"""The SGLang plugin against SGLang's real Sampler, ModelRunner.sample, result copy, Req and HookRegistry, on CPU.

Needs sglang (``make test-sglang``); skipped with "sglang not installed" otherwise.
``eagle_sample`` needs CUDA kernels for its tree walk, so the EAGLE verify site is tested
at the hook boundary: the hook is called with a stand-in for ``eagle_sample`` that, for
the draft side, calls SGLang's real Triton rejection-sampling kernel on CPU tensors
(``TRITON_INTERPRET=1``, set by ``make test-sglang``). A step's result processing is
SGLang's real ``GenerationBatchResult.copy_to_cpu`` followed by what
``process_batch_result_decode`` does with it (``process_like_sglang``). The real engine
is in ``test_sglang_engine.py``.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import types
from pathlib import Path

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
        eagle_sample_on_cpu,
        eagle_verify_case,
        make_forward_batch,
        make_model_runner,
        make_req,
        make_sampling_info,
        process_like_sglang,
        registered_hook,
        restoring_hook_targets,
        sglang_cpu_context,
    )
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.layers.sampler import Sampler
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.plugins.hook_registry import HookRegistry

    from numerics import NanLogitsError, NanPolicy
    from spec_decode.integrations import sglang_plugin

VOCAB = 11
NAN_COL = 4
RIDS = ("req-a", "req-b", "req-c")
NAN = float("nan")


@pytest.fixture
def sampler():
    with sglang_cpu_context(sampling_backend="pytorch"):
        yield Sampler()


@pytest.fixture(autouse=True)
def _sglang_env(monkeypatch):
    # SGLang's own switches stay at their defaults (sanitize off, no assert).
    for name in ("SGLANG_SANITIZE_NAN_LOGITS", "SGLANG_ENABLE_NAN_LOGITS_CHECK", "SGLANG_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SAFESPEC_NAN_POLICY", raising=False)


def _logits(batch_size: int, nan_rows: dict) -> torch.Tensor:
    """Seeded [batch_size, VOCAB] logits; ``nan_rows`` maps row -> number of leading NaN columns
    starting at NAN_COL. The NaN column holds the row maximum before it is poisoned."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch_size, VOCAB, generator=g)
    logits[:, NAN_COL] = 10.0
    for row, n in nan_rows.items():
        logits[row, NAN_COL : NAN_COL + n] = NAN
    return logits


def _sample(sampler, logits, *, greedy: bool):
    info = make_sampling_info(logits.shape[0], VOCAB, greedy=greedy)
    positions = torch.zeros(logits.shape[0], dtype=torch.int64)
    return sampler(LogitsProcessorOutput(next_token_logits=logits), info, False, [], [], positions)


def _runner_sample(sampler, logits, *, greedy: bool, rids=RIDS):
    """Sample through SGLang's real ModelRunner.sample, which carries the batch's rids."""
    runner = make_model_runner(sampler)
    forward_batch = make_forward_batch(make_sampling_info(len(rids), VOCAB, greedy=greedy), rids)
    return ModelRunner.sample(runner, LogitsProcessorOutput(next_token_logits=logits), forward_batch)


# ---------------------------------------------------------------- SGLang without the plugin


def test_without_plugin_greedy_emits_the_nan_column(sampler):
    logits = _logits(3, {1: 1})
    out = _sample(sampler, logits, greedy=True)
    # torch.argmax ranks NaN above every number: the corrupted row emits the NaN column.
    assert out.tolist() == [NAN_COL, NAN_COL, NAN_COL]
    assert torch.isnan(logits[1]).any()


def test_without_plugin_multinomial_errors_on_nan(sampler, monkeypatch):
    monkeypatch.setenv("SGLANG_OPT_USE_GUMBEL_SAMPLE", "0")
    with pytest.raises(RuntimeError, match="probability tensor"):
        _sample(sampler, _logits(3, {1: 1}), greedy=False)


# ---------------------------------------------------------------- sanitize


@pytest.mark.parametrize("greedy", [True, False])
def test_sanitize_policy_sampler_never_emits_nan_column(sampler, monkeypatch, greedy):
    monkeypatch.setenv("SGLANG_OPT_USE_GUMBEL_SAMPLE", "0")  # multinomial: errors on NaN
    batch = 64
    logits = _logits(batch, {r: 1 for r in range(0, batch, 2)})
    clean = logits.clone()
    with applied_plugin("sanitize"):
        out = _sample(sampler, logits, greedy=greedy)
    poisoned = out[0::2]
    assert bool((poisoned != NAN_COL).all()), "a sanitized NaN column must carry no probability"
    assert bool(((out >= 0) & (out < VOCAB)).all())
    if greedy:
        expected = clean.nan_to_num(nan=-1e30).argmax(-1)
        assert out.tolist() == expected.tolist()


def test_sanitize_policy_leaves_finite_rows_bit_identical(sampler):
    logits = _logits(3, {1: 2})
    clean = logits.clone()
    with applied_plugin("sanitize"):
        state = sglang_plugin.register("sanitize")  # second call in one process: no-op
        _sample(sampler, logits, greedy=True)
    assert state is None
    assert torch.equal(logits[[0, 2]], clean[[0, 2]])
    assert torch.equal(logits[1, NAN_COL : NAN_COL + 2], torch.full((2,), -1e30))


# ---------------------------------------------------------------- raise


def test_raise_policy_names_sglang_rids(sampler):
    logits = _logits(3, {1: 3})
    with applied_plugin("raise"), pytest.raises(NanLogitsError) as info:
        _runner_sample(sampler, logits, greedy=True)
    assert info.value.nan_counts == {"req-b": 3}
    assert "req-b" in str(info.value) and "req-a" not in str(info.value)


def test_raise_policy_without_rids_names_rows(sampler):
    with applied_plugin("raise"), pytest.raises(NanLogitsError) as info:
        _sample(sampler, _logits(3, {2: 1}), greedy=True)
    assert info.value.nan_counts == {"row2": 1}


def test_raise_policy_is_silent_on_finite_logits(sampler):
    with applied_plugin("raise"):
        out = _runner_sample(sampler, _logits(3, {}), greedy=True)
    assert out.tolist() == [NAN_COL] * 3


# ---------------------------------------------------------------- abort and guard (sampler site)


def _dead_and_partial_logits():
    """req-a: partial NaN (one column); req-b: a dead row (all NaN); req-c: clean."""
    logits = _logits(3, {0: 1, 1: VOCAB - NAN_COL})
    logits[1, :NAN_COL] = NAN
    return logits


@pytest.mark.parametrize("policy, aborted", [("abort", {"req-a", "req-b"}), ("guard", {"req-b"})])
def test_abort_and_guard_finish_only_the_triggering_requests(sampler, policy, aborted):
    reqs = [make_req(rid) for rid in RIDS]
    logits = _dead_and_partial_logits()
    with applied_plugin(policy):
        out, _ = decode_step(sampler, logits, reqs)
    assert torch.isfinite(logits).all()
    assert bool(((out >= 0) & (out < VOCAB)).all())
    for req in reqs:
        if req.rid in aborted:
            assert isinstance(req.finished_reason, FINISH_ABORT), req.rid
            reason = req.finished_reason.to_json()
            assert reason["status_code"] == 500 and reason["err_type"] == "NanLogitsError"
            assert req.rid in reason["message"] and f"policy '{policy}'" in reason["message"]
            assert req.skip_radix_cache_insert
            assert list(req.output_ids_through_stop) == []  # the corrupted step's token is never streamed
        else:
            assert not req.finished() and not req.skip_radix_cache_insert, req.rid
    if policy == "guard":
        assert out[0].item() != NAN_COL  # req-a: partial NaN sanitized, the NaN column never emitted


def test_guard_is_the_default_and_names_dead_rows(sampler, caplog):
    reqs = [make_req(rid) for rid in RIDS]
    with applied_plugin(None) as state, caplog.at_level(logging.WARNING, logger=sglang_plugin.__name__):
        assert state.policy is NanPolicy.GUARD
        decode_step(sampler, _dead_and_partial_logits(), reqs)
    message = reqs[1].finished_reason.to_json()["message"]
    assert "req-b" in message and "1 dead logit rows" in message and "policy 'guard'" in message
    # req-a's partial NaN is sanitized and warned about once, naming the request.
    assert [r.getMessage() for r in caplog.records if "sanitized" in r.getMessage()] != []
    assert "req-a (1 NaN)" in caplog.text


def test_counts_of_one_step_never_reach_the_next(sampler):
    reqs = [make_req(rid) for rid in RIDS]
    with applied_plugin("guard"):
        decode_step(sampler, _dead_and_partial_logits(), reqs)
        more = [make_req(rid) for rid in ("req-d", "req-b2", "req-e")]
        decode_step(sampler, _logits(3, {}), more)  # clean step: no abort carried over
    assert not any(req.finished() for req in more)


@pytest.mark.parametrize("policy", [None, "sanitize", "abort", "guard"])
def test_abort_and_guard_add_no_host_sync(sampler, monkeypatch, policy):
    """Count host reads over a whole step (sample, copy, result processing), against SGLang alone.

    abort/guard read only SGLang's own host copy, after the one wait SGLang makes anyway."""
    reads = HostReads().install(monkeypatch)
    reqs = [make_req(rid) for rid in RIDS]
    if policy is None:
        with restoring_hook_targets():  # SGLang without the plugin: its own reads
            HookRegistry.apply_hooks()
            runner = make_model_runner(sampler)
            fb = make_forward_batch(make_sampling_info(3, VOCAB, greedy=True), RIDS)
            lo = LogitsProcessorOutput(next_token_logits=_logits(3, {}))
            result = GenerationBatchResult(logits_output=lo, next_token_ids=ModelRunner.sample(runner, lo, fb),
                                           copy_done=CopyDone())
            result.copy_to_cpu(return_logprob=False)
            process_like_sglang(None, types.SimpleNamespace(reqs=reqs), result)
            waits = result.copy_done.waits
    else:
        with applied_plugin(policy):
            _, copy_done = decode_step(sampler, _dead_and_partial_logits(), reqs)
            waits = copy_done.waits
    assert reads.device == [], f"host syncs: {reads.device}"
    assert waits == 1
    # SGLang reads its copied token ids once; abort/guard read their copied counts once more.
    assert reads.copied == ["tolist"] * (2 if policy in ("abort", "guard") else 1)


class _AllReduceSpy:
    """Counts ``torch.distributed.all_reduce`` calls (and pretends a group of two ranks, or one)."""

    def __init__(self, monkeypatch, world_size):
        import torch.distributed as dist

        self.calls = []
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
        monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None, **_: self.calls.append(group))


def _cuda_watermark_force(logits, *args, **kwargs):
    """What SGLang's CUDA watermark selector (``textseal_selector``) leaves of a row holding NaN: it has
    no NaN gate, so the row becomes -inf everywhere but 0 at the selected token. Finite rows: unchanged."""
    rows = torch.isnan(logits).any(-1)
    logits[rows] = -float("inf")
    logits[rows, 0] = 0.0


def _watermark_logprob_step(sampler, logits, reqs, force=lambda logits, *a, **k: logits.add_(0.5)):
    """``ModelRunner.sample`` with a watermark and ``return_logprob``: SGLang's ``Sampler.forward``
    then preprocesses two tensors (the watermarked logits, then the pre-watermark ones for logprobs)."""
    runner = make_model_runner(sampler)
    runner.watermark_state = types.SimpleNamespace(init_from_prompt=lambda *a, **k: None, force=force,
                                                   append=lambda *a, **k: None)
    rids = [req.rid for req in reqs]
    info = make_sampling_info(len(rids), VOCAB, greedy=True)
    info.has_watermark_candidates = True
    forward_batch = make_forward_batch(info, rids)
    forward_batch.return_logprob = True
    forward_batch.top_logprobs_nums = [0] * len(rids)
    forward_batch.token_ids_logprobs = [None] * len(rids)
    forward_batch.req_pool_indices = torch.arange(len(rids))
    forward_batch.watermark_prompt_tail_ids = forward_batch.watermark_context_hash_history = None
    logits_output = LogitsProcessorOutput(next_token_logits=logits)
    next_token_ids = ModelRunner.sample(runner, logits_output, forward_batch)
    result = GenerationBatchResult(logits_output=logits_output, next_token_ids=next_token_ids, copy_done=CopyDone())
    result.copy_to_cpu(return_logprob=False)
    registered_hook(sglang_plugin.RESULT_TARGET)(process_like_sglang, None, types.SimpleNamespace(reqs=reqs), result)
    return logits_output


@pytest.mark.parametrize("policy", ["guard", "abort", "raise"])
def test_sampler_counts_once_per_call_with_watermark_and_logprobs(sampler, monkeypatch, policy):
    """Two ``_preprocess_logits`` calls in one ``Sampler.forward``: one count, one all-reduce."""
    sampler.tp_sync_group = "tp-group"  # two ranks (the spy): the reduction is issued
    spy = _AllReduceSpy(monkeypatch, world_size=2)
    calls = []
    original = Sampler._preprocess_logits

    def preprocess(self, logits, sampling_info):
        calls.append(logits.data_ptr())
        return original(self, logits, sampling_info)

    monkeypatch.setattr(Sampler, "_preprocess_logits", preprocess)  # SGLang's own, below the hook
    reqs = [make_req(rid) for rid in RIDS]
    with applied_plugin(policy):
        if policy == "raise":  # clean logits: both tensors are preprocessed, nothing raises
            _watermark_logprob_step(sampler, _logits(3, {}), reqs)
            assert len(calls) == 2 and spy.calls == ["tp-group"]
            return
        logits_output = _watermark_logprob_step(sampler, _dead_and_partial_logits(), reqs)
    assert len(calls) == 2 and calls[0] != calls[1], "SGLang preprocessed both tensors"
    assert spy.calls == ["tp-group"], "one all-reduce per sampler call"
    assert torch.isfinite(logits_output.next_token_logprobs).all()  # the logprob tensor was sanitized too
    aborted = {req.rid for req in reqs if isinstance(req.finished_reason, FINISH_ABORT)}
    assert aborted == ({"req-a", "req-b"} if policy == "abort" else {"req-b"})


@pytest.mark.parametrize("policy, aborted", [("guard", {"req-b"}), ("abort", {"req-a", "req-b"})])
def test_watermark_cannot_hide_nan_from_the_policy(sampler, policy, aborted):
    """The watermark rewrites a NaN row into a finite one (CUDA); the policy decides on the logits before it."""
    reqs = [make_req(rid) for rid in RIDS]
    with applied_plugin(policy):
        logits_output = _watermark_logprob_step(sampler, _dead_and_partial_logits(), reqs, force=_cuda_watermark_force)
    assert {req.rid for req in reqs if isinstance(req.finished_reason, FINISH_ABORT)} == aborted
    assert all(req.skip_radix_cache_insert == (req.rid in aborted) for req in reqs)
    assert torch.isfinite(logits_output.next_token_logprobs).all()


def test_inf_on_one_rank_only_aborts_the_request_on_every_rank(sampler, monkeypatch):
    """+Inf off the argmax on this rank only moves this rank's token; the other rank (simulated: its
    counts are 0) would emit another one. The ranks disagree, so the request ends, under guard too."""
    import torch.distributed as dist

    sampler.tp_sync_group = "tp-group"
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: tensor.clamp_(min=0))  # MAX with 0s
    reqs = [make_req(rid) for rid in RIDS]
    logits = _logits(3, {})
    logits[2, 0] = float("inf")  # req-c: argmax NAN_COL on the other rank, column 0 here
    with applied_plugin("guard"):
        out, _ = decode_step(sampler, logits, reqs)
    assert out.tolist() == [NAN_COL, NAN_COL, 0]
    assert [req.rid for req in reqs if req.finished()] == ["req-c"]
    message = reqs[2].finished_reason.message
    assert "the ranks disagree" in message and "0-1 +-Inf logits" in message


def test_client_abort_in_the_same_step_as_a_nan_still_skips_the_radix_insert(sampler):
    reqs = [make_req(rid) for rid in RIDS]
    reqs[1].to_finish = FINISH_ABORT("client went away")  # what SGLang's abort_request sets
    with applied_plugin("guard"):
        decode_step(sampler, _dead_and_partial_logits(), reqs)
    assert reqs[1].finished_reason.message == "client went away"  # the client's reason is kept
    assert reqs[1].skip_radix_cache_insert  # but the NaN step's KV stays out of the tree
    assert list(reqs[1].output_ids_through_stop) == []


@pytest.mark.parametrize("site", ["sampler", "verify"])
def test_one_rank_issues_no_collective_and_adds_no_host_sync(sampler, monkeypatch, site):
    """Single process: the plugin issues no collective and reads nothing on the host (counted)."""
    import torch.distributed as dist

    issued = []
    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "monitored_barrier"):
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: issued.append(_name))
    reads = HostReads().install(monkeypatch)
    reqs = [make_req(rid) for rid in RIDS]
    if site == "sampler":
        with applied_plugin("guard"):
            decode_step(sampler, _dead_and_partial_logits(), reqs)
            from sglang.srt.runtime_context import get_parallel

            with get_parallel().override(world_group=types.SimpleNamespace(cpu_group=None), pp_size=1):
                registered_hook(sglang_plugin.RANKS_TARGET)(None, object())  # the start-up check: one rank, nothing
        assert [r.rid for r in reqs if r.finished()] == ["req-b"]
    else:
        reqs = _verify_step("guard", {3: 1}, dead_rows=(8,))[0]
        assert [r.rid for r in reqs if r.finished()] == ["req-c"]
    assert issued == []
    assert reads.device == [], f"host syncs: {reads.device}"


def test_raise_keeps_its_one_host_sync(sampler, monkeypatch):
    reads = HostReads().install(monkeypatch)
    with applied_plugin("raise"), pytest.raises(NanLogitsError):
        _runner_sample(sampler, _logits(3, {1: 1}), greedy=True)
    assert reads.device == ["tolist"]


# ---------------------------------------------------------------- verify site (hook boundary)

DRAFT_TOKEN_NUM = 4


def _verify_batch(reqs):
    return types.SimpleNamespace(reqs=reqs, forward_mode=types.SimpleNamespace(is_idle=lambda: False),
                                 sampling_info=make_sampling_info(len(reqs), VOCAB, greedy=True))


def _verify_step(policy, nan_rows, *, dead_rows=(), draft_probs=None, eagle_sample=None):
    """One verify step: the registered verify hook around ``eagle_sample`` (default: a recorder),
    then SGLang's result copy and result processing. Returns (reqs, seen logits, eagle_sample's result)."""
    reqs = [make_req(rid) for rid in RIDS]
    batch = _verify_batch(reqs)
    verify_input = types.SimpleNamespace(draft_token_num=DRAFT_TOKEN_NUM, draft_probs=draft_probs)
    logits = _logits(len(reqs) * DRAFT_TOKEN_NUM, nan_rows)
    for row in dead_rows:
        logits[row] = NAN
    seen = {}

    def record(verify_input, batch, logits_output, grammar_mask=None, **kwargs):
        seen["logits"] = logits_output.next_token_logits.clone()
        return "sampled"

    with applied_plugin(policy):
        logits_output = LogitsProcessorOutput(next_token_logits=logits)
        out = registered_hook(sglang_plugin.VERIFY_TARGET)(eagle_sample or record, verify_input, batch, logits_output, None)
        result = GenerationBatchResult(logits_output=logits_output, next_token_ids=torch.zeros(len(reqs), dtype=torch.int64),
                                       copy_done=CopyDone())
        result.copy_to_cpu(return_logprob=False)
        registered_hook(sglang_plugin.RESULT_TARGET)(process_like_sglang, None, batch, result)
    return reqs, seen, out


@pytest.mark.parametrize("policy", ["sanitize", "abort", "guard"])
def test_verify_hook_hands_finite_logits_to_eagle_sample(policy):
    reqs, seen, result = _verify_step(policy, {5: 1, 6: 2})
    assert result == "sampled"
    assert torch.isfinite(seen["logits"]).all()
    aborted = [req.rid for req in reqs if isinstance(req.finished_reason, FINISH_ABORT)]
    assert aborted == (["req-b"] if policy == "abort" else [])


def test_verify_abort_counts_rows_per_request():
    # Rows 0-3 are req-a, 4-7 req-b, 8-11 req-c: NaN in the last row of a and the first of c.
    a, b, c = _verify_step("abort", {3: 1, 8: 2})[0]
    assert a.skip_radix_cache_insert and c.skip_radix_cache_insert and not b.skip_radix_cache_insert
    assert "1 NaN" in a.finished_reason.message and "2 NaN" in c.finished_reason.message
    assert not b.finished()


def test_verify_guard_aborts_only_dead_rows():
    # req-a: partial NaN in its last row; req-c: its first tree node's row is dead.
    a, b, c = _verify_step("guard", {3: 1}, dead_rows=(8,))[0]
    assert isinstance(c.finished_reason, FINISH_ABORT) and c.skip_radix_cache_insert
    assert "1 dead logit rows" in c.finished_reason.message and "verify" in c.finished_reason.message
    assert not a.finished() and not b.finished()


def test_verify_hook_raise_names_rids():
    with pytest.raises(NanLogitsError) as info:
        _verify_step("raise", {4: 1, 11: 3})
    assert info.value.nan_counts == {"req-b": 1, "req-c": 3}


def test_verify_abort_and_guard_add_no_host_sync(monkeypatch):
    reads = HostReads().install(monkeypatch)
    draft_probs = torch.softmax(torch.randn(len(RIDS), DRAFT_TOKEN_NUM - 1, VOCAB), -1)
    draft_probs[0, 1, 2] = NAN
    with _rejection_sampling():
        for policy in ("abort", "guard"):
            _verify_step(policy, {3: 1}, dead_rows=(8,), draft_probs=draft_probs.clone())
    assert reads.device == [], f"host syncs: {reads.device}"
    # Per step: SGLang's read of its copied token ids, and the plugin's read of its copied counts.
    assert reads.copied == ["tolist", "tolist"] * 2


# ---------------------------------------------------------------- draft side


def _rejection_sampling():
    """Server args with ``--speculative-use-rejection-sampling``: ``eagle_sample`` reads the draft probs."""
    from sglang.srt.runtime_context import get_context

    return get_context().override_server_args(speculative_use_rejection_sampling=True, device="cpu")


def _chain_inputs(bs, num_steps, g):
    """Inputs of SGLang's chain rejection sampling, chains of ``num_steps`` drafts per request."""
    num_slots = num_steps + 1
    target_probs = torch.softmax(2 * torch.randn(bs, num_slots, VOCAB, generator=g), -1)
    draft_probs = torch.softmax(2 * torch.randn(bs, num_steps, VOCAB, generator=g), -1)
    candidates = torch.cat(
        [torch.zeros(bs, 1, dtype=torch.int64), torch.multinomial(draft_probs.view(-1, VOCAB), 1, generator=g).view(bs, -1)], 1
    )
    coins = torch.rand(bs, num_slots, generator=g, dtype=torch.float64).float()
    final_coins = torch.rand(bs, generator=g, dtype=torch.float64).float()
    return target_probs, draft_probs, candidates, coins, final_coins


def _run_chain_kernel(target_probs, draft_probs, candidates, coins, final_coins, *, block_verification):
    """SGLang's real ``chain_speculative_sampling_triton`` as ``eagle_sample`` calls it; returns
    (predicts [bs * num_slots], accepted [bs])."""
    from sglang.kernels.ops.speculative.reject_sampling import chain_speculative_sampling_triton

    bs, num_slots = candidates.shape
    predicts = torch.full((bs * num_slots,), -1, dtype=torch.int32)
    accept_index = torch.full((bs, num_slots), -1, dtype=torch.int32)
    accepted = torch.zeros(bs, dtype=torch.int32)
    retrieve_index = torch.arange(bs * num_slots).view(bs, num_slots)
    chain_speculative_sampling_triton(
        predicts, accept_index, accepted, candidates, retrieve_index, None, None, coins, final_coins,
        target_probs, draft_probs, 1.0, 1.0, True, block_verification=block_verification,
    )
    return predicts, accepted


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="SGLang's Triton kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("block_verification", [False, True])
def test_draft_probs_reaching_rejection_sampling_are_cleaned(block_verification):
    """The verify hook cleans ``verify_input.draft_probs`` in place before SGLang's kernel reads them.

    Poisoned draft rows (NaN, +Inf, negative entries; one all-NaN row) must give exactly what
    the kernel gives on them with the poisoned rows cleaned (the others keep their bits). With block verification (which forces
    rejection sampling on) the raw ones change the result: the kernel's residual mass reads
    them unguarded. The classic kernel guards each q itself, so there only equality is checked."""
    from samplers.nan import clean_probs

    g = torch.Generator().manual_seed(7)
    bs, num_steps = 48, 3
    target_probs, draft_probs, candidates, coins, final_coins = _chain_inputs(bs, num_steps, g)
    # Rows 1 and 2 are the ones block verification's residual mass reads.
    draft_probs[0::3, 1:, 3] = NAN
    draft_probs[1::3, 1:, 5] = -0.5
    draft_probs[2::3, 1:, 0] = float("inf")
    draft_probs[3, 1] = NAN  # a row with no mass left: all its drafts are rejected
    raw = draft_probs.clone()
    storage = draft_probs.data_ptr()
    clean, bad = clean_probs(raw, zero_rows="zero")
    expected = _run_chain_kernel(target_probs, torch.where(bad.unsqueeze(-1), clean, raw), candidates, coins,
                                 final_coins, block_verification=block_verification)
    unsanitized = _run_chain_kernel(target_probs, raw.clone(), candidates, coins, final_coins,
                                    block_verification=block_verification)

    def eagle_sample(verify_input, batch, logits_output, grammar_mask=None, **kwargs):
        return _run_chain_kernel(target_probs, verify_input.draft_probs, candidates, coins, final_coins,
                                 block_verification=block_verification)

    reqs = [make_req(f"r{i}") for i in range(bs)]
    verify_input = types.SimpleNamespace(draft_token_num=num_steps + 1, draft_probs=draft_probs)
    logits_output = LogitsProcessorOutput(next_token_logits=torch.zeros(bs * (num_steps + 1), VOCAB))
    with applied_plugin("guard"), _rejection_sampling():
        got = registered_hook(sglang_plugin.VERIFY_TARGET)(eagle_sample, verify_input, _verify_batch(reqs), logits_output)
    assert verify_input.draft_probs.data_ptr() == storage  # cleaned in place
    assert torch.isfinite(draft_probs).all() and bool((draft_probs >= 0).all())
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    changed = not (torch.equal(unsanitized[0], expected[0]) and torch.equal(unsanitized[1], expected[1]))
    assert changed == block_verification, "the poisoned inputs must change SGLang's block-verification result"


def test_verify_hook_is_applied_where_eagle_verify_calls_it():
    from sglang.srt.speculative import eagle_utils, eagle_worker_common

    original = eagle_utils.eagle_sample
    with applied_plugin("abort"):
        assert eagle_utils.eagle_sample.__wrapped__ is original
        # run_eagle_verify calls its own `from eagle_utils import eagle_sample` copy.
        assert eagle_worker_common.eagle_sample is eagle_utils.eagle_sample
    assert eagle_worker_common.eagle_sample is original


# ---------------------------------------------------------------- registration and refusal


@pytest.mark.parametrize("target", ["HOOK_TARGETS", "REQUIRED_SYMBOLS"])
def test_missing_symbol_refuses_and_applies_only_the_start_up_check(monkeypatch, target):
    if target == "HOOK_TARGETS":
        from sglang.srt.speculative import eagle_utils

        monkeypatch.delattr(eagle_utils, "eagle_sample")
        expected = sglang_plugin.VERIFY_TARGET
    else:
        from sglang.srt.mem_cache import common

        monkeypatch.setattr(common, "release_kv_cache", lambda req, tree_cache, *, checkpoint: None)
        expected = "release_kv_cache no longer reads .skip_radix_cache_insert"
    sampler_fn = Sampler.__dict__["_preprocess_logits"]
    with restoring_hook_targets():
        with pytest.raises(sglang_plugin.SGLangPluginError, match="no NaN policy applied") as info:
            sglang_plugin.register("abort")
        HookRegistry.apply_hooks()
        assert expected in str(info.value)
        # The rank still reports to the start-up check, naming why it refused.
        assert set(HookRegistry._hooks) == {sglang_plugin.RANKS_TARGET}
        assert Sampler.__dict__["_preprocess_logits"] is sampler_fn
        seen = {}
        monkeypatch.setattr(sglang_plugin, "check_ranks_agree", lambda config, group: seen.update(config))
        from sglang.srt.runtime_context import get_parallel

        with get_parallel().override(world_group=types.SimpleNamespace(cpu_group="world"), pp_size=2):
            registered_hook(sglang_plugin.RANKS_TARGET)(None, object())
    assert seen["policy"].startswith("refused: missing ") and expected in seen["policy"]


def test_off_policy_registers_only_the_start_up_check_and_env_selects_policy(monkeypatch):
    with restoring_hook_targets():
        state = sglang_plugin.register("off")
        assert state.policy is NanPolicy.OFF
        assert set(HookRegistry._hooks) == {sglang_plugin.RANKS_TARGET}  # reports policy=off to the other ranks
        assert sglang_plugin.rank_config(state)["policy"] == "off"
    monkeypatch.setenv("SAFESPEC_NAN_POLICY", "raise")
    with restoring_hook_targets():
        state = sglang_plugin.register()
        assert state.policy is NanPolicy.RAISE
        assert set(HookRegistry._hooks) == set(sglang_plugin.HOOK_TARGETS)


@pytest.mark.parametrize("allow_list, applied", [("safespec", True), ("other_plugin", False), ("", True)])
def test_load_plugins_honours_sglang_plugins_allow_list(monkeypatch, allow_list, applied):
    import sglang.srt.plugins as plugins

    entry = importlib.metadata.EntryPoint(
        name="safespec", value="spec_decode.integrations.sglang_plugin:register", group=plugins.GENERAL_PLUGINS_GROUP
    )
    monkeypatch.setattr(plugins, "entry_points", lambda group: [entry] if group == entry.group else [])
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", allow_list)
    with restoring_hook_targets():
        plugins.load_plugins()
        wrapped = hasattr(Sampler.__dict__["_preprocess_logits"], "__wrapped__")
    assert wrapped is applied


def test_pyproject_declares_entry_point_and_extra():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert project["entry-points"]["sglang.srt.plugins"]["safespec"] == "spec_decode.integrations.sglang_plugin:register"
    assert any(dep.startswith("sglang") for dep in project["optional-dependencies"]["sglang"])


# ---------------------------------------------------------------- startup line and coverage warning


@pytest.mark.parametrize("algorithm, warns", [(None, False), ("EAGLE", False), ("NEXTN", False), ("dflash", True),
                                              ("DSPARK", True), ("UNO", True)])
def test_announce_logs_policy_once_and_warns_on_uncovered_algorithm(caplog, algorithm, warns):
    from sglang.srt.managers import scheduler

    server_args = types.SimpleNamespace(speculative_algorithm=algorithm)
    with applied_plugin("abort"), caplog.at_level(logging.INFO, logger=sglang_plugin.__name__):
        # The hook runs after SGLang's own configure_scheduler_process (which configures logging).
        assert scheduler.configure_scheduler_process.__wrapped__ is not None
        hook = registered_hook(sglang_plugin.ANNOUNCE_TARGET)
        hook(None, server_args, 0)
        hook(None, server_args, 0)  # a second call in the same process logs nothing
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert sum("safespec SGLang plugin: NaN policy 'abort'" in line for line in infos) == 1
    warnings_ = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings_) == (1 if warns else 0)
    if warns:
        assert algorithm.upper() in warnings_[0].getMessage() and "docs/sglang.md" in warnings_[0].getMessage()


def test_hook_types_match_sglang_signatures():
    from sglang.srt.plugins.hook_registry import HookType

    types_ = sglang_plugin.hook_types()
    assert set(types_) == set(sglang_plugin.HOOK_TARGETS)
    assert types_[sglang_plugin.FINISH_TARGET] is HookType.BEFORE
    assert types_[sglang_plugin.ANNOUNCE_TARGET] is HookType.AFTER


# ---------------------------------------------------------------- verify decides after SGLang's biases


def _real_verify_step(policy, verify_input, batch, logits_output):
    """SGLang's real ``eagle_sample`` (greedy, CPU) under the plugin, then its result copy and processing;
    returns the target argmax it computed, [bs, draft_token_num]."""
    from sglang.srt.speculative import eagle_utils

    with eagle_sample_on_cpu(rejection_sampling=False) as seen, applied_plugin(policy):
        eagle_utils.eagle_sample(verify_input, batch, logits_output, None)
        result = GenerationBatchResult(logits_output=logits_output, copy_done=CopyDone(),
                                       next_token_ids=torch.zeros(len(batch.reqs), dtype=torch.int64))
        result.copy_to_cpu(return_logprob=False)
        registered_hook(sglang_plugin.RESULT_TARGET)(process_like_sglang, None, batch, result)
    return seen["target_predict"]


@pytest.mark.parametrize("policy, columns, aborted", [("guard", 1, []), ("abort", 1, ["r1"]), ("guard", VOCAB, ["r1"])])
def test_verify_decides_after_logit_bias_as_the_sampler_does(sampler, policy, columns, aborted):
    """A NaN ``logit_bias`` (one column, or every column: a dead row) for r1 at verify, and the same at
    the sampler: each path sanitizes or aborts r1 alike, and the NaN column is never the target argmax."""
    verify_input, batch, logits_output = eagle_verify_case(3, DRAFT_TOKEN_NUM, VOCAB)
    batch.sampling_info.logit_bias[1, NAN_COL:NAN_COL + 1 if columns == 1 else None] = NAN
    batch.sampling_info.logit_bias[1, :0 if columns == 1 else None] = NAN
    target_predict = _real_verify_step(policy, verify_input, batch, logits_output)
    assert [req.rid for req in batch.reqs if isinstance(req.finished_reason, FINISH_ABORT)] == aborted
    assert columns == VOCAB or not bool((target_predict[1] == NAN_COL).any())

    reqs = [make_req(f"r{i}") for i in range(3)]
    info = make_sampling_info(3, VOCAB, greedy=True)
    info.logit_bias = batch.sampling_info.logit_bias
    runner = make_model_runner(sampler)
    logits_output = LogitsProcessorOutput(next_token_logits=_logits(3, {}))
    with applied_plugin(policy):
        ids = ModelRunner.sample(runner, logits_output, make_forward_batch(info, [r.rid for r in reqs]))
        result = GenerationBatchResult(logits_output=logits_output, next_token_ids=ids, copy_done=CopyDone())
        result.copy_to_cpu(return_logprob=False)
        registered_hook(sglang_plugin.RESULT_TARGET)(process_like_sglang, None, types.SimpleNamespace(reqs=reqs), result)
    assert [req.rid for req in reqs if isinstance(req.finished_reason, FINISH_ABORT)] == aborted


# ---------------------------------------------------------------- refused paths


@pytest.mark.parametrize("policy", ["sanitize", "guard", "abort", "raise"])
def test_beam_search_requests_are_refused_with_the_plugins_message(policy):
    """SGLang's ``BeamCoordinator.validate_and_init`` returns the plugin's error: SGLang answers 400."""
    from sglang.srt.beam_search.coordinator import BeamCoordinator

    coordinator = types.SimpleNamespace(spec_algorithm=types.SimpleNamespace(is_none=lambda: False))
    req = make_req("beam")
    with applied_plugin(policy):
        error = BeamCoordinator.validate_and_init(coordinator, req, types.SimpleNamespace())
    assert error is not None and "safespec NaN policy" in error and "Beam search" in error
    with applied_plugin("off"):  # off: SGLang's own checks
        assert "safespec" not in BeamCoordinator.validate_and_init(coordinator, req, types.SimpleNamespace())


def _start(policy, mode):
    """The plugin's start-up check (the ranks hook) on one rank, for a server in PD ``mode``."""
    from sglang.srt.runtime_context import get_parallel

    scheduler = types.SimpleNamespace(server_args=types.SimpleNamespace(disaggregation_mode=mode))
    with applied_plugin(policy), get_parallel().override(world_group=types.SimpleNamespace(cpu_group=None), pp_size=1):
        registered_hook(sglang_plugin.RANKS_TARGET)(None, scheduler)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("policy, refused", [("guard", True), ("abort", True), ("sanitize", False), ("raise", False),
                                             ("off", False)])
def test_pd_disaggregation_is_refused_at_start_up_under_guard_and_abort(policy, refused, mode):
    _start(policy, "null")
    if not refused:
        _start(policy, mode)
        return
    with pytest.raises(sglang_plugin.SGLangPluginError, match=f"--disaggregation-mode {mode}") as info:
        _start(policy, mode)
    assert f"'{policy}'" in str(info.value) and "SAFESPEC_NAN_POLICY=sanitize or off" in str(info.value)


def test_bad_policy_fails_the_start_naming_the_variable_and_the_allowed_values(monkeypatch):
    from sglang.srt.runtime_context import get_parallel

    monkeypatch.setenv("SAFESPEC_NAN_POLICY", "gaurd")
    with restoring_hook_targets():
        with pytest.raises(sglang_plugin.SGLangPluginError) as info:
            sglang_plugin.register()
        assert set(HookRegistry._hooks) == {sglang_plugin.RANKS_TARGET}  # the rank still reports, and fails
        with get_parallel().override(world_group=types.SimpleNamespace(cpu_group=None), pp_size=1):
            with pytest.raises(sglang_plugin.SGLangPluginError) as at_start:
                registered_hook(sglang_plugin.RANKS_TARGET)(None, object())
    for message in (str(info.value), str(at_start.value)):
        assert "SAFESPEC_NAN_POLICY" in message and "'gaurd'" in message
        assert all(f"'{p.value}'" in message for p in NanPolicy), message
