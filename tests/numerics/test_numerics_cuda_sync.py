"""Zero host syncs on CUDA: sanitize, the Triton counts kernel and the async warner."""

import pytest
import torch

from numerics import (AsyncNanWarner, get_nan_warner, nan_counts_per_request, nonfinite_counts_per_request,
                      sanitize_nan_logits)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NAN = float("nan")


def _batch(dtype):
    x = torch.randn(6, 32000, device="cuda", dtype=dtype)
    x[1, 7] = NAN
    x[4] = float("inf")
    cu = torch.tensor([0, 2, 2, 5], device="cuda", dtype=torch.int32)
    return x, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hot_paths_do_not_sync(dtype):
    x, cu = _batch(dtype)
    warner = AsyncNanWarner()
    # Warm up outside the check: kernel compilation, pinned slot allocation.
    nan_counts_per_request(x.clone(), cu, sanitize=True, backend="triton")
    sanitize_nan_logits(x.clone(), "warmup", warn=False)
    warner.check(torch.ones(2, device="cuda"), "warmup")
    get_nan_warner().check(torch.ones(2, device="cuda"), "warmup")
    nan_tensor = torch.tensor([NAN], device="cuda")  # a host-to-device copy: made before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        three = nonfinite_counts_per_request(x.clone(), cu, backend="triton")
        counts = nan_counts_per_request(x, cu, sanitize=True, backend="triton")
        sanitize_nan_logits(x, "sync_test")
        for step in range(8):
            warner.check(x, f"step{step}")
        warner.check(nan_tensor, "nan_site")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counts.tolist() == [1, 0, 0]
    assert [c.tolist() for c in three] == [[1, 0, 0], [0, 0, 32000], [0, 0, 1]]  # row 4 (all Inf) is dead
    assert torch.isfinite(x).all()
    assert warner.flush() is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernel_matches_reference_on_strided_rows(dtype):
    base = torch.randn(8, 32100, device="cuda").to(dtype)
    base[::3, ::97] = NAN
    base[1, :] = float("inf")
    cu = torch.tensor([0, 1, 1, 3], device="cuda")
    base[2, 5:] = NAN  # alive: its first 5 entries are finite (view row 1)
    base[4, :] = NAN  # dead (view row 2)
    a, b = base.clone(), base.clone()
    ca = nonfinite_counts_per_request(a[::2, :32000], cu, sanitize=True, backend="triton")
    cb = nonfinite_counts_per_request(b[::2, :32000], cu, sanitize=True, backend="torch")
    assert [c.tolist() for c in ca] == [c.tolist() for c in cb]
    assert cb.dead_rows.tolist() == [0, 0, 1]
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.view(bits), b.view(bits))
