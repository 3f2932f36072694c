"""AsyncNanWarner / maybe_warn_nan: one warning naming the site, then silence; flush."""

import logging

import pytest
import torch

from numerics import AsyncNanWarner, get_nan_warner, maybe_warn_nan, reset_nan_warner, sanitize_nan_logits
from numerics import warner as warner_module

NAN, INF = float("nan"), float("inf")


def _records(caplog):
    return [r for r in caplog.records if r.name == "safespec.numerics" and r.levelno == logging.WARNING]


def test_cpu_warns_exactly_once_and_names_the_site(nan_log):
    w = AsyncNanWarner()
    w.check(torch.ones(3), "clean_site")
    assert _records(nan_log) == [] and not w.flush()
    w.check(torch.tensor([1.0, NAN]), "verify.target_logits")
    w.check(torch.tensor([NAN]), "second_site")
    w.check(torch.tensor([NAN], dtype=torch.bfloat16), "third_site")
    records = _records(nan_log)
    assert len(records) == 1
    assert "verify.target_logits" in records[0].getMessage()
    assert w.flush() is True


def test_non_float_tensors_are_ignored(nan_log):
    w = AsyncNanWarner()
    w.check(torch.tensor([1, 2, 3]), "ints")
    assert not w.flush() and _records(nan_log) == []


@pytest.mark.parametrize("bad", [None, [1.0, NAN], 3.0])
def test_check_rejects_non_tensors_naming_tensor(bad):
    """Issue 10: check(None) used to raise AttributeError."""
    w = AsyncNanWarner()
    with pytest.raises(ValueError, match="tensor"):
        w.check(bad, "site")
    w.check(torch.tensor([NAN]), "site")
    with pytest.raises(ValueError, match="tensor"):  # also once warned
        w.check(bad, "site")
    with pytest.raises(ValueError, match="tensor"):
        maybe_warn_nan(bad, "site")


def test_inf_does_not_warn(nan_log):
    """One vocabulary: only NaN is reported; Inf is sanitized silently."""
    w = AsyncNanWarner()
    w.check(torch.tensor([INF, -INF, 1.0]), "site")
    assert not w.flush() and _records(nan_log) == []


def test_process_wide_instance_warns_once_until_reset(nan_log):
    maybe_warn_nan(torch.tensor([NAN]), "site_a")
    maybe_warn_nan(torch.tensor([NAN]), "site_b")
    assert [("site_a" in r.getMessage()) for r in _records(nan_log)] == [True]
    assert get_nan_warner().flush()
    reset_nan_warner()
    maybe_warn_nan(torch.tensor([NAN]), "site_c")
    assert len(_records(nan_log)) == 2 and "site_c" in _records(nan_log)[1].getMessage()


def test_sanitize_feeds_the_warner_before_replacing(nan_log):
    x = torch.tensor([[NAN, 0.0]])
    sanitize_nan_logits(x, "sampler.logits")
    assert "sampler.logits" in _records(nan_log)[0].getMessage()
    reset_nan_warner()
    sanitize_nan_logits(torch.tensor([[NAN, 0.0]]), "quiet", warn=False)
    assert len(_records(nan_log)) == 1


# ------------------------------------------- the async path, driven on CPU with fake events

class _FakeEvent:
    """Stands in for torch.cuda.Event: the test decides when a copy 'lands'."""

    def __init__(self):
        self.landed = True

    def record(self):
        self.landed = False

    def query(self):
        return self.landed

    def synchronize(self):
        self.landed = True


class _FakeSlot:
    def __init__(self):
        self.host_flag = torch.zeros(1, dtype=torch.bool)
        self.event = _FakeEvent()
        self.msg = ""


class _AsyncOnCpu(AsyncNanWarner):
    def _uses_async_path(self, tensor):
        return True

    def _new_slot(self):
        slot = _FakeSlot()
        self.slots.append(slot)
        return slot

    def __init__(self, **kw):
        super().__init__(**kw)
        self.slots = []


def test_async_path_reports_one_step_stale(nan_log):
    w = _AsyncOnCpu()
    w.check(torch.tensor([NAN]), "step0")
    assert _records(nan_log) == []  # flag still "in flight"
    w.slots[0].event.landed = True
    w.check(torch.ones(2), "step1")  # reads step0's flag
    records = _records(nan_log)
    assert len(records) == 1 and "step0" in records[0].getMessage()
    w.check(torch.tensor([NAN]), "step2")
    assert len(w.slots) == 1  # stopped detecting: no new flag was enqueued
    assert w.flush() and len(_records(nan_log)) == 1


def test_async_path_never_reads_a_flag_that_has_not_landed(nan_log):
    w = _AsyncOnCpu(max_in_flight=2)
    w.check(torch.tensor([NAN]), "a")
    w.check(torch.tensor([NAN]), "b")
    w.check(torch.tensor([NAN]), "c")  # both slots busy: skipped, not blocked
    assert w.skipped_checks == 1 and len(w.slots) == 2
    assert _records(nan_log) == []
    assert w.flush() is True  # flush waits for the copies
    records = _records(nan_log)
    assert len(records) == 1 and "a" in records[0].getMessage()


def test_async_path_recycles_landed_clean_slots(nan_log):
    w = _AsyncOnCpu(max_in_flight=1)
    for step in range(5):
        w.check(torch.ones(3), f"clean{step}")
        w.slots[0].event.landed = True
    assert len(w.slots) == 1 and w.skipped_checks == 0
    assert not w.flush() and _records(nan_log) == []


def test_bad_max_in_flight():
    with pytest.raises(ValueError, match="max_in_flight"):
        AsyncNanWarner(max_in_flight=0)


def test_logger_name_is_stable():
    assert warner_module.logger.name == "safespec.numerics"
