"""spec-bench: the results.json contract, the figure, the subcommands and every bad input.

Runs the real benchmark on random tiny models with a tiny setting. It asserts what the output
promises (keys, types, losslessness flags, a valid PNG), never a speed. Bad input is a probe suite
(``BAD_INPUTS``): each probe must exit with status 2 and a message naming the option, before
anything is measured; a stage that fails later keeps what was measured in ``results.json``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from spec_decode.bench import main
from spec_decode.bench.config import ANCHOR_METHODS, LOOKUP_TOKENS, NAN_MODES
from spec_decode.bench.config import METHOD_KEYS as ALL_METHOD_KEYS
from spec_decode.bench.numerics_bench import sglang_style, vllm_style
from spec_decode.bench.report import invariance_line, markdown_table
from spec_decode.cpu import cpu_kind
from spec_decode.bench.harness import CONTRACT_KEYS, percentile
from spec_decode.models import Transformer
from tiny_models import make_tiny_eagle, make_tiny_eagle3, make_tiny_target

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METHOD_KEYS = tuple(k for k in ALL_METHOD_KEYS if k not in ANCHOR_METHODS)
"""Every method of these tiny models: the anchor's run llama.cpp on a GGUF file (test_bench_anchor.py)."""
NUM_PROMPTS, MAX_NEW = 2, 6


@pytest.fixture(scope="module")
def fake_fixtures(tmp_path_factory) -> Path:
    """A fixtures-like directory: models/{tiny-target,tiny-draft,tiny-eagle,tiny-eagle3} + prompts.jsonl."""
    root = tmp_path_factory.mktemp("bench_fixtures")
    models = root / "models"
    target_dir = make_tiny_target(models, name="tiny-target")
    # Every token is an EOS for HF: a benchmark that let EOS stop generation would come up short.
    (target_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(97))}))
    make_tiny_target(models, name="tiny-draft", seed=3, num_hidden_layers=1)
    target = Transformer.from_pretrained(target_dir, dtype=torch.float32)
    make_tiny_eagle(target, models / "tiny-eagle")
    make_tiny_eagle3(target, models / "tiny-eagle3", draft_vocab_size=60)
    g = torch.Generator().manual_seed(0)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(NUM_PROMPTS + 1):   # + the warm-up prompt
            ids = torch.randint(97, (5 + 3 * i,), generator=g).tolist()
            f.write(json.dumps({"id": f"p{i}", "source_file": "x.py", "text": "", "token_ids": ids}) + "\n")
    return root


def _model_args(fx: Path, **paths) -> list[str]:
    m = fx / "models"
    default = {"target": m / "tiny-target", "draft-lm": m / "tiny-draft", "eagle": m / "tiny-eagle",
               "eagle3": m / "tiny-eagle3", "prompts": fx / "prompts.jsonl"}
    default.update(paths)
    return [a for k, v in default.items() for a in (f"--{k}", str(v))]


@pytest.fixture(scope="module")
def bench_run(fake_fixtures, tmp_path_factory):
    """One tiny run: every method, greedy and T=1, the NaN stage with one round."""
    out = tmp_path_factory.mktemp("bench_out")
    rc = main(_model_args(fake_fixtures) + [
        "--num-prompts", str(NUM_PROMPTS), "--max-new-tokens", str(MAX_NEW), "--methods", ",".join(METHOD_KEYS),
        "--temperatures", "0,1", "--nan-rounds", "1", "--threads", "1", "--no-progress", "--out", str(out)])
    assert rc == 0
    return out, json.loads((out / "results.json").read_text())


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@pytest.mark.slow
def test_results_json_follows_the_contract(bench_run):
    _, r = bench_run
    assert {"machine", "config", "methods", "nan_policy_overhead_pct"} <= set(r)
    assert set(r["methods"]) == set(METHOD_KEYS)
    for key in ("cpu", "cpu_cores", "torch", "transformers", "date", "torch_threads"):
        assert key in r["machine"]
    assert r["machine"]["torch_threads"] == 1
    assert r["config"]["num_prompts"] == NUM_PROMPTS and r["config"]["max_new_tokens"] == MAX_NEW
    configs = r["config"]["method_configs"]
    assert configs["eagle_chain"] == {"engine": "ours", "method": "eagle", "drafter": "eagle", "num_steps": 4,
                                      "topk": 1, "num_draft_tokens": 5, "draft_sampling": "auto",
                                      "batch_invariant": True}
    # eagle_auto: a chain up to depth 6, the depth chosen by the decoder (as the decoder reports it)
    assert configs["eagle_auto"] == {"engine": "ours", "method": "eagle", "drafter": "eagle", "num_steps": "auto",
                                     "max_steps": 6, "topk": 1, "num_draft_tokens": 7, "draft_sampling": "auto",
                                     "batch_invariant": True}
    assert configs["eagle_lookup"] == {"engine": "ours", "method": "eagle", "drafter": "eagle", "num_steps": 5, "topk": 1,
                                       "num_draft_tokens": 6, "lookup_ngram": 3, "lookup_tokens": 8,
                                       "draft_sampling": "auto", "batch_invariant": True}
    # eagle3_lookup: each lookup step's drafts chosen from the verify costs measured here, up to LOOKUP_TOKENS
    assert configs["eagle3_lookup"]["lookup_tokens"] == "auto"
    assert configs["eagle3_lookup"]["lookup_max_tokens"] == LOOKUP_TOKENS
    costs = r["methods"]["eagle3_lookup"]["lookup_costs"]
    assert list(costs) == [str(n) for n in range(1, LOOKUP_TOKENS + 2)] and costs["1"] == 1.0
    assert all(_is_num(c) and c > 0 for c in costs.values())
    assert "lookup_costs" not in r["methods"]["eagle_lookup"]   # a fixed lookup_tokens measures nothing
    for key in ("ar", "hf_generate", "hf_assisted"):
        assert "draft_sampling" not in configs[key], key
    assert configs["ar"]["batch_invariant"] is True and "batch_invariant" not in configs["hf_generate"]
    assert f"CPU kind {cpu_kind()}" in r["machine"]["cpu_routes"]
    line = invariance_line(r)
    assert line.startswith("batch-invariant routes: in force for ") and "ar" in line and "off for none" in line
    for key, e in r["methods"].items():
        assert set(CONTRACT_KEYS) <= set(e), key
        for name in ("tokens_per_s", "p50_step_ms", "p90_step_ms", "peak_mem_mb"):
            assert _is_num(e[name]) and e[name] > 0, (key, name, e[name])
        assert e["p90_step_ms"] >= e["p50_step_ms"]
        assert _is_num(e["speedup_vs_ar"]) and _is_num(e["speedup_vs_hf_generate"])
        assert e["generated_tokens"] == NUM_PROMPTS * MAX_NEW, key   # EOS never stops a method early
        assert set(e["by_temperature"]) == {"0", "1"}
        assert e["by_temperature"]["0"]["tokens_per_s"] == e["tokens_per_s"]   # greedy numbers on top
        assert e["by_temperature"]["1"]["greedy_equals_ar"] is None
    assert r["methods"]["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert r["methods"]["hf_generate"]["speedup_vs_hf_generate"] == pytest.approx(1.0)


def test_accepted_lengths_only_for_speculative_methods(bench_run):
    _, r = bench_run
    for key in ("ar", "hf_generate", "hf_assisted"):
        assert r["methods"][key]["mean_accepted_length"] is None, key
    for key in ("draft_chain", "eagle_chain", "eagle_tree", "eagle_auto", "eagle_lookup", "eagle3_tree"):
        e = r["methods"][key]
        config = r["config"]["method_configs"][key]
        depth = config["max_steps"] if config["num_steps"] == "auto" else config["num_steps"]
        depth = max(depth, config.get("lookup_tokens", 0))   # a lookup step verifies up to lookup_tokens drafts
        assert 1.0 <= e["mean_accepted_length"] <= depth + 1, key
        hist = {int(n): c for n, c in e["accepted_length_hist"].items()}
        assert sum(hist.values()) == e["num_verify_steps"]
        assert sum(n * c for n, c in hist.items()) / e["num_verify_steps"] == pytest.approx(e["mean_accepted_length"])


def test_greedy_methods_reproduce_ar(bench_run):
    # fp32 random tiny models: our speculative methods are lossless, and HF's fp32 forward matches
    # ours closely enough that greedy ties do not occur on these 2 x 6 tokens.
    _, r = bench_run
    for key in METHOD_KEYS:
        assert r["methods"][key]["greedy_equals_ar"] is True, key
        assert r["methods"][key]["greedy_mismatched_prompts"] == 0


def test_nan_policy_stage_reports_every_mode(bench_run):
    _, r = bench_run
    assert set(r["nan_policy_overhead_pct"]) == {"sanitize", "abort", "guard"}
    assert all(_is_num(v) for v in r["nan_policy_overhead_pct"].values())
    detail = r["nan_policy"]
    assert set(detail["tokens_per_s"]) == {"off", "sanitize", "abort", "guard"} == set(NAN_MODES)
    assert detail["nan_pass_ms"] > 0
    assert "guard" in markdown_table(r)


def test_figure_is_a_png(bench_run):
    out, r = bench_run
    data = (out / "results.png").read_bytes()
    assert data[:8] == PNG_MAGIC
    import matplotlib.image

    img = matplotlib.image.imread(out / "results.png")
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400
    table = markdown_table(r)
    assert all(f"| {k} |" in table for k in METHOD_KEYS)


def test_missing_eagle3_head_is_skipped_with_a_note(fake_fixtures, tmp_path):
    rc = main(_model_args(fake_fixtures, eagle3=tmp_path / "absent") + [
        "--num-prompts", "1", "--max-new-tokens", "4", "--methods", "ar,eagle3_tree", "--temperatures", "0",
        "--nan-rounds", "0", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "results.json").read_text())
    e = r["methods"]["eagle3_tree"]
    assert "absent" in e["skipped"] and all(e[k] is None for k in CONTRACT_KEYS)
    assert r["methods"]["ar"]["greedy_equals_ar"] is True
    assert r["nan_policy_overhead_pct"] == {"sanitize": None, "abort": None, "guard": None}
    assert (tmp_path / "results.png").read_bytes()[:8] == PNG_MAGIC


def test_numerics_subcommand_writes_records(tmp_path, capsys):
    rc = main(["numerics", "--rows", "8,16", "--vocabs", "99", "--dtypes", "fp32,bf16", "--min-run-time", "0.01",
               "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "numerics.json").read_text())
    recs = data["results"]
    assert {r["impl"] for r in recs} == {"copy", "ours_torch", "nan_only_torch", "sglang_style", "vllm_style"}
    assert len(recs) == 2 * 2 * 1 * 5
    for rec in recs:
        assert rec["median_ms"] > 0 and rec["gb_s"] > 0 and rec["fraction_of_copy"] > 0
        assert rec["requests"] == rec["rows"] // 8
        assert rec["vs_nan_only"] > 0 and (rec["impl"] != "nan_only_torch" or rec["vs_nan_only"] == 1.0)
    assert "ours_torch" in capsys.readouterr().out


def test_numerics_nan_every_times_the_counts_on_corrupted_rows(tmp_path):
    rc = main(["numerics", "--rows", "16", "--vocabs", "99", "--dtypes", "fp32", "--min-run-time", "0.01",
               "--device", "cpu", "--nan-every", "3", "--out", str(tmp_path)])
    assert rc == 0
    recs = json.loads((tmp_path / "numerics.json").read_text())["results"]
    assert {r["impl"] for r in recs} == {"copy", "ours_torch_counts", "nan_only_counts"}
    assert all(r["nan_every"] == 3 for r in recs)


@pytest.mark.parametrize("args, needle", [
    (["--rows", "12"], "multiple of 8"),
    (["--dtypes", "fp16x"], "--dtypes"),
    (["--vocabs", "a"], "--vocabs"),
    (["--nan-every", "-1"], "--nan-every"),
])
def test_numerics_bad_arguments(tmp_path, capsys, args, needle):
    with pytest.raises(SystemExit) as exc:
        main(["numerics", "--out", str(tmp_path)] + args)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_implementations_agree_with_ours(dtype):
    """The engine-style references must do the same job, or the speed comparison means nothing."""
    from numerics import nan_counts_per_request

    x = torch.randn(24, 99).to(dtype)
    x[0, 3] = x[0, 5] = x[17, 98] = float("nan")
    x[9, 0] = float("inf")
    cu = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
    owner = torch.arange(24) // 8
    ours = x.clone()
    counts = nan_counts_per_request(ours, cu, sanitize=True, backend="torch")
    assert vllm_style(x.clone(), owner, 3).tolist() == counts.tolist() == [2, 0, 1]
    y = x.clone()
    assert bool(sglang_style(y, owner, 3))
    assert torch.isfinite(y.float()).all()
    assert torch.equal(y, ours)


def test_percentile_interpolates():
    assert percentile([], 0.5) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error; this machine has CUDA")
def test_gpu_check_without_cuda_says_so(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["gpu-check"])
    assert exc.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "spec_decode.bench", "--help"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[3], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--num-prompts" in proc.stdout and "--methods" in proc.stdout


# ------------------------------------------------------------------ bad input: a probe suite
def _truncated_copy(src: Path, dst: Path, keep: float = 0.5) -> Path:
    """A copy of checkpoint ``src`` whose model.safetensors keeps only the first ``keep`` of its bytes."""
    shutil.copytree(src, dst)
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[:int(len(data) * keep)])
    return dst


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return path


def _non_model_dir(tmp: Path) -> Path:
    (tmp / "notes").mkdir()
    _write(tmp / "notes" / "README", "not a model")
    return tmp / "notes"


def _bad_config(fx: Path, tmp: Path) -> Path:
    dst = shutil.copytree(fx / "models/tiny-target", tmp / "badcfg")
    _write(dst / "config.json", "{hidden_size: ")
    return dst


def _prompts(content: str | bytes):
    """A probe that passes a prompts file holding ``content``."""
    return lambda fx, t: ["--prompts", _write(t / "p.jsonl", content)]


# name -> (fn(fixtures, tmp) -> extra argv, the option the message must name, another needle)
BAD_INPUTS = {
    "prompts_not_json": (_prompts('{"token_ids": [1, 2]}\nnot json\n'), "--prompts", ":2"),
    "prompts_without_token_ids": (_prompts('{"ids": [1]}\n{"ids": [1]}\n'), "--prompts", ":1"),
    "prompts_out_of_vocab": (_prompts('{"token_ids": [1, 97]}\n'), "--prompts", "[0, 97)"),
    "prompts_negative_id": (_prompts('{"token_ids": [-1]}\n'), "--prompts", "[0, 97)"),
    "prompts_bool_id": (_prompts('{"token_ids": [true]}\n'), "--prompts", "ints"),
    "prompts_empty_list": (_prompts('{"token_ids": []}\n'), "--prompts", "non-empty"),
    "prompts_not_a_list": (_prompts('{"token_ids": "12"}\n'), "--prompts", "list"),
    "prompts_binary": (_prompts(b"\x89PNG\xff\xfe\x00\n"), "--prompts", "p.jsonl"),
    "prompts_missing": (lambda fx, t: ["--prompts", t / "absent.jsonl"], "--prompts", "absent.jsonl"),
    "prompts_too_few": (lambda fx, t: ["--num-prompts", "50"], "--num-prompts", "exceeds"),
    "target_missing": (lambda fx, t: ["--target", t / "nowhere"], "--target", "nowhere"),
    "target_non_model_dir": (lambda fx, t: ["--target", _non_model_dir(t)], "--target", "config.json"),
    "target_is_a_file": (lambda fx, t: ["--target", fx / "prompts.jsonl"], "--target", "prompts.jsonl"),
    "target_truncated": (lambda fx, t: ["--target", _truncated_copy(fx / "models/tiny-target", t / "tt")],
                         "--target", "model.safetensors"),
    "target_header_truncated": (lambda fx, t: ["--target", _truncated_copy(fx / "models/tiny-target", t / "tt", 0.001)],
                                "--target", "model.safetensors"),
    "target_bad_config": (lambda fx, t: ["--target", _bad_config(fx, t)], "--target", "config.json"),
    "eagle_non_model_dir": (lambda fx, t: ["--methods", "eagle_chain", "--eagle", _non_model_dir(t)],
                            "--eagle", "config.json"),
    "eagle_truncated": (lambda fx, t: ["--methods", "eagle_tree", "--eagle",
                                       _truncated_copy(fx / "models/tiny-eagle", t / "e")], "--eagle", "safetensors"),
    "eagle_wrong_layout": (lambda fx, t: ["--methods", "eagle_chain", "--eagle", fx / "models/tiny-eagle3"],
                           "--eagle", "eagle3"),
    "eagle_for_the_nan_stage_only": (lambda fx, t: ["--methods", "ar", "--nan-rounds", "1", "--eagle",
                                                    _truncated_copy(fx / "models/tiny-eagle", t / "e")],
                                     "--eagle", "safetensors"),
    "eagle3_truncated": (lambda fx, t: ["--methods", "eagle3_tree", "--eagle3",
                                        _truncated_copy(fx / "models/tiny-eagle3", t / "e3")],
                         "--eagle3", "safetensors"),
    "draft_lm_truncated": (lambda fx, t: ["--methods", "draft_chain", "--draft-lm",
                                          _truncated_copy(fx / "models/tiny-draft", t / "d")],
                           "--draft-lm", "safetensors"),
    "draft_lm_truncated_hf": (lambda fx, t: ["--methods", "hf_assisted", "--draft-lm",
                                             _truncated_copy(fx / "models/tiny-draft", t / "d")],
                              "--draft-lm", "safetensors"),
    "only_method_skipped": (lambda fx, t: ["--methods", "eagle3_tree", "--eagle3", t / "absent"],
                            "--methods", "skipped"),
    "out_is_a_file": (lambda fx, t: ["--out", _write(t / "f", "x")], "--out", "not a directory"),
    "out_under_a_file": (lambda fx, t: ["--out", _write(t / "f", "x") / "sub"], "--out", "cannot write"),
    "out_unwritable": (lambda fx, t: ["--out", "/proc/spec-bench-out"], "--out", "cannot write"),
    "device_unknown": (lambda fx, t: ["--device", "tpu9"], "--device", "tpu9"),
    "device_not_supported": (lambda fx, t: ["--device", "meta"], "--device", "cpu or cuda"),
    "device_cuda_index": (lambda fx, t: ["--device", "cuda:99"], "--device", "cuda:99"),
    "methods_unknown": (lambda fx, t: ["--methods", "ar,beam_search"], "--methods", "beam_search"),
    "num_prompts_zero": (lambda fx, t: ["--num-prompts", "0"], "--num-prompts", ">= 1"),
    "max_new_tokens_negative": (lambda fx, t: ["--max-new-tokens", "-1"], "--max-new-tokens", ">= 1"),
    "dtype_unknown": (lambda fx, t: ["--dtype", "fp8"], "--dtype", "fp8"),
    "temperature_negative": (lambda fx, t: ["--temperatures", "-1"], "--temperatures", "-1"),
    "batch_size_zero": (lambda fx, t: ["--batch-size", "0"], "--batch-size", ">= 1"),
}


@pytest.mark.parametrize("probe", list(BAD_INPUTS))
def test_bad_input_exits_2_naming_the_option(fake_fixtures, tmp_path, capsys, probe):
    make, option, needle = BAD_INPUTS[probe]
    extra = [str(a) for a in make(fake_fixtures, tmp_path)]
    out = tmp_path / "out"
    argv = _model_args(fake_fixtures) + ["--out", str(out), "--num-prompts", "1", "--max-new-tokens", "2",
                                         "--nan-rounds", "0", "--methods", "ar", "--no-progress"] + extra
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    # one line, the option first (argparse says "argument --option" for a value its type rejects)
    assert re.match(rf"spec-bench: error: (argument )?{option}\b", err[-1]), err[-1]
    assert needle in err[-1]
    assert "Traceback" not in "\n".join(err)
    assert not (out / "results.json").exists()   # nothing ran


def test_a_failing_later_stage_keeps_what_was_measured(fake_fixtures, tmp_path, monkeypatch):
    import spec_decode.bench.harness as run

    def broken(*args, **kwargs):
        raise RuntimeError("the NaN stage broke")

    monkeypatch.setattr(run, "nan_policy_stage", broken)
    with pytest.raises(RuntimeError, match="the NaN stage broke"):
        main(_model_args(fake_fixtures) + ["--out", str(tmp_path), "--num-prompts", "1", "--max-new-tokens", "3",
                                           "--methods", "ar,eagle_chain", "--temperatures", "0", "--nan-rounds", "1",
                                           "--no-progress", "--threads", "1"])
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["error"] == {"type": "RuntimeError", "message": "the NaN stage broke"}
    assert r["methods"]["eagle_chain"]["greedy_equals_ar"] is True
    assert _is_num(r["methods"]["ar"]["tokens_per_s"])


# ------------------------------------------------------------------ spec-bench profile
class _FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _FakeDrafter(torch.nn.Module):
    """Each call advances the clock by ``cost``; ``costs`` instead cycles through several (one per call)."""

    def __init__(self, clock: _FakeClock, cost: float, costs: tuple[float, ...] | None = None):
        super().__init__()
        self.clock, self.costs, self.calls = clock, costs or (cost,), 0

    def forward(self, x):
        self.clock.t += self.costs[self.calls % len(self.costs)]
        self.calls += 1
        return x

    def draft_forward(self, x):
        return self(x), None


class _FakeDecoder:
    """Two steps per call; each phase advances a fake clock by a known cost; drafting calls the drafter twice."""

    COSTS = {"drafting": 1.0, "verify_forward": 3.0, "verify_walk": 0.5, "bookkeeping": 0.25}
    OUTSIDE = 0.25   # per step, in no phase
    TAKES_LOGITS = False   # drafting also calls drafter.compute_logits after each drafter call

    def __init__(self, clock: _FakeClock, drafter=None, step_cost: float | None = None):
        from spec_decode.step import StepHooks

        self.clock, self.drafter, self.step_cost = clock, drafter, step_cost
        self.hooks = StepHooks()
        self.last_stats = types.SimpleNamespace(step_s=[])

    def generate(self, prompts, *, max_new_tokens, temperature, seed, ignore_eos):
        self.last_stats = types.SimpleNamespace(step_s=[])
        for _ in range(2):
            t0 = self.clock.t
            if self.step_cost is not None:   # the ar decoder
                self.clock.t += self.step_cost
            else:
                for name, cost in self.COSTS.items():
                    with self.hooks.timer(name):
                        self.clock.t += cost
                        if name == "drafting":
                            for i in range(2):
                                h, _ = self.drafter.draft_forward(torch.zeros(1))
                                if self.TAKES_LOGITS:
                                    self.drafter.compute_logits(h)
                self.clock.t += self.OUTSIDE
            self.last_stats.step_s.append(self.clock.t - t0)
        return [types.SimpleNamespace(token_ids=[0] * 4, accepted_lengths=[3, 1])]


def test_profile_split_is_exact_on_a_fake_decoder():
    from spec_decode.bench.profile_step import Workload, profile_split
    from spec_decode.step import PHASES

    clock = _FakeClock()
    drafter = _FakeDrafter(clock, 0.25)
    dec, ar = _FakeDecoder(clock, drafter), _FakeDecoder(clock, step_cost=2.0)
    own_hooks = dec.hooks
    split = profile_split(dec, ar, drafter, Workload([[1, 2], [3]], 4), phases=PHASES, clock=clock)
    # per step: drafting 1 + 2 calls x 0.25; one ar step = 2.0
    assert split["ar_step_ms"] == pytest.approx(2000.0)
    assert split["ar_steps"] == pytest.approx({"drafting": 0.75, "verify_forward": 1.5, "verify_walk": 0.25,
                                               "bookkeeping": 0.125, "unaccounted": 0.125})
    assert split["step_ar_steps"] == pytest.approx(2.75)
    assert split["step_without_drafting_ar_steps"] == pytest.approx(2.0)
    assert split["drafter_calls_per_step"] == pytest.approx(2.0)
    assert split["drafter_call_ar_steps"] == pytest.approx(0.125)
    assert split["steps"] == 4 and split["mean_accepted_length"] == pytest.approx(2.0)
    assert dec.hooks is own_hooks   # the hooks are restored
    assert "draft_forward" not in vars(drafter)   # and the drafter's own method back
    # a drafter the decoder never calls is an error, not a split without drafter calls
    with pytest.raises(RuntimeError, match="never called drafter.draft_forward"):
        profile_split(dec, ar, _FakeDrafter(clock, 0.25), Workload([[1]], 4), phases=PHASES, clock=clock)


def test_profile_splits_each_steps_catch_up_from_its_later_calls():
    """A step's first drafter call (the catch-up after the verify forward) is timed apart from the rest."""
    from spec_decode.bench.profile_step import Workload, profile_split
    from spec_decode.step import PHASES

    clock = _FakeClock()
    drafter = _FakeDrafter(clock, 0.0, costs=(0.5, 0.25))   # two calls per step: catch-up 0.5, then 0.25
    dec, ar = _FakeDecoder(clock, drafter), _FakeDecoder(clock, step_cost=2.0)
    split = profile_split(dec, ar, drafter, Workload([[1, 2], [3]], 4), phases=PHASES, clock=clock)
    assert split["catch_up_call_ms"] == pytest.approx(500.0)
    assert split["catch_up_call_ar_steps"] == pytest.approx(0.25)
    assert split["draft_call_ms"] == pytest.approx(250.0)
    assert split["draft_call_ar_steps"] == pytest.approx(0.125)
    assert split["drafter_call_ms"] == pytest.approx(375.0)   # the mean over both kinds


def test_profile_splits_each_requests_prompt_catch_up_from_the_other_catch_ups():
    from spec_decode.bench.profile_step import Workload, profile_split
    from spec_decode.step import PHASES

    clock = _FakeClock()
    # per generate call: step 1's catch-up (the prompt) 1.0, a later call, step 2's catch-up 0.5, a later call
    drafter = _FakeDrafter(clock, 0.0, costs=(1.0, 0.25, 0.5, 0.25))
    dec, ar = _FakeDecoder(clock, drafter), _FakeDecoder(clock, step_cost=2.0)
    split = profile_split(dec, ar, drafter, Workload([[1, 2], [3]], 4), phases=PHASES, clock=clock)
    assert split["prompt_catch_up_call_ms"] == pytest.approx(1000.0)
    assert split["prompt_catch_up_call_ar_steps"] == pytest.approx(0.5)
    assert split["step_catch_up_call_ms"] == pytest.approx(500.0)
    assert split["catch_up_call_ms"] == pytest.approx(750.0)   # both kinds
    assert split["draft_call_ms"] == pytest.approx(250.0)


class _FakeDrafterWithLogits(_FakeDrafter):
    """``_FakeDrafter`` whose ``compute_logits`` costs ``logits_cost``; ``nested``: its forward also
    computes logits (as a forward with ``return_logits=True`` does), which must count as forward time."""

    def __init__(self, clock: _FakeClock, cost: float, logits_cost: float, nested: bool = False):
        super().__init__(clock, cost)
        self.logits_cost, self.nested = logits_cost, nested

    def draft_forward(self, x):
        if self.nested:
            self.compute_logits(x)
        return super().draft_forward(x)

    def compute_logits(self, h):
        self.clock.t += self.logits_cost
        return h


class _FakeDecoderWithLogits(_FakeDecoder):
    """``_FakeDecoder`` whose drafting also takes the drafter's logits once after each of its two calls."""

    TAKES_LOGITS = True


@pytest.mark.parametrize("nested", [False, True])
def test_profile_splits_the_drafters_logits_from_its_calls_and_the_rest(nested):
    """Drafting = drafter calls + their logits + the rest (sampling, bookkeeping); logits that a forward
    computes inside its own call stay forward time, never counted twice."""
    from spec_decode.bench.profile_step import Workload, profile_split
    from spec_decode.step import PHASES

    clock = _FakeClock()
    drafter = _FakeDrafterWithLogits(clock, 0.25, logits_cost=0.125, nested=nested)
    dec, ar = _FakeDecoderWithLogits(clock, drafter), _FakeDecoder(clock, step_cost=2.0)
    split = profile_split(dec, ar, drafter, Workload([[1, 2], [3]], 4), phases=PHASES, clock=clock)
    call = 0.25 + (0.125 if nested else 0.0)   # a nested logits call is part of its forward
    # per step: drafting 1 (the rest) + 2 calls + 2 logits of 0.125 outside them
    assert split["drafter_call_ms"] == pytest.approx(call * 1e3)
    assert split["drafter_logits_calls_per_step"] == pytest.approx(2.0)
    assert split["drafter_logits_ms"] == pytest.approx(125.0)
    assert split["drafter_logits_ar_steps"] == pytest.approx(0.0625)
    assert split["drafting_rest_ms"] == pytest.approx(1000.0)
    assert split["drafting_rest_ar_steps"] == pytest.approx(0.5)
    assert split["phase_ms"]["drafting"] == pytest.approx(1000.0 + 2 * (call + 0.125) * 1e3)
    assert "compute_logits" not in vars(drafter) and "draft_forward" not in vars(drafter)


def test_phase_clock_counts_nested_phases_once():
    from spec_decode.bench.profile_step import PhaseClock

    clock = _FakeClock()
    phases = PhaseClock(clock=clock)
    with phases("drafting"):
        clock.t += 1.0
        with phases("verify_walk"):
            clock.t += 2.0
        clock.t += 0.5
    assert phases.seconds == {"drafting": 1.5, "verify_walk": 2.0}
    assert phases.entries == {"drafting": 1, "verify_walk": 1}


def test_profile_needs_the_public_hook():
    from spec_decode.bench.profile_step import Workload, profile_split

    class NoHook:
        pass

    with pytest.raises(TypeError, match="step hooks"):
        profile_split(NoHook(), NoHook(), None, Workload([[1]], 2), phases=("drafting",))


def test_the_cprofile_pass_runs_at_the_splits_temperature():
    """``--cprofile`` profiles the same sampling as the split (it once ran greedy whatever --temperature)."""
    from spec_decode.bench.profile_step import cprofile_top

    class Recorder:
        def __init__(self):
            self.calls = []

        def generate(self, prompts, **kwargs):
            self.calls.append(kwargs)

    dec = Recorder()
    assert "function calls" in cprofile_top(dec, [[1, 2], [3]], 4, 5, temperature=1.0, seed=7)
    assert dec.calls == [dict(max_new_tokens=4, temperature=1.0, seed=7, ignore_eos=True)] * 2
    greedy = Recorder()
    cprofile_top(greedy, [[1]], 4, 5)
    assert greedy.calls == [dict(max_new_tokens=4, temperature=0.0, seed=None, ignore_eos=True)]


def _recording_decoders(fake_fixtures, **kw):
    """A 3/1/4 EAGLE decoder whose ``generate`` calls append their ``last_stats`` to a list, and an ``ar`` one."""
    from spec_decode.pipeline import SpecDecoder

    m = fake_fixtures / "models"
    dec = SpecDecoder.from_pretrained(m / "tiny-target", m / "tiny-eagle", dtype=torch.float32, num_steps=3,
                                      topk=1, num_draft_tokens=4, **kw)
    ar = SpecDecoder.from_pretrained(m / "tiny-target", dtype=torch.float32, method="none")
    stats = []
    real_generate = dec.generate

    def generate(*args, **kwargs):
        out = real_generate(*args, **kwargs)
        stats.append(dec.last_stats)
        return out

    dec.generate = generate
    return dec, ar, stats


def test_profile_splits_untrimmed_steps_and_restores_the_decoder(fake_fixtures):
    """Every profiled step has the configured depth (no last step trimmed to the tokens left)."""
    from spec_decode.bench.profile_step import Workload, profile_split
    from spec_decode.step import PHASES

    dec, ar, stats = _recording_decoders(fake_fixtures)
    split = profile_split(dec, ar, dec.drafter, Workload([[1, 2, 3]], 5), phases=PHASES)
    assert {d for st in stats for d in st.depths} == {3} and split["drafter_calls_per_step"] == pytest.approx(3.0)
    assert dec.trim_last_steps is True
    dec.generate([[1, 2, 3]], max_new_tokens=5, ignore_eos=True)   # every token is an EOS here
    assert dec.last_stats.depths[-1] < 3   # trimmed again outside the profile


def test_profile_splits_drafted_steps_only_and_restores_lookup(fake_fixtures):
    """A decoder with lookup_ngram is profiled without lookup steps (none of them calls the drafter)."""
    from spec_decode.bench.profile_step import Workload, profile_split
    from spec_decode.step import PHASES

    dec, ar, stats = _recording_decoders(fake_fixtures, lookup_ngram=1)
    prompt = list(range(dec.target.config.vocab_size))   # every token occurred: lookup drafts at every step
    dec.generate([prompt], max_new_tokens=5, ignore_eos=True)
    assert dec.last_stats.lookup[0]
    stats.clear()
    split = profile_split(dec, ar, dec.drafter, Workload([prompt], 5), phases=PHASES)
    assert stats and not any(f for st in stats for f in st.lookup)
    assert split["drafter_calls_per_step"] == pytest.approx(3.0)
    assert dec.lookup_ngram == 1


def test_profile_subcommand_reports_the_split(fake_fixtures, tmp_path, capsys):
    from spec_decode.step import PHASES

    rc = main(["profile"] + _model_args(fake_fixtures) + ["--method", "eagle_chain", "--num-prompts", "1",
                                                          "--max-new-tokens", "4", "--threads", "1",
                                                          "--json", str(tmp_path / "split.json")])
    assert rc == 0
    out = capsys.readouterr().out
    for name in PHASES + ("one drafter call", "step without drafting", "one ar step"):
        assert name in out, name
    split = json.loads((tmp_path / "split.json").read_text())
    assert set(PHASES) <= set(split["ar_steps"])
    assert split["drafter_calls_per_step"] >= 1 and split["drafter_call_ar_steps"] > 0
    assert split["catch_up_call_ar_steps"] > 0 and "the catch-up" in out
    assert split["drafter_logits_calls_per_step"] >= 1 and split["drafter_logits_ar_steps"] > 0
    assert split["drafting_rest_ms"] is not None and "its logits (compute_logits)" in out
    assert split["ar_steps"]["verify_forward"] > 0 and split["step_ar_steps"] > 0


def test_profile_of_eagle_lookup_says_its_lookup_steps_are_off(fake_fixtures, capsys):
    rc = main(["profile"] + _model_args(fake_fixtures) + ["--method", "eagle_lookup", "--num-prompts", "1",
                                                          "--max-new-tokens", "4", "--threads", "1"])
    assert rc == 0
    assert "eagle_lookup (5/1/6, its lookup steps off)" in capsys.readouterr().out


def _run_gemm(fake_fixtures, capsys, *args) -> str | None:
    """``spec-bench gemm`` on the fake fixtures (one prompt x 4 tokens); its output, or None where the
    kernel cannot run (after checking that it says so)."""
    from spec_decode.cpu import cpu_gemm

    rc = main(["gemm"] + _model_args(fake_fixtures) + ["--repeats", "3", "--num-prompts", "1",
                                                       "--max-new-tokens", "4", *args])
    out = capsys.readouterr().out
    if not cpu_gemm.available():
        assert rc == 1 and "not available" in out
        return None
    assert rc == 0
    return out


def test_gemm_subcommand_times_every_projection_and_compares_end_to_end(fake_fixtures, capsys):
    out = _run_gemm(fake_fixtures, capsys, "--rows", "1,5")
    if out is None:
        return
    assert "F.linear" in out and "kernel on over off" in out and "greedy eagle_chain == ar: on True, off True" in out
    assert "ar on == ar off: True" in out
    lines = [ln for ln in out.splitlines() if " x " in ln and ln.strip()[0].isdigit()]
    assert len(lines) >= 2 * 4   # the fake target's and head's projection shapes, at two row counts


def test_gemm_reports_the_kernels_gflops_per_forward_against_the_fma_peak(fake_fixtures, capsys):
    out = _run_gemm(fake_fixtures, capsys, "--rows", "1", "--kernel-rows", "1,4", "--kernel-repeats", "2",
                    "--isa", "avx2")
    if out is None:
        return
    lines = [ln.split() for ln in out.splitlines() if ln.strip().startswith("avx2 ") and "peak" not in ln]
    assert [(ln[1], ln[2]) for ln in lines] == [("fp32", "1"), ("fp32", "4"), ("bf16", "1"), ("bf16", "4")]
    assert all(float(ln[4]) > 0 and ln[5].endswith("%") for ln in lines)
    assert re.search(r"avx2 FMA peak, one core, measured: \d+\.\d GFLOP/s", out)


def test_gemm_kernel_only_loads_no_drafter(fake_fixtures, capsys):
    """--kernel-only needs no head that fits the target (the real model has no EAGLE-1 head)."""
    out = _run_gemm(fake_fixtures, capsys, "--eagle", str(fake_fixtures / "models" / "tiny-draft"),   # no EAGLE head
                    "--kernel-only", "--kernel-rows", "2", "--kernel-repeats", "1", "--isa", "avx2")
    if out is None:
        return
    assert "FMA peak" in out and "F.linear" not in out and "end to end" not in out


def test_kernel_throughput_counts_the_forwards_flops_and_weight_bytes(monkeypatch):
    from spec_decode.bench import gemm
    from spec_decode.cpu import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("the panel kernel is not available on this machine")
    panels = [cpu_gemm.PanelWeight(torch.zeros(n, k, dtype=torch.bfloat16)) for k, n in ((8, 20), (20, 8), (8, 8))]
    monkeypatch.setattr(gemm, "median_us", lambda fn, repeats: 1000.0)   # one pass: 1 ms
    got = gemm.kernel_throughput(panels, rows=3, repeats=1, peak_gflops=1e-3)
    flops = 2 * 3 * (8 * 20 + 20 * 8 + 8 * 8)
    assert got["gflops"] == pytest.approx(flops / 1e-3 / 1e9) and got["peak_frac"] == pytest.approx(flops / 1e-3 / 1e9 / 1e-3)
    # the panels as packed (whole panels of 16 outputs, zero padded), bf16: 2 bytes a weight
    assert got["weight_gbs"] == pytest.approx(2 * (2 * 8 * 16 + 1 * 20 * 16 + 1 * 8 * 16) / 1e-3 / 1e9)


def test_gemm_in_bf16_also_compares_float32_panels(fake_fixtures, capsys):
    out = _run_gemm(fake_fixtures, capsys, "--rows", "1", "--dtype", "bf16")
    if out is None:
        return
    assert "ar f32 panels" in out and "bf16 panels over f32 panels" in out and "the same tokens: True" in out


@pytest.mark.parametrize("subcommand, args, needle", [
    ("gemm", ["--rows", "0"], "--rows"),
    ("gemm", ["--repeats", "0"], "--repeats"),
    ("gemm", ["--dtype", "fp8"], "--dtype"),
    ("gemm", ["--isa", "avx2,sse"], "--isa"),
    ("gemm", ["--kernel-rows", "0"], "--kernel-rows"),
    ("profile", ["--method", "ar"], "--method"),
    ("profile", ["--method", "hf_generate"], "--method"),
    ("profile", ["--dtype", "fp8"], "--dtype"),
    ("profile", ["--num-prompts", "0"], "--num-prompts"),
])
def test_gemm_and_profile_bad_arguments(fake_fixtures, capsys, subcommand, args, needle):
    with pytest.raises(SystemExit) as exc:
        main([subcommand] + _model_args(fake_fixtures) + args)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


# ------------------------------------------------------------------ spec-bench tune
def test_tune_sweeps_shapes_on_the_shipped_fixtures(tmp_path, capsys):
    from spec_decode.fixtures import find_fixtures_dir

    fx = find_fixtures_dir()
    if fx is None or not (fx / "models/tiny-eagle").is_dir():
        pytest.skip("the shipped fixtures are not in this checkout")
    rc = main(["tune", "--num-prompts", "2", "--max-new-tokens", "8", "--shapes", "2/1/3,3/2/6",
               "--temperatures", "0,1", "--threads", "1", "--no-progress", "--dtype", "fp32", "--out", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "tune.json").read_text())
    assert r["config"]["first_prompt"] == 17 and r["config"]["method"] == "eagle"   # held out from spec-bench's
    assert r["config"]["shapes"] == [[2, 1, 3], [3, 2, 6]]
    assert set(r["by_temperature"]) == {"0", "1"} == set(r["best"])
    for t, entry in r["by_temperature"].items():
        assert set(entry["shapes"]) == {"2/1/3", "3/2/6"}
        assert entry["best"] in entry["shapes"] and entry["best"] == r["best"][t]
        assert entry["best_chain"] == "2/1/3" and entry["best_tree"] == "3/2/6"
        assert _is_num(entry["ar"]["tokens_per_s"]) and entry["ar"]["mean_accepted_length"] is None
        best_tps = max(e["tokens_per_s"] for e in entry["shapes"].values())
        assert entry["shapes"][entry["best"]]["tokens_per_s"] == best_tps
        for key, e in entry["shapes"].items():
            assert _is_num(e["tokens_per_s"]) and _is_num(e["speedup_vs_ar"])
            assert 1.0 <= e["mean_accepted_length"] <= e["num_steps"] + 1
            assert e["generated_tokens"] == 2 * 8
            assert e["chain"] is (key == "2/1/3")
    assert (tmp_path / "tune.png").read_bytes()[:8] == PNG_MAGIC
    assert "best" in capsys.readouterr().out


def test_tune_shapes_carry_a_tree_score_temperature(fake_fixtures, tmp_path):
    """``6/2/8@0.5``: the key keeps the temperature, and the decoder the shape builds scores with it."""
    from spec_decode.bench.config import BenchConfig, MethodSpec
    from spec_decode.bench.methods import ModelCache
    from spec_decode.bench.tune import parse_shapes, score_temperature, shape_key

    shapes = parse_shapes("4/1/5, 6/2/8@0.5, 6/2/8")
    assert shapes == ((4, 1, 5), (6, 2, 8, 0.5), (6, 2, 8))
    assert [shape_key(s) for s in shapes] == ["4/1/5", "6/2/8@0.5", "6/2/8"]
    assert [score_temperature(s) for s in shapes] == [None, 0.5, None]
    m = fake_fixtures / "models"
    cfg = BenchConfig(target=m / "tiny-target", draft_lm=m / "tiny-draft", eagle=m / "tiny-eagle",
                      eagle3=m / "tiny-eagle3", prompts=fake_fixtures / "prompts.jsonl", out=tmp_path,
                      num_prompts=2)
    models = ModelCache(cfg, "fp32", torch.device("cpu"))
    spec = MethodSpec("6/2/8@0.5", "ours", "eagle", "eagle", 6, 2, 8, score_temperature=0.5)
    assert models.runner(spec).decoder.tree_score_temperature == 0.5
    plain = MethodSpec("6/2/8", "ours", "eagle", "eagle", 6, 2, 8)
    assert models.runner(plain).decoder.tree_score_temperature == 1.0


def test_eagle3_lookup_chooses_its_drafts_up_to_lookup_tokens(fake_fixtures, tmp_path):
    from spec_decode.bench.config import METHOD_SPECS, BenchConfig
    from spec_decode.bench.methods import ModelCache

    m = fake_fixtures / "models"
    cfg = BenchConfig(target=m / "tiny-target", draft_lm=m / "tiny-draft", eagle=m / "tiny-eagle",
                      eagle3=m / "tiny-eagle3", prompts=fake_fixtures / "prompts.jsonl", out=tmp_path, num_prompts=2)
    models = ModelCache(cfg, "fp32", torch.device("cpu"))
    for key in ("eagle3_lookup", "eagle3_lookup_coupled"):
        runner = models.runner(METHOD_SPECS[key])
        assert (runner.decoder.lookup_tokens, runner.decoder.lookup_max_drafts) == ("auto", LOOKUP_TOKENS), key
        assert runner.describe()["lookup_max_tokens"] == LOOKUP_TOKENS and runner.lookup_costs() is None, key
    for key in ("lookup", "lookup_coupled", "eagle_lookup"):   # the library's default
        assert models.runner(METHOD_SPECS[key]).decoder.lookup_tokens == 8, key


def test_tune_default_grid_is_valid_and_has_chains(fake_fixtures):
    from spec_decode.bench.tune import DEFAULT_SHAPES, is_chain, score_temperature
    from spec_decode.models.eagle import load_drafter
    from spec_decode.pipeline import SpecDecoder

    assert 10 <= len(DEFAULT_SHAPES) <= 20 and len(set(DEFAULT_SHAPES)) == len(DEFAULT_SHAPES)
    assert sum(map(is_chain, DEFAULT_SHAPES)) >= 4 and not all(map(is_chain, DEFAULT_SHAPES))
    target = Transformer.from_pretrained(fake_fixtures / "models/tiny-target", dtype=torch.float32)
    head = load_drafter(fake_fixtures / "models/tiny-eagle", target, method="eagle")
    for shape in DEFAULT_SHAPES:   # no ValueError
        SpecDecoder(target, head, method="eagle", num_steps=shape[0], topk=shape[1], num_draft_tokens=shape[2],
                    tree_score_temperature=score_temperature(shape) or 1.0)
    assert any(score_temperature(s) is not None for s in DEFAULT_SHAPES)


@pytest.mark.parametrize("args, needle", [
    (["--shapes", "2/1"], "--shapes"),
    (["--shapes", "2/1/3,2/1/3"], "--shapes"),
    (["--shapes", "2/1/9"], "--shapes"),
    (["--shapes", "3/2/6@0"], "--shapes"),
    (["--shapes", "3/2/6@nan"], "--shapes"),
    (["--shapes", "3/1/4@0.5"], "--shapes"),
    (["--shapes", "3/2/6@0.5,3/2/6@0.50"], "--shapes"),
    (["--method", "medusa"], "--method"),
    (["--first-prompt", "2"], "--num-prompts"),
    (["--first-prompt", "-1"], "--first-prompt"),
    (["--temperatures", "-1"], "--temperatures"),
    (["--eagle", "absent-dir"], "--eagle"),
    (["--device", "tpu9"], "--device"),
])
def test_tune_bad_arguments(fake_fixtures, tmp_path, capsys, args, needle):
    with pytest.raises(SystemExit) as exc:
        main(["tune"] + _model_args(fake_fixtures) + ["--num-prompts", "2", "--max-new-tokens", "2",
                                                      "--first-prompt", "0", "--out", str(tmp_path),
                                                      "--no-progress"] + args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("spec-bench tune: error:") and needle in err, err
