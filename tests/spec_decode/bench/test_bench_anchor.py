"""The anchor column: llama.cpp's methods (``llama_cpp``, ``llama_cpp_lookup``) in spec-bench.

A stand-in ``llama_cpp`` module (``FakeLlama``), put in ``sys.modules``, continues every context with
known tokens and never stops by itself, as ``Llama.generate`` does; the methods run through the real
harness and the real suite. Without the package, the suite's results say so in one line and an explicit
``--methods llama_cpp`` exits with status 2. One test runs the real package on the real GGUF file.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from spec_decode import fixtures
from spec_decode.bench import main, prompt_sets
from spec_decode.bench.config import ANCHOR_METHODS, METHOD_SPECS, BenchConfig
from spec_decode.bench.harness import run_bench
from tiny_models import make_tiny_target

NUM_PROMPTS, MAX_NEW = 2, 7
LOOKUP_STEP = 3   # tokens FakeLlama emits per verify step when it has a draft model
RUNAWAY = 10_000   # FakeLlama raises past this many tokens: a runner that never stops fails, not hangs


def next_token(context: list[int]) -> int:
    """FakeLlama's continuation of ``context``: a known function of it, never an EOS of anything."""
    return (context[-1] * 7 + len(context)) % 97


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    context = list(prompt)
    for _ in range(n):
        context.append(next_token(context))
    return context[len(prompt):]


class FakeLlama:
    """``llama_cpp.Llama`` as the runner uses it: records how it was made and called; ``generate`` yields
    ``next_token`` forever, one token after the prefill and then ``LOOKUP_STEP`` per draft call."""

    made: list["FakeLlama"] = []

    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, draft_model=None, verbose=True):
        self.kwargs = dict(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads_batch,
                           verbose=verbose)
        self.draft_model = draft_model
        self.calls, self.seeds, self.cached = [], [], 0
        FakeLlama.made.append(self)

    def reset(self):
        self.cached = 0

    def set_seed(self, seed: int):
        self.seeds.append(seed)

    def generate(self, tokens, **sampling):
        self.calls.append({"prompt": list(tokens), "prefix_cached": self.cached, **sampling})
        context = list(tokens)
        self.cached = len(context)
        step = 1   # the prefill's token
        while len(context) - len(tokens) < RUNAWAY:
            for _ in range(step):
                context.append(next_token(context))
                yield context[-1]
            if self.draft_model is not None:
                self.draft_model(np.asarray(context, dtype=np.intc))
                step = LOOKUP_STEP
        raise AssertionError("generate() was never stopped")


class FakeLookup:
    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10):
        self.num_pred_tokens = num_pred_tokens

    def __call__(self, input_ids, /, **kwargs):
        return np.array([], dtype=np.intc)


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    """Install the stand-in ``llama_cpp`` (and ``llama_cpp.llama_speculative``); returns ``FakeLlama``."""
    root = types.ModuleType("llama_cpp")
    root.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None, is_package=True)
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = FakeLookup
    root.Llama, root.llama_speculative = FakeLlama, speculative
    monkeypatch.setitem(sys.modules, "llama_cpp", root)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    monkeypatch.setattr(FakeLlama, "made", [])
    return FakeLlama


@pytest.fixture
def no_llama_cpp(monkeypatch):
    """``import llama_cpp`` fails, and ``find_spec`` says it is absent, whatever is installed."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> types.SimpleNamespace:
    """A tiny target, its prompts (``NUM_PROMPTS`` measured + the warm-up one) and a stand-in GGUF file."""
    root = tmp_path_factory.mktemp("anchor")
    target = make_tiny_target(root)
    prompts = [[(5 * i + j) % 97 for j in range(4 + 3 * i)] for i in range(NUM_PROMPTS + 1)]
    with open(root / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"token_ids": p}) + "\n" for p in prompts)
    gguf = root / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    return types.SimpleNamespace(root=root, target=target, prompts=prompts, file=root / "prompts.jsonl", gguf=gguf)


def _config(tiny, out: Path, **kw) -> BenchConfig:
    base = dict(target=tiny.target, draft_lm=None, eagle=None, eagle3=None, prompts=tiny.file, out=out,
                methods=("ar",) + ANCHOR_METHODS, num_prompts=NUM_PROMPTS, max_new_tokens=MAX_NEW,
                temperatures=(0.0, 1.0), threads=3, nan_rounds=0, progress=False, gguf=tiny.gguf)
    return BenchConfig(**{**base, **kw})


def test_anchor_methods_run_through_the_harness(fake_llama_cpp, tiny, tmp_path):
    results = run_bench(_config(tiny, tmp_path / "out"))
    made = {("lookup" if m.draft_model else "plain"): m for m in fake_llama_cpp.made}
    assert len(fake_llama_cpp.made) == 2 and set(made) == {"plain", "lookup"}   # loaded once each
    for llama in made.values():
        assert llama.kwargs["model_path"] == os.fspath(tiny.gguf) and llama.kwargs["verbose"] is False
        assert llama.kwargs["n_threads"] == llama.kwargs["n_threads_batch"] == 3   # the run's --threads
        drafts = METHOD_SPECS["llama_cpp_lookup"].prompt_lookup_tokens if llama.draft_model else 0
        # a lookup step evaluates its drafts past the last token it keeps: the context holds them too
        assert llama.kwargs["n_ctx"] >= max(map(len, tiny.prompts)) + MAX_NEW + drafts
        # per temperature: warm-up, memory pass (first temperature only), then each measured prompt
        assert [c["prompt"] for c in llama.calls] == ([tiny.prompts[-1]] * 2 + tiny.prompts[:NUM_PROMPTS]
                                                      + [tiny.prompts[-1]] + tiny.prompts[:NUM_PROMPTS])
        assert all(c["prefix_cached"] == 0 for c in llama.calls)   # reset: a full prefill every call
        greedy, sampled = llama.calls[0], llama.calls[-1]
        assert greedy["temp"] == 0 and greedy["top_k"] == 1 and greedy["repeat_penalty"] == 1.0
        assert sampled["temp"] == 1.0 and sampled["top_k"] == 0 and sampled["top_p"] == 1.0
        assert sampled["min_p"] == 0.0 and sampled["repeat_penalty"] == 1.0
        assert len(llama.seeds) == 1 + NUM_PROMPTS   # seeded at T=1 only: the warm-up and each prompt
    assert made["lookup"].draft_model.draft.num_pred_tokens == 10
    methods = results["methods"]
    for key in ANCHOR_METHODS:
        for t in ("0", "1"):
            e = methods[key]["by_temperature"][t]
            assert e["generated_tokens"] == NUM_PROMPTS * MAX_NEW, (key, t)   # EOS never stops it early
            assert e["tokens_per_s"] > 0 and e["speedup_vs_ar"] > 0
        assert results["config"]["method_configs"][key]["exact"] is False
        assert methods[key]["peak_mem_mb"] * 2**20 >= tiny.gguf.stat().st_size   # its weights: the file
    assert methods["llama_cpp"]["mean_accepted_length"] is None
    # the prefill's token, then steps of LOOKUP_STEP, the last one cut at MAX_NEW (7 = 1 + 3 + 3)
    assert methods["llama_cpp_lookup"]["accepted_length_hist"] == {"1": 0, "2": 0, "3": NUM_PROMPTS * 2}


def test_anchor_tokens_are_the_models_and_exactly_max_new_tokens(fake_llama_cpp, tiny):
    from spec_decode.bench.anchor import LlamaCppRunner
    from spec_decode.bench.config import METHOD_SPECS

    for key in ANCHOR_METHODS:
        runner = LlamaCppRunner.load(METHOD_SPECS[key], tiny.gguf, n_ctx=64, threads=1)
        for n in (1, 2, MAX_NEW):
            out = runner.generate(tiny.prompts[:NUM_PROMPTS], n, 0.0, seed=0)
            assert out.tokens == [expected_tokens(p, n) for p in tiny.prompts[:NUM_PROMPTS]], (key, n)
            assert len(out.step_s) == NUM_PROMPTS and out.seconds > 0


def test_a_runner_that_comes_up_short_is_an_error(fake_llama_cpp, tiny, monkeypatch):
    from spec_decode.bench.anchor import LlamaCppRunner
    from spec_decode.bench.config import METHOD_SPECS

    runner = LlamaCppRunner.load(METHOD_SPECS["llama_cpp"], tiny.gguf, n_ctx=64, threads=1)
    monkeypatch.setattr(FakeLlama, "generate", lambda self, tokens, **kw: iter([1, 2]))
    with pytest.raises(RuntimeError, match="generated 2 tokens, expected 5"):
        runner.generate(tiny.prompts[:1], 5, 0.0, seed=0)


@pytest.fixture
def tiny_suite(tiny, monkeypatch):
    """``--suite smollm2`` on the tiny target: its chat set is ``tiny.file``, its GGUF file ``tiny.gguf``."""
    monkeypatch.setattr(fixtures, "smollm2_target_dir", lambda verify=False: tiny.target)
    monkeypatch.setattr(fixtures, "smollm2_gguf_path", lambda: tiny.gguf)
    monkeypatch.setattr(prompt_sets, "smollm2_prompt_file", lambda name: tiny.file)
    return ["--suite", "smollm2", "--prompt-sets", "chat", "--num-prompts", "1", "--max-new-tokens", "4",
            "--temperatures", "0", "--dtype", "fp32", "--no-progress", "--eagle", str(tiny.root / "none"),
            "--eagle3", str(tiny.root / "none")]


def test_suite_runs_the_anchor_by_default_where_it_is_installed(fake_llama_cpp, tiny_suite, tmp_path):
    out = tmp_path / "suite"
    assert main(tiny_suite + ["--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    methods = results["prompt_sets"]["chat"]["methods"]
    assert set(ANCHOR_METHODS) <= set(methods) and "anchor_skipped" not in results
    assert all(methods[k]["generated_tokens"] == 4 for k in ANCHOR_METHODS)
    assert {m.kwargs["n_threads"] for m in fake_llama_cpp.made} == {1}   # the suite's --threads default
    table = (out / "table.md").read_text()
    assert "| chat | fp32 | 0 | llama_cpp |" in table and "| chat | fp32 | 0 | llama_cpp_lookup |" in table


def test_suite_without_the_package_says_so_in_one_line(no_llama_cpp, tiny_suite, tmp_path, capsys):
    out = tmp_path / "suite"
    assert main(tiny_suite + ["--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    text = (out / "results.json").read_text()
    results = json.loads(text)
    assert not set(ANCHOR_METHODS) & set(results["prompt_sets"]["chat"]["methods"])
    note = results["anchor_skipped"]
    assert "pip install '.[anchor]'" in note and "llama_cpp" in note
    assert text.count(json.dumps(note)) == 1 and "llama-cpp-python" not in text.replace(json.dumps(note), "")
    for table in ((out / "table.md").read_text(), captured.out):
        lines = [line for line in table.splitlines() if "llama" in line]
        assert lines == [note], lines


@pytest.mark.parametrize("argv", [["--suite", "smollm2", "--methods", "ar,llama_cpp"],
                                  ["--suite", "smollm2", "--methods", "llama_cpp_lookup"],
                                  ["--methods", "ar,llama_cpp"]], ids=["suite", "suite_lookup", "plain"])
def test_asking_for_the_anchor_without_the_package_exits_2_naming_methods(no_llama_cpp, monkeypatch, tmp_path,
                                                                         capsys, argv):
    def refuse(*args, **kwargs):
        raise AssertionError("work started before the missing package was named")

    monkeypatch.setattr(fixtures, "smollm2_target_dir", refuse)
    monkeypatch.setattr("spec_decode.bench.harness.run_bench", refuse)
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "--methods" in line and "llama-cpp-python" in line, line
    assert "pip install '.[anchor]'" in line and argv[-1].split(",")[-1] in line


def test_plain_spec_bench_skips_the_anchor_where_the_target_is_not_a_gguf_file(fake_llama_cpp, tiny, tmp_path):
    cfg = _config(tiny, tmp_path / "out", gguf=None, temperatures=(0.0,))
    results = run_bench(cfg)
    for key in ANCHOR_METHODS:
        assert "GGUF" in results["methods"][key]["skipped"]
    assert not fake_llama_cpp.made


def test_target_gguf_is_the_source_a_converted_directory_names(tmp_path):
    from spec_decode.bench.args import target_gguf
    from spec_decode.disk_cache import MARKER_NAME

    assert target_gguf(tmp_path) is None
    (tmp_path / MARKER_NAME).write_text(json.dumps({"source": "/models/x.gguf", "files": {}}))
    assert target_gguf(tmp_path) == Path("/models/x.gguf")
    (tmp_path / MARKER_NAME).write_text(json.dumps({"source": "/models/x.safetensors"}))
    assert target_gguf(tmp_path) is None


@pytest.mark.slow
def test_the_real_package_on_the_real_gguf_file_ignores_eos():
    """llama-cpp-python itself on SmolLM2's GGUF file: a short answer's EOS does not stop it, and its prompt
    lookup emits as many tokens, the steps after the prefill's token adding up."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the anchor extra)")
    from spec_decode.bench.anchor import LlamaCppRunner
    from spec_decode.bench.config import METHOD_SPECS

    try:
        gguf, target = fixtures.smollm2_gguf_path(), fixtures.smollm2_target_dir()
    except ImportError as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    prompt = prompt_sets.chat_token_ids(AutoTokenizer.from_pretrained(target), "Say hi.")
    n = 48   # past the end of the model's short answer
    for key in ANCHOR_METHODS:
        runner = LlamaCppRunner.load(METHOD_SPECS[key], gguf, n_ctx=len(prompt) + n, threads=1)
        out = runner.generate([prompt], n, 0.0, seed=0)
        assert len(out.tokens[0]) == n, key
        if runner.draft is not None:
            assert sum(out.accepted_lengths) == n - 1
