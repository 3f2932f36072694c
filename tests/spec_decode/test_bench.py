"""spec-bench: the results.json contract, the figure, the numerics subcommand and argument errors.

Runs the real benchmark on random tiny models with a tiny setting. It asserts what the output
promises (keys, types, losslessness flags, a valid PNG), never a speed.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spec_decode.bench import main
from spec_decode.bench.config import METHOD_KEYS
from spec_decode.bench.numerics_bench import sglang_style, vllm_style
from spec_decode.bench.report import markdown_table
from spec_decode.bench.run import CONTRACT_KEYS, percentile
from spec_decode.model import Transformer
from tiny_models import make_tiny_eagle, make_tiny_eagle3, make_tiny_target

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
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


def test_results_json_follows_the_contract(bench_run):
    _, r = bench_run
    assert {"machine", "config", "methods", "nan_policy_overhead_pct"} <= set(r)
    assert set(r["methods"]) == set(METHOD_KEYS)
    for key in ("cpu", "cpu_cores", "torch", "transformers", "date", "torch_threads"):
        assert key in r["machine"]
    assert r["machine"]["torch_threads"] == 1
    assert r["config"]["num_prompts"] == NUM_PROMPTS and r["config"]["max_new_tokens"] == MAX_NEW
    assert r["config"]["method_configs"]["eagle_chain"] == {"engine": "ours", "method": "eagle", "drafter": "eagle",
                                                            "num_steps": 4, "topk": 1, "num_draft_tokens": 5}
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
    for key in ("draft_chain", "eagle_chain", "eagle_tree", "eagle3_tree"):
        e = r["methods"][key]
        depth = r["config"]["method_configs"][key]["num_steps"]
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


def test_nan_policy_stage_reports_both_modes(bench_run):
    _, r = bench_run
    assert set(r["nan_policy_overhead_pct"]) == {"sanitize", "abort"}
    assert all(_is_num(v) for v in r["nan_policy_overhead_pct"].values())
    detail = r["nan_policy"]
    assert set(detail["tokens_per_s"]) == {"off", "sanitize", "abort"}
    assert detail["nan_pass_ms"] > 0


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
    assert r["nan_policy_overhead_pct"] == {"sanitize": None, "abort": None}
    assert (tmp_path / "results.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("args, needle", [
    (["--methods", "ar,beam_search"], "beam_search"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--num-prompts", "50"], "exceeds"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--dtype", "fp8"], "--dtype"),
    (["--temperatures", "-1"], "--temperatures"),
    (["--batch-size", "0"], "--batch-size"),
])
def test_bad_arguments_name_the_option(fake_fixtures, tmp_path, capsys, args, needle):
    with pytest.raises(SystemExit) as exc:
        main(_model_args(fake_fixtures) + ["--out", str(tmp_path)] + args)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_missing_target_is_a_clear_error(fake_fixtures, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(_model_args(fake_fixtures, target=tmp_path / "nowhere") + ["--out", str(tmp_path)])
    assert "--target" in capsys.readouterr().err


def test_numerics_subcommand_writes_records(tmp_path, capsys):
    rc = main(["numerics", "--rows", "8,16", "--vocabs", "99", "--dtypes", "fp32,bf16", "--min-run-time", "0.01",
               "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "numerics.json").read_text())
    recs = data["results"]
    assert {r["impl"] for r in recs} == {"copy", "ours_torch", "sglang_style", "vllm_style"}
    assert len(recs) == 2 * 2 * 1 * 4
    for rec in recs:
        assert rec["median_ms"] > 0 and rec["gb_s"] > 0 and rec["fraction_of_copy"] > 0
        assert rec["requests"] == rec["rows"] // 8
    assert "ours_torch" in capsys.readouterr().out


@pytest.mark.parametrize("args, needle", [
    (["--rows", "12"], "multiple of 8"),
    (["--dtypes", "fp16x"], "--dtypes"),
    (["--vocabs", "a"], "--vocabs"),
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
                          cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--num-prompts" in proc.stdout and "--methods" in proc.stdout


def test_profile_subcommand_reports_stages(fake_fixtures, capsys):
    rc = main(["profile"] + _model_args(fake_fixtures) + ["--method", "eagle_tree", "--num-prompts", "1",
                                                          "--max-new-tokens", "4"])
    assert rc == 0
    out = capsys.readouterr().out
    for label in ("target forward", "drafter forward", "drafting", "tree_verify", "NaN count"):
        assert label in out, label
