"""The SGLang plugin against SGLang's real Sampler, ModelRunner.sample, Req and HookRegistry, on CPU.

Needs sglang (``make test-sglang``); skipped with "sglang not installed" otherwise.
SGLang's verify kernels cannot run on CPU, so the EAGLE verify site is tested at the
hook boundary: the hook is called with a recording stand-in for ``eagle_sample``.
"""

from __future__ import annotations

import importlib.metadata
import types
from pathlib import Path

import pytest
import torch

from _sglang_harness import import_sglang

_SKIP_REASON = import_sglang()
pytestmark = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")

if _SKIP_REASON is None:
    from _sglang_harness import (
        applied_plugin,
        make_forward_batch,
        make_model_runner,
        make_req,
        make_sampling_info,
        restoring_hook_targets,
        sglang_cpu_context,
    )
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.layers.sampler import Sampler
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.plugins.hook_registry import HookRegistry

    from numerics import NanLogitsError, NanPolicy
    from spec_decode import sglang_plugin

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


# ---------------------------------------------------------------- abort (sampler site)


def test_abort_policy_sampler_aborts_only_corrupted_request(sampler):
    logits = _logits(3, {1: VOCAB - NAN_COL})  # req-b: NaN from NAN_COL to the end
    reqs = [make_req(rid) for rid in RIDS]
    with applied_plugin("abort") as state:
        out = _runner_sample(sampler, logits, greedy=True)
        assert torch.isfinite(logits).all()
        assert set(state.pending_aborts) == {"req-b"}
        # The scheduler's result processing: append this step's token, check finish.
        for req, token in zip(reqs, out.tolist()):
            req.output_ids.append(token)
            req.update_finish_state()
        assert state.pending_aborts == {}
    a, b, c = reqs
    assert isinstance(b.finished_reason, FINISH_ABORT)
    reason = b.finished_reason.to_json()
    assert reason["status_code"] == 500 and reason["err_type"] == "NanLogitsError"
    assert "req-b" in reason["message"] and "7 NaN" in reason["message"]
    assert b.skip_radix_cache_insert
    for req in (a, c):
        assert not req.finished() and not req.skip_radix_cache_insert


# ---------------------------------------------------------------- verify site (hook boundary)


def _verify_call(policy, nan_rows, draft_token_num=4):
    """Call the verify hook with a recording eagle_sample; returns (reqs, seen logits, result)."""
    state = sglang_plugin.PluginState(policy=NanPolicy(policy), counts_backend="torch")
    hook = sglang_plugin.make_hooks(state)[sglang_plugin.VERIFY_TARGET]
    reqs = [make_req(rid) for rid in RIDS]
    batch = types.SimpleNamespace(reqs=reqs, forward_mode=types.SimpleNamespace(is_idle=lambda: False))
    verify_input = types.SimpleNamespace(draft_token_num=draft_token_num)
    logits = _logits(len(reqs) * draft_token_num, nan_rows)
    seen = {}

    def eagle_sample(verify_input, batch, logits_output, grammar_mask=None, **kwargs):
        seen["logits"] = logits_output.next_token_logits.clone()
        return "sampled"

    result = hook(eagle_sample, verify_input, batch, LogitsProcessorOutput(next_token_logits=logits), None)
    return reqs, seen, result


@pytest.mark.parametrize("policy", ["sanitize", "abort"])
def test_verify_hook_hands_finite_logits_to_eagle_sample(policy):
    reqs, seen, result = _verify_call(policy, {5: 1, 6: 2})
    assert result == "sampled"
    assert torch.isfinite(seen["logits"]).all()
    finished = [req.rid for req in reqs if req.to_finish is not None]
    assert finished == (["req-b"] if policy == "abort" else [])


def test_verify_hook_abort_counts_rows_per_request():
    # Rows 0-3 are req-a, 4-7 req-b, 8-11 req-c: NaN in the last row of a and the first of c.
    reqs, _, _ = _verify_call("abort", {3: 1, 8: 2})
    a, b, c = reqs
    assert a.skip_radix_cache_insert and c.skip_radix_cache_insert and not b.skip_radix_cache_insert
    assert "1 NaN" in a.to_finish.message and "2 NaN" in c.to_finish.message
    assert b.to_finish is None


def test_verify_hook_raise_names_rids():
    with pytest.raises(NanLogitsError) as info:
        _verify_call("raise", {4: 1, 11: 3})
    assert info.value.nan_counts == {"req-b": 1, "req-c": 3}


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
def test_missing_symbol_refuses_and_applies_nothing(monkeypatch, target):
    if target == "HOOK_TARGETS":
        from sglang.srt.speculative import eagle_utils

        monkeypatch.delattr(eagle_utils, "eagle_sample")
        expected = sglang_plugin.VERIFY_TARGET
    else:
        from sglang.srt.mem_cache import common

        monkeypatch.setattr(common, "release_kv_cache", lambda req, tree_cache, *, checkpoint: None)
        expected = "release_kv_cache no longer reads .skip_radix_cache_insert"
    sampler_fn = Sampler.__dict__["_preprocess_logits"]
    HookRegistry.reset()
    with pytest.raises(sglang_plugin.SGLangPluginError, match="nothing applied") as info:
        sglang_plugin.register("abort")
    HookRegistry.apply_hooks()
    assert expected in str(info.value)
    assert dict(HookRegistry._hooks) == {}
    assert Sampler.__dict__["_preprocess_logits"] is sampler_fn


def test_off_policy_registers_nothing_and_env_selects_policy(monkeypatch):
    HookRegistry.reset()
    assert sglang_plugin.register("off") is None
    assert dict(HookRegistry._hooks) == {}
    monkeypatch.setenv("SAFESPEC_NAN_POLICY", "raise")
    with restoring_hook_targets():
        state = sglang_plugin.register()
        assert state.policy is NanPolicy.RAISE
        assert set(HookRegistry._hooks) == set(sglang_plugin.HOOK_TARGETS)


@pytest.mark.parametrize("allow_list, applied", [("safespec", True), ("other_plugin", False), ("", True)])
def test_load_plugins_honours_sglang_plugins_allow_list(monkeypatch, allow_list, applied):
    import sglang.srt.plugins as plugins

    entry = importlib.metadata.EntryPoint(
        name="safespec", value="spec_decode.sglang_plugin:register", group=plugins.GENERAL_PLUGINS_GROUP
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
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert project["entry-points"]["sglang.srt.plugins"]["safespec"] == "spec_decode.sglang_plugin:register"
    assert any(dep.startswith("sglang") for dep in project["optional-dependencies"]["sglang"])
