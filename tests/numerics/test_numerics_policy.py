"""NanPolicy.resolve and raise_if_nan_logits."""

import tracemalloc
from collections.abc import Mapping

import pytest

from numerics import NAN_POLICY_ENV, NanLogitsError, NanPolicy, raise_if_nan_logits


def test_resolve_default_env_and_explicit(monkeypatch):
    monkeypatch.delenv(NAN_POLICY_ENV, raising=False)
    assert NanPolicy.resolve() is NanPolicy.GUARD  # the default (issue 11)
    monkeypatch.setenv(NAN_POLICY_ENV, " Raise ")
    assert NanPolicy.resolve() is NanPolicy.RAISE
    assert NanPolicy.resolve("abort") is NanPolicy.ABORT  # explicit wins over the env
    assert NanPolicy.resolve(NanPolicy.OFF) is NanPolicy.OFF
    monkeypatch.setenv(NAN_POLICY_ENV, "")
    assert NanPolicy.resolve() is NanPolicy.GUARD
    monkeypatch.setenv(NAN_POLICY_ENV, "sanitize")
    assert NanPolicy.resolve() is NanPolicy.SANITIZE  # the env still overrides the default
    assert NanPolicy.resolve(" GUARD ") is NanPolicy.GUARD


def test_policy_is_a_str_enum():
    assert NanPolicy.RAISE == "raise"
    assert [p.value for p in NanPolicy] == ["off", "sanitize", "raise", "abort", "guard"]


def test_resolve_rejects_unknown_values(monkeypatch):
    with pytest.raises(ValueError, match="nan_policy"):
        NanPolicy.resolve("ignore")
    with pytest.raises(ValueError, match="nan_policy"):
        NanPolicy.resolve(3)
    monkeypatch.setenv(NAN_POLICY_ENV, "panic")
    with pytest.raises(ValueError, match=NAN_POLICY_ENV):
        NanPolicy.resolve()


def test_raise_lists_only_corrupted_ids():
    with pytest.raises(NanLogitsError) as info:
        raise_if_nan_logits({"req-0": 0, "req-1": 3, "req-2": 0, "req-3": 1})
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.nan_counts == {"req-1": 3, "req-3": 1}
    text = str(err)
    assert "req-1: 3" in text and "req-3: 1" in text
    assert "req-0" not in text and "req-2" not in text


class _SpyMapping(Mapping):
    """A mapping that records which accessors were used."""

    def __init__(self, data):
        self._data = data
        self.used = set()

    def __getitem__(self, key):
        self.used.add("getitem")
        return self._data[key]

    def __iter__(self):
        self.used.add("iter")
        return iter(self._data)

    def __len__(self):
        return len(self._data)

    def values(self):
        self.used.add("values")
        return self._data.values()

    def items(self):
        self.used.add("items")
        return self._data.items()


def test_zero_counts_return_without_building_anything():
    spy = _SpyMapping({f"req-{i}": 0 for i in range(64)})
    assert raise_if_nan_logits(spy) is None
    assert spy.used == {"values"}  # no items()/keys walk, hence no dict or message built
    counts = {f"req-{i}": 0 for i in range(64)}
    retained, peak = _traced_bytes(raise_if_nan_logits, counts)
    assert retained == 0
    # Mutant: filters into a dict first. Even its empty dict costs more than our values() walk.
    _, mutant_peak = _traced_bytes(_mutant_builds_dict, counts)
    assert peak < mutant_peak


def _mutant_builds_dict(counts):
    bad = {rid: n for rid, n in counts.items() if n}
    if bad:
        raise NanLogitsError(bad)


def _traced_bytes(fn, counts):
    fn(counts)  # warm up
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(100):
            fn(counts)
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return after - before, peak - before


def test_raise_rejects_non_mapping():
    with pytest.raises(ValueError, match="num_nans_in_logits"):
        raise_if_nan_logits([0, 1])
