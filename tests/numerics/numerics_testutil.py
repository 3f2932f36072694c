"""Helpers shared by the numerics tests (a unique module name, unlike conftest)."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-for-bit equality (NaN payloads and -0.0 included)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    ai = a.contiguous().view(INT_VIEW[a.dtype])
    bi = b.contiguous().view(INT_VIEW[b.dtype])
    mismatch = (ai != bi).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} elements differ, first at {mismatch[:5].tolist()}"


def softmax_invariant_violation(logits: torch.Tensor, temperature: float) -> str | None:
    """Return why ``softmax(logits.float() / t)`` is not finite-and-sums-to-1, or None."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if not torch.isfinite(probs).all():
        return f"non-finite probabilities at t={temperature}"
    sums = probs.sum(dim=-1)
    if not torch.allclose(sums, torch.ones_like(sums), atol=1e-4, rtol=0):
        return f"rows sum to {sums.tolist()} at t={temperature}"
    return None
