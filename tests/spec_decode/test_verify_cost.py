"""``spec_decode.verify_cost``: verify block costs measured once, cached on disk, re-measured when in doubt."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from conftest import AVX2_LIKE, FLAT
from spec_decode import disk_cache, verify_cost
from spec_decode.models import Transformer
from spec_decode.verify_cost import cost_key, measure_verify_costs, time_verify_blocks

ROWS = range(1, 9)


def cache_files(root):
    return sorted(root.glob(f"{verify_cost.CACHE_PREFIX}*.json"))


def test_the_costs_are_relative_to_one_row_and_cached(verify_cost_curve, tiny_target, tmp_path):
    calls = verify_cost_curve(AVX2_LIKE)
    costs = measure_verify_costs(tiny_target, ROWS)
    assert costs == {n: AVX2_LIKE(n) for n in ROWS}
    assert len(calls) == 2   # a warm-up pass, then the timed one
    [path] = cache_files(tmp_path / "cache")
    assert json.loads(path.read_text())["key"] == cost_key(tiny_target)
    assert measure_verify_costs(tiny_target, ROWS) == costs and len(calls) == 2   # read back: no timing
    assert measure_verify_costs(tiny_target, range(1, 4)) == {n: costs[n] for n in range(1, 4)}
    assert len(calls) == 2   # fewer rows than cached: still read back
    assert measure_verify_costs(tiny_target, range(1, 12))[11] == AVX2_LIKE(11) and len(calls) == 4   # more: measured


@pytest.mark.parametrize("damage", [
    lambda d: "{not json",
    lambda d: json.dumps({**d, "key": {**d["key"], "torch_threads": 999}}),
    lambda d: json.dumps({**d, "costs": {**d["costs"], "3": float("nan")}}),
    lambda d: json.dumps({**d, "costs": {**d["costs"], "3": -1.0}}),
    lambda d: json.dumps({**d, "costs": {k: v for k, v in d["costs"].items() if k != "5"}}),
    lambda d: json.dumps([1, 2]),
], ids=["corrupt", "another-key", "nan", "negative", "missing-row", "not-a-dict"])
def test_a_damaged_or_mismatched_cache_file_is_measured_again(verify_cost_curve, tiny_target, tmp_path, damage):
    calls = verify_cost_curve(FLAT)
    want = measure_verify_costs(tiny_target, ROWS)
    [path] = cache_files(tmp_path / "cache")
    path.write_text(damage(json.loads(path.read_text())))
    assert measure_verify_costs(tiny_target, ROWS) == want and len(calls) == 4
    assert verify_cost.read_costs(path, cost_key(tiny_target), list(ROWS)) == want   # rewritten whole


def test_remeasuring_is_forced_by_the_argument_or_the_environment(verify_cost_curve, tiny_target, monkeypatch):
    calls = verify_cost_curve(FLAT)
    measure_verify_costs(tiny_target, ROWS)
    measure_verify_costs(tiny_target, ROWS, remeasure=True)
    assert len(calls) == 4
    monkeypatch.setenv(verify_cost.REMEASURE_ENV, "1")
    measure_verify_costs(tiny_target, ROWS)
    assert len(calls) == 6
    monkeypatch.setenv(verify_cost.REMEASURE_ENV, "0")
    measure_verify_costs(tiny_target, ROWS)
    assert len(calls) == 6


def test_the_key_changes_with_dtype_threads_and_model(tiny_target_dir, tiny_target, factories, tmp_path):
    key = cost_key(tiny_target)
    assert cost_key(Transformer.from_pretrained(tiny_target_dir, dtype=torch.bfloat16))["dtype"] != key["dtype"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert cost_key(tiny_target) != key
    finally:
        torch.set_num_threads(threads)
    other = Transformer.from_pretrained(factories.make_tiny_target(tmp_path / "wide", hidden_size=64),
                                        dtype=torch.float32)
    assert cost_key(other)["model_config"] != key["model_config"]
    assert cost_key(tiny_target) == key


def test_the_key_changes_with_the_kernels_source(tiny_target, monkeypatch):
    """Costs measured with one build of the CPU kernels are not another build's."""
    from spec_decode.cpu import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("the CPU kernels do not run here: the key holds no kernel tag")
    key = cost_key(tiny_target)
    assert key["cpu_kernels"] == cpu_gemm.kernel_tag()
    monkeypatch.setattr(cpu_gemm, "kernel_tag", lambda: "another-build")
    assert cost_key(tiny_target)["cpu_kernels"] == "another-build" != key["cpu_kernels"]


def test_an_unusable_cache_dir_measures_in_memory_with_one_warning(verify_cost_curve, tiny_target, tmp_path,
                                                                   monkeypatch):
    calls = verify_cost_curve(FLAT)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(blocker))
    monkeypatch.setattr(verify_cost, "CACHE_WARNED", set())
    with pytest.warns(RuntimeWarning, match="not cached"):
        assert measure_verify_costs(tiny_target, ROWS) == {n: FLAT(n) for n in ROWS}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measure_verify_costs(tiny_target, ROWS)   # measured again, without a second warning
    assert len(calls) == 4


@pytest.mark.parametrize("kw, name", [(dict(rows=[0, 1]), "rows"), (dict(rows=[1, 2.5]), "rows"),
                                      (dict(repeats=0), "repeats")])
def test_bad_arguments_are_named(tiny_target, kw, name):
    with pytest.raises(ValueError, match=name):
        measure_verify_costs(tiny_target, **kw)


def test_time_verify_blocks_times_every_size_and_commits_nothing(tiny_target):
    times = time_verify_blocks(tiny_target, [3, 4, 5], [4, 1, 2, 4], repeats=2)
    assert sorted(times) == [1, 2, 4]
    assert all(len(t) == 2 and all(s > 0 for s in t) for t in times.values())
