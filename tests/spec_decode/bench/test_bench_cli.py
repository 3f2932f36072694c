"""spec-bench's command line rejects bad values up front (issue 40, item 6), and measures fixed-length outputs.

Each probe runs ``main([...])`` with one bad value and must exit with status 2 and one error line naming
the option the user typed, before any model loads or anything is timed: the ``no_work`` fixture makes
every model loader, every ``generate`` call and the micro-benchmark's timer raise, so that a check that
comes too late fails the probe instead of running (or, for ``--min-run-time nan``, hanging).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spec_decode.bench import main
from spec_decode.models import Transformer
from tiny_models import make_tiny_eagle, make_tiny_target

POSITIONS = 256   # the tiny target's max_position_embeddings
PROMPT_LENGTHS = (5, 8, 11)   # the longest prompt a run reads decides how many new tokens fit
MAX_SEED = 2**63 - 1


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    """models/{tiny-target,tiny-eagle} + prompts.jsonl; every token is an EOS of the target."""
    root = tmp_path_factory.mktemp("cli_fixtures")
    target_dir = make_tiny_target(root / "models", name="tiny-target", max_position_embeddings=POSITIONS)
    (target_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(97))}))
    make_tiny_eagle(Transformer.from_pretrained(target_dir, dtype=torch.float32), root / "models" / "tiny-eagle")
    g = torch.Generator().manual_seed(0)
    with open(root / "prompts.jsonl", "w") as f:
        for n in PROMPT_LENGTHS:
            f.write(json.dumps({"token_ids": torch.randint(97, (n,), generator=g).tolist()}) + "\n")
    return root


class WorkStarted(Exception):
    """Raised by ``no_work``'s stand-ins: the command got past its checks."""


@pytest.fixture
def no_work(monkeypatch):
    """Make loading a model, generating and timing raise WorkStarted."""
    import torch.utils.benchmark

    from spec_decode.models import eagle
    from spec_decode.pipeline import SpecDecoder

    def refuse(*args, **kwargs):
        raise WorkStarted("a model loaded or work ran before the bad value was rejected")

    monkeypatch.setattr(Transformer, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(eagle, "load_drafter", refuse)
    monkeypatch.setattr(SpecDecoder, "generate", refuse)
    monkeypatch.setattr(torch.utils.benchmark, "Timer", refuse)


def _truncated(fx: Path, name: str, tmp: Path) -> Path:
    dst = shutil.copytree(fx / "models" / name, tmp / f"{name}-truncated")
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[:len(data) // 2])
    return dst


def _head_for_another_target(fx: Path, tmp: Path) -> Path:
    """The tiny EAGLE head with its hidden size doubled in its config: a head made for another target."""
    dst = shutil.copytree(fx / "models" / "tiny-eagle", tmp / "eagle-for-another-target")
    config = json.loads((dst / "config.json").read_text())
    config["hidden_size"] *= 2
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _file(tmp: Path) -> Path:
    path = tmp / "existing-file"
    path.write_text("x")
    return path


def _gguf(tmp: Path) -> Path:
    path = tmp / "model.gguf"
    path.write_text("a file where a checkpoint directory goes")
    return path


def _inputs(fx: Path) -> list:
    m = fx / "models"
    return ["--target", m / "tiny-target", "--eagle", m / "tiny-eagle", "--prompts", fx / "prompts.jsonl"]


def _base(sub: str, fx: Path, tmp: Path) -> list:
    """A valid command line of subcommand ``sub`` ("" = the main run) that the probe adds one bad value to."""
    small = ["--num-prompts", "1", "--max-new-tokens", "2"]
    return {
        "": _inputs(fx) + small + ["--methods", "ar", "--nan-rounds", "0", "--no-progress", "--out", tmp / "out"],
        "tune": ["tune"] + _inputs(fx) + small + ["--first-prompt", "0", "--shapes", "2/1/3", "--no-progress",
                                                  "--out", tmp / "out"],
        "profile": ["profile"] + _inputs(fx) + small + ["--method", "eagle_chain"],
        "compile": ["compile"] + _inputs(fx) + small,
        "gemm": ["gemm"] + _inputs(fx) + small + ["--repeats", "1"],
        "numerics": ["numerics", "--device", "cpu", "--rows", "8", "--vocabs", "99", "--dtypes", "fp32",
                     "--min-run-time", "0.01", "--out", tmp / "out"],
    }[sub]


# name -> (subcommand, fn(fixtures, tmp) -> bad values, the option the error line must name)
PROBES = {
    # issue 40 item 6, as filed
    "numerics_min_run_time_nan": ("numerics", lambda fx, t: ["--min-run-time", "nan"], "--min-run-time"),
    "numerics_min_run_time_inf": ("numerics", lambda fx, t: ["--min-run-time", "inf"], "--min-run-time"),
    "numerics_min_run_time_negative": ("numerics", lambda fx, t: ["--min-run-time", "-1"], "--min-run-time"),
    "max_new_tokens_past_positions": ("", lambda fx, t: ["--max-new-tokens", "5000"], "--max-new-tokens"),
    # 8 (the longest prompt read: the measured one and the warm-up) + 249 > 256
    "max_new_tokens_past_positions_with_the_prompt": ("", lambda fx, t: ["--max-new-tokens", "249"],
                                                      "--max-new-tokens"),
    "tune_max_new_tokens_past_positions": ("tune", lambda fx, t: ["--max-new-tokens", "5000"], "--max-new-tokens"),
    "profile_max_new_tokens_past_positions": ("profile", lambda fx, t: ["--max-new-tokens", "5000"],
                                              "--max-new-tokens"),
    "compile_max_new_tokens_past_positions": ("compile", lambda fx, t: ["--max-new-tokens", "5000"],
                                              "--max-new-tokens"),
    "seed_negative": ("", lambda fx, t: ["--seed", "-1"], "--seed"),
    "seed_huge": ("", lambda fx, t: ["--seed", "99999999999999999999999"], "--seed"),
    "seed_2_pow_63": ("", lambda fx, t: ["--seed", str(2**63)], "--seed"),
    "tune_seed_negative": ("tune", lambda fx, t: ["--seed", "-1"], "--seed"),
    "tune_seed_huge": ("tune", lambda fx, t: ["--seed", "99999999999999999999999"], "--seed"),
    "profile_json_dir_missing": ("profile", lambda fx, t: ["--json", "/nonexistent/dir/x.json"], "--json"),
    "profile_json_is_a_dir": ("profile", lambda fx, t: ["--json", t], "--json"),
    "numerics_out_is_a_file": ("numerics", lambda fx, t: ["--out", _file(t)], "--out"),
    "gemm_target_truncated": ("gemm", lambda fx, t: ["--target", _truncated(fx, "tiny-target", t)], "--target"),
    "gemm_target_missing": ("gemm", lambda fx, t: ["--target", t / "absent"], "--target"),
    "gemm_eagle_truncated": ("gemm", lambda fx, t: ["--eagle", _truncated(fx, "tiny-eagle", t)], "--eagle"),
    "gemm_eagle_missing": ("gemm", lambda fx, t: ["--eagle", t / "absent"], "--eagle"),
    "gemm_eagle_for_another_target": ("gemm", lambda fx, t: ["--eagle", _head_for_another_target(fx, t)], "--eagle"),
    "compile_target_truncated": ("compile", lambda fx, t: ["--target", _truncated(fx, "tiny-target", t)],
                                 "--target"),
    "compile_target_missing": ("compile", lambda fx, t: ["--target", t / "absent"], "--target"),
    "compile_eagle_truncated": ("compile", lambda fx, t: ["--eagle", _truncated(fx, "tiny-eagle", t)], "--eagle"),
    "compile_eagle_missing": ("compile", lambda fx, t: ["--eagle", t / "absent"], "--eagle"),
    "compile_prompts_missing": ("compile", lambda fx, t: ["--prompts", t / "absent.jsonl"], "--prompts"),
    "compile_threads_zero": ("compile", lambda fx, t: ["--threads", "0"], "--threads"),
    "methods_empty_item": ("", lambda fx, t: ["--methods", "ar,,eagle_chain"], "--methods"),
    "methods_twice": ("", lambda fx, t: ["--methods", "ar,ar"], "--methods"),
    "methods_empty": ("", lambda fx, t: ["--methods", ""], "--methods"),
    "dtype_empty": ("", lambda fx, t: ["--dtype", ""], "--dtype"),
    "dtype_twice": ("", lambda fx, t: ["--dtype", "bf16,bf16"], "--dtype"),
    "tune_dtype_empty": ("tune", lambda fx, t: ["--dtype", ""], "--dtype"),
    "profile_dtype_empty": ("profile", lambda fx, t: ["--dtype", ""], "--dtype"),
    "compile_dtype_empty": ("compile", lambda fx, t: ["--dtype", ""], "--dtype"),
    "profile_cprofile_negative": ("profile", lambda fx, t: ["--cprofile", "-3"], "--cprofile"),
    "device_cpu_index": ("", lambda fx, t: ["--device", "cpu:7"], "--device"),
    "tune_device_cpu_index": ("tune", lambda fx, t: ["--device", "cpu:7"], "--device"),
    "profile_device_cpu_index": ("profile", lambda fx, t: ["--device", "cpu:7"], "--device"),
    "batch_size_above_num_prompts": ("", lambda fx, t: ["--batch-size", "1000"], "--batch-size"),
    "batch_size_negative": ("", lambda fx, t: ["--batch-size", "-1"], "--batch-size"),
    "profile_temperature_negative": ("profile", lambda fx, t: ["--temperature", "-1"], "--temperature"),
    # the other numeric options
    "profile_temperature_nan": ("profile", lambda fx, t: ["--temperature", "nan"], "--temperature"),
    "profile_num_prompts_negative": ("profile", lambda fx, t: ["--num-prompts", "-2"], "--num-prompts"),
    "profile_threads_zero": ("profile", lambda fx, t: ["--threads", "0"], "--threads"),
    "temperatures_nan": ("", lambda fx, t: ["--temperatures", "nan"], "--temperatures"),
    "temperatures_empty_item": ("", lambda fx, t: ["--temperatures", "0,,1"], "--temperatures"),
    "temperatures_twice": ("", lambda fx, t: ["--temperatures", "0,0.0"], "--temperatures"),
    "tune_temperatures_empty_item": ("tune", lambda fx, t: ["--temperatures", "0,,1"], "--temperatures"),
    "num_prompts_negative": ("", lambda fx, t: ["--num-prompts", "-1"], "--num-prompts"),
    "nan_rounds_negative": ("", lambda fx, t: ["--nan-rounds", "-1"], "--nan-rounds"),
    "threads_zero": ("", lambda fx, t: ["--threads", "0"], "--threads"),
    "tune_threads_zero": ("tune", lambda fx, t: ["--threads", "0"], "--threads"),
    "tune_num_prompts_zero": ("tune", lambda fx, t: ["--num-prompts", "0"], "--num-prompts"),
    "compile_num_prompts_zero": ("compile", lambda fx, t: ["--num-prompts", "0"], "--num-prompts"),
    "gemm_rows_empty_item": ("gemm", lambda fx, t: ["--rows", "1,,2"], "--rows"),
    "gemm_max_new_tokens_past_positions": ("gemm", lambda fx, t: ["--max-new-tokens", "5000"], "--max-new-tokens"),
    "gemm_num_prompts_negative": ("gemm", lambda fx, t: ["--num-prompts", "-1"], "--num-prompts"),
    "numerics_rows_empty_item": ("numerics", lambda fx, t: ["--rows", "8,,16"], "--rows"),
    "numerics_dtypes_twice": ("numerics", lambda fx, t: ["--dtypes", "fp32,fp32"], "--dtypes"),
    "numerics_threads_zero": ("numerics", lambda fx, t: ["--threads", "0"], "--threads"),
    # issue 51 (hostile probes, round 3): sizes that allocate or run for as long as they say are bounded
    "numerics_rows_past_memory": ("numerics", lambda fx, t: ["--rows", "16000000"], "--rows"),
    "numerics_vocabs_past_memory": ("numerics", lambda fx, t: ["--vocabs", "10000000000"], "--vocabs"),
    "numerics_min_run_time_huge": ("numerics", lambda fx, t: ["--min-run-time", "1e300"], "--min-run-time"),
    "threads_past_the_cpus": ("", lambda fx, t: ["--threads", "1000"], "--threads"),
    "tune_threads_past_the_cpus": ("tune", lambda fx, t: ["--threads", "1000"], "--threads"),
    "profile_threads_past_the_cpus": ("profile", lambda fx, t: ["--threads", "1000"], "--threads"),
    "compile_threads_past_the_cpus": ("compile", lambda fx, t: ["--threads", "1000"], "--threads"),
    "numerics_threads_past_the_cpus": ("numerics", lambda fx, t: ["--threads", "1000"], "--threads"),
    "out_empty": ("", lambda fx, t: ["--out", ""], "--out"),
    "tune_out_empty": ("tune", lambda fx, t: ["--out", ""], "--out"),
    "numerics_out_empty": ("numerics", lambda fx, t: ["--out", ""], "--out"),
    "tune_shapes_trailing_at": ("tune", lambda fx, t: ["--shapes", "5/2/8@"], "--shapes"),
    "prompts_dev_null": ("", lambda fx, t: ["--prompts", "/dev/null"], "--prompts"),
    "compile_prompts_a_directory": ("compile", lambda fx, t: ["--prompts", t], "--prompts"),
    "temperatures_zero_twice_in_float32": ("", lambda fx, t: ["--temperatures", "0,1e-46"], "--temperatures"),
    "temperatures_past_float32": ("", lambda fx, t: ["--temperatures", "1e39"], "--temperatures"),
    "profile_temperature_past_float32": ("profile", lambda fx, t: ["--temperature", "1e39"], "--temperature"),
    # issue 67 (hostile probes, round 4)
    "profile_verify_tokens_past_positions": ("profile", lambda fx, t: ["--verify-tokens", "1000000"],
                                             "--verify-tokens"),
    "profile_json_in_a_directory_that_takes_no_file": ("profile", lambda fx, t: ["--json", "/proc/split.json"],
                                                       "--json"),
    "eagle_a_gguf_file": ("", lambda fx, t: ["--eagle", _gguf(t)], "--eagle"),
    "draft_lm_a_file": ("", lambda fx, t: ["--draft-lm", _file(t)], "--draft-lm"),
    "tune_eagle3_a_gguf_file": ("tune", lambda fx, t: ["--eagle3", _gguf(t)], "--eagle3"),
}


@pytest.mark.parametrize("probe", list(PROBES))
def test_bad_value_exits_2_naming_the_option_before_any_work(fx, tmp_path, capsys, no_work, probe):
    sub, bad, option = PROBES[probe]
    argv = [str(a) for a in _base(sub, fx, tmp_path) + bad(fx, tmp_path)]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    # the option the user typed, not a longer one that starts with it (--temperature, not --temperatures)
    assert re.search(re.escape(option) + r"(?![\w-])", errors[0]), errors[0]
    assert not (tmp_path / "out" / "results.json").exists()


def test_min_run_time_nan_returns_at_once_from_the_console_entry():
    """The entry point itself, no stand-ins: it once timed forever."""
    proc = subprocess.run([sys.executable, "-m", "spec_decode.bench", "numerics", "--min-run-time", "nan"],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 2, proc.stderr
    assert "--min-run-time" in proc.stderr.strip().splitlines()[-1]


def test_help_says_eos_is_ignored(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "ignoring EOS" in " ".join(capsys.readouterr().out.split())


@pytest.fixture
def generate_calls(monkeypatch):
    """The keyword arguments of every ``SpecDecoder.generate`` call."""
    from spec_decode.pipeline import SpecDecoder

    calls, real = [], SpecDecoder.generate

    def spy(self, prompts, **kwargs):
        calls.append(kwargs)
        return real(self, prompts, **kwargs)

    monkeypatch.setattr(SpecDecoder, "generate", spy)
    return calls


def test_every_generate_call_ignores_eos_and_results_say_so(fx, tmp_path, generate_calls):
    """Every token is an EOS of the tiny target: a call that stopped there would come up short."""
    rc = main([str(a) for a in _inputs(fx)] + ["--num-prompts", "2", "--max-new-tokens", "4", "--batch-size", "2",
                                               "--methods", "ar,eagle_chain", "--temperatures", "0,1",
                                               "--nan-rounds", "1", "--threads", "1", "--no-progress",
                                               "--out", str(tmp_path)])
    assert rc == 0
    assert generate_calls and all(c.get("ignore_eos") is True for c in generate_calls)
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["config"]["ignore_eos"] is True
    assert r["methods"]["eagle_chain"]["generated_tokens"] == 2 * 4


def test_profile_generates_ignoring_eos(fx, generate_calls, capsys):
    inputs = [str(a) for a in _inputs(fx)]
    assert main(["profile"] + inputs + ["--num-prompts", "1", "--max-new-tokens", "3", "--threads", "1",
                                        "--cprofile", "2"]) == 0
    assert generate_calls and all(c.get("ignore_eos") is True for c in generate_calls)


def test_compile_and_gemm_generate_ignoring_eos():
    """``compile_ab.measure``, the end-to-end loop of ``spec-bench compile`` and ``gemm`` (a compiled run is slow
    to build: a recording decoder stands in)."""
    import types

    from spec_decode.bench.compile_ab import measure

    class Recorder:
        def __init__(self):
            self.calls = []

        def generate(self, prompts, **kwargs):
            self.calls.append(kwargs)
            return [types.SimpleNamespace(token_ids=[0] * kwargs["max_new_tokens"]) for _ in prompts]

    dec = Recorder()
    measure({"ar": dec}, [[1, 2], [3]], [4], 5)
    assert dec.calls == [dict(max_new_tokens=5, ignore_eos=True)] * 3


def test_the_largest_seed_runs_sampled_batches(fx, tmp_path):
    """Seeds derived per batch and per row stay inside [0, 2**63): the largest seed is a seed like any other."""
    rc = main([str(a) for a in _inputs(fx)] + ["--num-prompts", "2", "--max-new-tokens", "3", "--batch-size", "2",
                                               "--methods", "ar,eagle_chain", "--temperatures", "1",
                                               "--nan-rounds", "0", "--threads", "1", "--no-progress",
                                               "--seed", str(MAX_SEED), "--out", str(tmp_path)])
    assert rc == 0
    assert json.loads((tmp_path / "results.json").read_text())["config"]["seed"] == MAX_SEED


def test_tune_reads_the_prompts_it_measures_for_the_position_check(fx, tmp_path, capsys, no_work):
    """From --first-prompt 1 the longest prompt read is 11 tokens, and 11 + 246 > 256 (from prompt 0: 8 + 246 fit)."""
    argv = [str(a) for a in _base("tune", fx, tmp_path)] + ["--first-prompt", "1", "--max-new-tokens", "246"]
    with pytest.raises(SystemExit):
        main(argv)
    assert "--max-new-tokens" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("module", ["tqdm", "matplotlib", "safetensors"])
def test_missing_bench_extra_names_it(monkeypatch, capsys, module):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    from spec_decode.bench.cli import main

    assert main(["--methods", "ar"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and module in err[0] and 'safespec[bench]' in err[0]
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0


def test_hf_methods_without_transformers_name_the_extra(monkeypatch, capsys, no_work):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    from spec_decode.bench.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--methods", "ar,hf_generate"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--methods" in err[-1] and "transformers" in err[-1] and "safespec[bench]" in err[-1]


# ---------------------------------------------------------------- issue 51: hostile probes, round 3
@pytest.mark.parametrize("sub, name", [("", "results.json"), ("", "results.png"), ("tune", "tune.json"),
                                       ("numerics", "numerics.json")])
def test_a_directory_where_a_result_goes_exits_2_before_any_work(fx, tmp_path, capsys, no_work, sub, name):
    """A directory named like the run's output file inside --out failed only after the whole run was measured."""
    (tmp_path / "out" / name).mkdir(parents=True)
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in _base(sub, fx, tmp_path)])
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "--out" in errors[0] and name in errors[0], errors


def test_prompts_that_are_not_a_regular_file_say_so(fx, tmp_path, capsys, no_work):
    with pytest.raises(SystemExit):
        main([str(a) for a in _base("", fx, tmp_path)] + ["--prompts", "/dev/null"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "not a regular file" in line and "no file at" not in line, line


@pytest.mark.parametrize("sub", ["compile", "gemm"])
def test_a_bad_fixtures_variable_is_named_not_a_download(tmp_path, monkeypatch, capsys, no_work, sub):
    """The default paths come from $SAFESPEC_FIXTURES_DIR: its value is at fault, not a missing download."""
    monkeypatch.setenv("SAFESPEC_FIXTURES_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit) as exc:
        main([sub, "--num-prompts", "1"])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--target" in line and "SAFESPEC_FIXTURES_DIR" in line and "download" not in line, line


def _printed_the_split(out: str) -> bool:
    return "verify_forward" in out


def _printed_the_verify_block(out: str) -> bool:
    return "2-token verify forward" in out and json.loads(out[out.index("{"):])["block_tokens"] == 2


@pytest.mark.parametrize("args,printed", [(["--max-new-tokens", "2"], _printed_the_split),
                                          (["--verify-tokens", "2"], _printed_the_verify_block)],
                         ids=["split", "verify_tokens"])
def test_profile_json_that_cannot_be_written_exits_2_keeping_the_result(fx, capsys, args, printed):
    """A ``--json`` that fails only on writing: exit 2 naming ``--json``, no traceback, and what was
    measured printed before (the split, or the ``--verify-tokens`` line and its JSON): nothing is lost."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    inputs = [str(a) for a in _inputs(fx)]
    with pytest.raises(SystemExit) as exc:
        main(["profile"] + inputs + ["--num-prompts", "1", *args, "--threads", "1", "--json", "/dev/full"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert "--json /dev/full" in captured.err.strip().splitlines()[-1]
    assert printed(captured.out)


def test_profile_verify_tokens_past_positions_names_it_and_its_bound(fx, capsys, no_work):
    """The user passed ``--verify-tokens``, not ``--max-new-tokens``: the message names the option typed
    and how many tokens fit after the longest prompt read (the measured one and the warm-up)."""
    inputs = [str(a) for a in _inputs(fx)]
    with pytest.raises(SystemExit) as exc:
        main(["profile"] + inputs + ["--num-prompts", "1", "--verify-tokens", "1000000"])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--verify-tokens 1000000" in line and "--max-new-tokens" not in line, line
    assert f"at most {POSITIONS - max(PROMPT_LENGTHS[:2])} fit" in line, line


def test_a_gguf_drafter_says_what_a_gguf_file_loads_as(fx, tmp_path, capsys, no_work):
    """The file exists: the message says a GGUF file loads only as a target, not that a directory is
    missing (nor that its methods were skipped)."""
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in _base("", fx, tmp_path)] + ["--eagle", str(_gguf(tmp_path))])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--eagle" in line and "is a file" in line and "only as a target" in line, line


def test_a_gguf_target_that_is_not_gguf_exits_2_naming_target(fx, tmp_path, capsys, monkeypatch, no_work):
    monkeypatch.setenv("SAFESPEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in _base("", fx, tmp_path)] + ["--target", str(_gguf(tmp_path))])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "--target" in line and "not a readable GGUF file" in line, line


@pytest.fixture
def no_suite_work(monkeypatch):
    """Make the suite's first step (the real model's cached target) raise WorkStarted."""
    from spec_decode import fixtures

    def refuse():
        raise WorkStarted("the suite started before the bad value was rejected")

    monkeypatch.setattr(fixtures, "smollm2_target_dir", refuse)


@pytest.mark.parametrize("bad, option, says", [
    (["--threads", "1000"], "--threads", "at most"),   # bounded as in every other subcommand
    (["--methods", "ar,hf_assisted"], "--methods", "--suite smollm2 does not take"),
    (["--methods", "draft_chain"], "--methods", "--suite smollm2 does not take"),
], ids=["threads_past_the_cpus", "hf_assisted", "draft_chain"])
def test_suite_bad_value_exits_2_naming_the_option_before_any_work(tmp_path, capsys, no_suite_work, bad, option,
                                                                    says):
    """``--suite smollm2`` bounds ``--threads`` by the CPUs as plain ``spec-bench`` does, and refuses a method
    that needs a draft LM up front, saying that the suite takes none (it has no ``--draft-lm`` to pass)."""
    with pytest.raises(SystemExit) as exc:
        main(["--suite", "smollm2", "--out", str(tmp_path / "out"), *bad])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(re.escape(option) + r"(?![\w-])", line) and says in line, line


def test_a_temperature_that_is_0_in_float32_is_greedy_on_the_command_line():
    """``1e-46`` is 0 in float32, as the library holds temperatures: the CLI takes it as 0 (greedy), so the
    bench neither seeds it nor asks HF to sample, and ``profile`` reports temperature 0."""
    from spec_decode.bench.args import nonneg_float
    from spec_decode.bench.profile_step import build_parser as profile_parser
    from spec_decode.bench.side_by_side import build_parser as bench_parser

    assert nonneg_float("1e-46") == 0.0 and nonneg_float("1e-30") == 1e-30
    assert bench_parser().parse_args(["--temperatures", "1e-46,1"]).temperatures == (0.0, 1.0)
    assert profile_parser().parse_args(["--temperature", "1e-46"]).temperature == 0.0


@pytest.mark.parametrize("sub", ["compile", "gemm"])
def test_dtype_help_names_every_dtype_accepted(capsys, sub):
    with pytest.raises(SystemExit):
        main([sub, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "fp32, bf16, fp16" in text and "fp32 or bf16" not in text
