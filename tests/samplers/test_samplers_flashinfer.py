"""GPU only: FlashInfer's chain kernel against the torch path (skipped without CUDA)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from samplers import chain_speculative_sampling, sample, sample_without_replacement, tree_verify
from samplers_testlib import NUM_SAMPLES, chi_square, conditional_chi_square, draw, softmax_table

pytestmark = pytest.mark.gpu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"
)
V = 6


def _chain_inputs(with_draft_probs):
    rng = np.random.default_rng(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    t0, t2 = (torch.tensor(softmax_table(rng, 1, V)[0], dtype=torch.float32, device="cuda") for _ in range(2))
    t1 = torch.tensor(softmax_table(rng, V, V), dtype=torch.float32, device="cuda")
    q0 = torch.tensor(softmax_table(rng, 1, V)[0], dtype=torch.float32, device="cuda")
    q1 = torch.tensor(softmax_table(rng, V, V), dtype=torch.float32, device="cuda")
    d0 = draw(q0.expand(NUM_SAMPLES, V), g)
    d1 = draw(q1[d0], g)
    target = torch.stack([t0.expand(NUM_SAMPLES, V), t1[d0], t2.expand(NUM_SAMPLES, V)], 1)
    draft = torch.stack([q0.expand(NUM_SAMPLES, V), q1[d0]], 1) if with_draft_probs else None
    return draft, torch.stack([d0, d1], 1), target, t0.double().cpu().numpy(), t1.double().cpu().numpy()


@cuda
@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "deterministic"])
@pytest.mark.parametrize("backend", [pytest.param("flashinfer", marks=needs_flashinfer), "torch"])
def test_chain_backends_preserve_distribution_on_gpu(backend, with_draft_probs):
    draft, ids, target, t0, t1 = _chain_inputs(with_draft_probs)
    g = torch.Generator(device="cuda").manual_seed(1)
    out, passed, accepted = chain_speculative_sampling(draft, ids, target, generator=g, backend=backend)
    first = chi_square(out[:, 0].cpu(), t0, V)
    second = conditional_chi_square(out[:, 0].cpu(), out[:, 1].cpu(), (accepted >= 1).cpu(), t1, V)
    assert first.passes and second.passes, f"{backend}: {first} / {second}"
    assert (passed >= accepted).all()


@cuda
@needs_flashinfer
def test_flashinfer_fixup_rejects_out_of_range_and_zero_q_tokens():
    b, k = 4096, 3
    target = torch.full((b, k + 1, V), 1.0 / V, device="cuda")
    draft = torch.full((b, k, V), 1.0 / V, device="cuda")
    draft[:, 1, 2] = 0.0  # token 2 at position 1 cannot have been drafted
    ids = torch.tensor([[1, 2, 3]] * (b // 2) + [[1, V + 4, 3]] * (b // 2), device="cuda")
    out, _passed, accepted = chain_speculative_sampling(draft, ids, target, backend="flashinfer")
    assert int(accepted.max()) <= 1  # never accepted past position 1
    assert bool(((out >= 0) & (out < V) | (out == -1)).all())


@cuda
def test_torch_paths_run_on_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16)
    ids = sample(logits, top_k=50, top_p=0.9, generator=g)
    assert ids.device.type == "cuda" and bool(((ids >= 0) & (ids < 1000)).all())
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]] * 64, device="cuda")
    tokens = torch.randint(0, 1000, (64, 6), device="cuda")
    res = tree_verify(tokens, parents, torch.randn(64, 6, 1000, device="cuda"), temperature=0.7, generator=g, max_depth=2)
    assert res.output_token_ids.shape == (64, 3)
    gens = [torch.Generator(device="cuda").manual_seed(s) for s in range(64)]
    q = torch.rand(64, 6, 1000, device="cuda")
    res = tree_verify(tokens, parents, torch.randn(64, 6, 1000, device="cuda"), temperature=0.7, generator=gens,
                      draft_probs=q, sibling_sampling="without_replacement", max_depth=2)
    assert bool(((res.output_token_ids >= 0) & (res.output_token_ids < 1000) | (res.output_token_ids == -1)).all())
    assert sample_without_replacement(q, 4, gens).shape == (64, 6, 4)
