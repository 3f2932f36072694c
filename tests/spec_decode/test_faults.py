"""NanFault and FaultPlan: whole-row and partial (``columns=``) faults, validation, no host sync."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from numerics import nonfinite_counts_per_request
from spec_decode.faults import FAULT_SITES, FaultPlan, NanFault

NAN, INF = float("nan"), float("inf")


def test_whole_row_is_the_default():
    x = torch.zeros(3, 2, 5)
    FaultPlan([NanFault(request=2, step=1, site="target_logits")], 3).apply(x, 1, "target_logits", [0, 2])
    assert torch.isnan(x[1]).all() and torch.isfinite(x[0]).all() and torch.isfinite(x[2]).all()


@pytest.mark.parametrize("site,shape", [("target_logits", (3, 4, 50)), ("draft_logits", (3, 50)),
                                        ("target_hidden", (3, 6, 50))])
def test_columns_fill_only_those_entries(site, shape):
    x = torch.zeros(shape)
    fault = NanFault(request=1, step=2, site=site, value=-INF, columns=[7, 3, 4, 5, 49, 3])
    assert fault.columns == (3, 4, 5, 7, 49)  # sorted, deduplicated
    plan = FaultPlan([fault], 3)
    plan.apply(x, 1, site, [0, 1, 2])  # other step: nothing
    assert torch.isfinite(x).all()
    plan.apply(x, 2, site, [0, 1, 2])
    expected = torch.zeros(shape, dtype=torch.bool)
    expected[1, ..., [3, 4, 5, 7, 49]] = True
    assert torch.equal(torch.isinf(x), expected)
    assert (x[expected] == -INF).all()


def test_partial_fault_leaves_rows_alive_and_whole_fault_kills_them():
    """The two cases ``guard`` tells apart, as the numerics pass counts them."""
    B, N, V = 3, 4, 64
    cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32)
    partial, whole = torch.randn(B, N, V), torch.randn(B, N, V)
    FaultPlan([NanFault(1, 1, "target_logits", columns=range(10, 13))], B).apply(partial, 1, "target_logits", [0, 1, 2])
    FaultPlan([NanFault(1, 1, "target_logits")], B).apply(whole, 1, "target_logits", [0, 1, 2])
    p = nonfinite_counts_per_request(partial.view(B * N, V), cu)
    w = nonfinite_counts_per_request(whole.view(B * N, V), cu)
    assert p.nan.tolist() == [0, 3 * N, 0] and p.dead_rows.tolist() == [0, 0, 0]
    assert w.nan.tolist() == [0, N * V, 0] and w.dead_rows.tolist() == [0, N, 0]


def test_columns_beyond_the_width_name_columns():
    plan = FaultPlan([NanFault(0, 0, "target_logits", columns=[3, 10])], 1)
    with pytest.raises(ValueError, match="columns"):
        plan.apply(torch.zeros(1, 10), 0, "target_logits", [0])


@pytest.mark.parametrize("columns", [[], "ab", 3, [1.0], [-1], [True], [1, None]])
def test_bad_columns_raise_value_error_naming_columns(columns):
    with pytest.raises(ValueError, match="columns"):
        NanFault(0, 0, "target_logits", columns=columns)


def test_columns_are_not_for_the_kv_cache():
    with pytest.raises(ValueError, match="columns"):
        NanFault(0, 0, "kv_cache", columns=[0])
    assert set(FAULT_SITES) >= {"target_logits", "draft_logits", "target_hidden", "kv_cache"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_apply_uses_only_basic_slice_fills():
    """No index tensor (its host-to-device copy would sync on CUDA), no read back."""
    x = torch.zeros(2, 3, 100)
    plan = FaultPlan([NanFault(0, 0, "target_logits", columns=[1, 2, 3, 50, 99]),
                      NanFault(1, 0, "target_logits", value=INF)], 2)
    with _Ops() as mode:
        plan.apply(x, 0, "target_logits", [0, 1])
    assert set(mode.ops) <= {"select", "slice", "fill_"}, mode.ops
    assert mode.ops.count("fill_") == 3 + 1  # 3 runs + 1 whole row
    assert torch.isnan(x[0, :, [1, 2, 3, 50, 99]]).all() and math.isinf(x[1, 2, 7])


@pytest.mark.gpu
def test_cuda_apply_makes_no_host_sync():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = torch.zeros(2, 3, 100, device="cuda")
    plan = FaultPlan([NanFault(0, 0, "target_logits", columns=[1, 2, 50])], 2)
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan.apply(x, 0, "target_logits", [0, 1])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isnan(x[0, :, [1, 2, 50]]).all()
