"""Tests for spec_decode.cpu.attention: the batch-invariant attention kernel against its torch reference.

``reference_attention`` emulates the kernel's arithmetic (lane-ordered FMA dot products, its exp
polynomial, key-ordered sums), so the two agree on every bit over odd shapes, both dtypes, strided
inputs and NaN placements. Against SDPA (another order) they agree to rounding. A row's bits depend
only on its own query and visible keys: not on the padded key count, the other rows, or the batch.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spec_decode.cpu import cpu_gemm
from spec_decode.cpu.attention import invariant_attention, reference_attention, reference_exp

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="the kernel needs cpu_gemm (x86-64, AVX2, a C compiler)")

# the kernel takes the visible keys 8 at a time, then one at a time, and the head dimension 64, then 8,
# then 1 at a time: S and D below cover each route and their remainders (SmolLM2's D is 64)
SHAPES = [(1, 1, 1, 1, 8), (2, 2, 6, 37, 32), (1, 3, 5, 20, 13), (2, 1, 3, 9, 64), (1, 2, 18, 70, 7), (3, 1, 1, 5, 40),
          (1, 2, 4, 45, 72), (1, 1, 3, 33, 100), (1, 3, 2, 130, 64)]
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
          (torch.float32, torch.bfloat16)]


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal dtype and bits, NaN included (any NaN payload counts as the same NaN; bf16 widens exactly)."""
    bits = lambda t: t.float().nan_to_num(0.0).view(torch.int32)
    return (got.shape == want.shape and got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
            and torch.equal(bits(got), bits(want)))


def _operands(B, H, R, S, D, q_dtype, kv_dtype, extra=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, R, D, generator=g) * 2).to(q_dtype)
    k = (torch.randn(B, H, S + extra, D, generator=g) * 2).to(kv_dtype)
    v = torch.randn(B, H, S + extra, D, generator=g).to(kv_dtype)
    mask = torch.rand(B, 1, R, S, generator=g) < 0.6
    mask[..., 0] = True   # every row sees a key, as the model's masks guarantee (its own row)
    return q, k, v, mask


@pytest.mark.parametrize("B,H,R,S,D", SHAPES)
@pytest.mark.parametrize("q_dtype,kv_dtype", DTYPES)
def test_kernel_equals_its_reference_bit_for_bit(B, H, R, S, D, q_dtype, kv_dtype):
    q, k, v, mask = _operands(B, H, R, S, D, q_dtype, kv_dtype)
    scale = D ** -0.5
    got = invariant_attention(q, k, v, mask, scale)
    assert _same_bits(got, reference_attention(q, k, v, mask, scale).to(q_dtype))
    want = F.scaled_dot_product_attention(q.float(), k[:, :, :S].float(), v[:, :, :S].float(), attn_mask=mask)
    torch.testing.assert_close(got.float(), want, rtol=1e-5 if q_dtype == torch.float32 else 2e-2,
                               atol=1e-5 if q_dtype == torch.float32 else 2e-2)


def test_strided_inputs_give_the_contiguous_bits():
    """The model passes a cache's first rows, a transposed q and masks cut from a wider buffer."""
    q, k, v, mask = _operands(2, 2, 6, 20, 32, torch.bfloat16, torch.bfloat16, extra=11)
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)          # rows strided
    wide = torch.zeros(2, 1, 6, 40, dtype=torch.bool)
    wide[..., :20] = mask
    got = invariant_attention(qt, k, v, wide[..., :20], 0.125)
    assert _same_bits(got, invariant_attention(q, k[:, :, :20].contiguous(), v[:, :, :20].contiguous(), mask, 0.125))


def test_a_row_depends_on_its_visible_keys_only():
    """Padding keys (masked, any values), other rows and other batch entries change no bit of a row."""
    q, k, v, mask = _operands(2, 2, 6, 30, 32, torch.bfloat16, torch.bfloat16, extra=40)
    base = invariant_attention(q, k, v, mask, 0.2)
    # the same rows over 70 keys, the 40 extra ones masked and filled with garbage (NaN included)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:] = float("nan")
    v2[:, :, 30:] = 1e30
    padded = torch.zeros(2, 1, 6, 70, dtype=torch.bool)
    padded[..., :30] = mask
    assert _same_bits(invariant_attention(q, k2, v2, padded, 0.2), base)
    # one row alone, and one batch entry alone
    assert _same_bits(invariant_attention(q[:, :, 3:4], k, v, mask[:, :, 3:4], 0.2), base[:, :, 3:4])
    assert _same_bits(invariant_attention(q[1:], k[1:], v[1:], mask[1:], 0.2), base[1:])


def test_a_visible_nan_reaches_exactly_the_rows_that_see_it():
    q, k, v, mask = _operands(1, 1, 4, 6, 16, torch.float32, torch.float32, extra=0)
    mask[:] = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0]],
                           dtype=torch.bool)
    k[0, 0, 1, 3] = float("nan")     # key 1: seen by rows 1 and 3
    v[0, 0, 2, 5] = float("nan")     # value 2: seen by row 2
    v[0, 0, 4:] = float("nan")       # keys no row sees
    got = invariant_attention(q, k, v, mask, 0.25)
    assert got.isnan().any(-1)[0, 0].tolist() == [False, True, True, True]
    assert _same_bits(got, reference_attention(q, k, v, mask, 0.25))


def test_exp_is_close_to_torch_exp():
    x = torch.linspace(-87, 0, 200001)
    rel = ((reference_exp(x).double() - x.double().exp()) / x.double().exp()).abs().max().item()
    assert rel < 2e-7
    assert reference_exp(torch.tensor([float("nan")])).isnan().all()


def test_bad_inputs_are_named():
    q, k, v, mask = _operands(1, 1, 2, 4, 8, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="invariant_attention"):
        invariant_attention(q.half(), k, v, mask, 1.0)
    with pytest.raises(ValueError, match="invariant_attention"):
        invariant_attention(q, k, v.bfloat16(), mask, 1.0)
    with pytest.raises(ValueError, match="invariant_attention"):
        invariant_attention(q, k, v, mask[..., None], 1.0)


def _two_ways(model, run):
    """``run(model)``'s outputs with the fused attention block and with the layer's ops one at a time (the
    one-call layer, ``tests/spec_decode/cpu/test_cpu_layer.py``, off for both)."""
    from spec_decode.cpu import attention as cpu_attention
    from spec_decode.cpu import layer as cpu_layer
    from spec_decode.models import layers

    calls = []
    original = layers.attention_block
    try:
        layers.decoder_layer_fits = lambda *a, **k: False
        fused = run(model)
        layers.attention_block = lambda *a, **k: calls.append(1) or original(*a, **k)
        assert run(model) is not None and calls, "the fused block did not run"
        layers.attention_block_fits = lambda *a, **k: False
        unfused = run(model)
    finally:
        layers.attention_block = original
        layers.attention_block_fits = cpu_attention.attention_block_fits
        layers.decoder_layer_fits = cpu_layer.decoder_layer_fits
    return fused, unfused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2), (6, 3), (3, 1), (4, 4)])
def test_the_fused_block_gives_the_layer_ops_bits(tmp_path, dtype, heads):
    """Prefill of padded prompts, one-token decode, a 5-token chain and a tree block, a batch of 3: the
    logits and every cache row equal the unfused path's (rope op by op, cache writes, attention)."""
    from spec_decode.models import Transformer
    from tiny_models import decode_blocks, make_tiny_target

    nh, nkv = heads
    path = make_tiny_target(tmp_path, seed=3, num_attention_heads=nh, num_key_value_heads=nkv, hidden_size=8 * nh)
    model = Transformer.from_pretrained(path, dtype=dtype)
    prompts = torch.randint(1, 97, (3, 9), generator=torch.Generator().manual_seed(0))
    run = lambda m: decode_blocks(m, prompts)

    fused, unfused = _two_ways(model, run)
    for a, b in zip(fused, unfused):
        assert _same_bits(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_block_reaches_exactly_the_rows_that_see_a_poisoned_cache_row(dtype):
    """A NaN key or an Inf value already in the cache reaches the query rows whose mask shows it, and no other
    (a masked row is never read, so not even a zero weight meets it)."""
    from spec_decode.cpu.attention import attention_block

    B, T, nh, nkv, D, S = 1, 3, 4, 2, 8, 7
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, T, (nh + 2 * nkv) * D, generator=g).to(dtype)
    cos_sin = torch.randn(B, T, 1, 2 * D, generator=g).to(dtype)
    k_cache = torch.randn(B, nkv, 10, D, generator=g).to(dtype)
    v_cache = torch.randn(B, nkv, 10, D, generator=g).to(dtype)
    k_cache[0, 0, 1, 3] = float("nan")        # kv head 0, cache row 1
    v_cache[0, 1, 2, 0] = float("inf")        # kv head 1, cache row 2
    write_pos = torch.tensor([[4, 5, 6]])
    mask = torch.zeros(B, 1, 2 * T, S, dtype=torch.bool)
    mask[..., 0] = True
    for rep in range(2):
        for t in range(T):
            mask[0, 0, rep * T + t, 4 + t] = True     # its own row
    mask[0, 0, 0, 1] = True                          # token 0 of heads 0 and 2 sees row 1
    mask[0, 0, 5, 2] = True                          # token 2 of heads 1 and 3 sees row 2
    rope = (cos_sin[..., :D], cos_sin[..., D:])
    out = attention_block(qkv, rope, write_pos, (k_cache, v_cache), mask, nh, D ** -0.5)
    bad = (~out.view(B, T, nh, D).float().isfinite()).any(-1)[0]    # [T, nh]
    want = torch.zeros(T, nh, dtype=torch.bool)
    want[0, 0] = True                                 # kv head 0, rep 0: query head 0 at token 0
    want[2, 3] = True                                 # kv head 1, rep 1: query head 3 at token 2
    assert torch.equal(bad, want)


def _attention_block_by_torch_ops(qkv, rope, write_pos, kv, mask, nh, scale):
    """attention_block's steps one torch op at a time: ``apply_rope`` on q and k (rounded op by op in the
    dtype), the K/V rows written into copies of the caches, ``reference_attention`` per replica of the kv
    heads, rounded once to the dtype. Returns (out, k_cache, v_cache)."""
    from spec_decode.models.rope import apply_rope

    B, T, _ = qkv.shape
    k_cache, v_cache = (c.clone() for c in kv)
    nkv, D, S = k_cache.shape[1], k_cache.shape[-1], mask.shape[-1]
    n_rep = nh // nkv
    heads = lambda lo, n: qkv[..., lo * D:(lo + n) * D].reshape(B, T, n, D).transpose(1, 2)   # [B, n, T, D]
    cos, sin = (c.transpose(1, 2) for c in rope)                                                # [B, 1, T, D]
    q, k, v = apply_rope(heads(0, nh), cos, sin), apply_rope(heads(nh, nkv), cos, sin), heads(nh + nkv, nkv)
    for b in range(B):
        for t in range(T):
            k_cache[b, :, write_pos[b, t]] = k[b, :, t]
            v_cache[b, :, write_pos[b, t]] = v[b, :, t]
    out = torch.empty(B, T, nh, D, dtype=qkv.dtype)
    for rep in range(n_rep):
        rows = reference_attention(q[:, rep::n_rep], k_cache[:, :, :S], v_cache[:, :, :S],
                                   mask[:, :, rep * T:(rep + 1) * T], scale)               # [B, nkv, T, D]
        out[:, :, rep::n_rep] = rows.transpose(1, 2).to(qkv.dtype)
    return out.reshape(B, T, nh * D), k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [8, 16, 20, 64])
def test_the_fused_block_equals_its_ops_by_torch_with_special_values(dtype, D):
    """Head dims with whole octets on each side of D / 2 (16, 64: rope eight lanes at a time) and without
    (8, 20); NaN, Inf, -0 and values near the float32 limit in q, k and v: the output and both caches carry
    the bits of the torch ops."""
    from spec_decode.cpu.attention import attention_block

    B, T, nh, nkv, S = 2, 3, 6, 2, 9
    g = torch.Generator().manual_seed(D)
    qkv = torch.randn(B, T, (nh + 2 * nkv) * D, generator=g) * 3
    flat = qkv.view(-1)
    picks = torch.randperm(flat.numel(), generator=g)[:12]
    flat[picks] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 3.0e38, -3.0e38] * 2)
    qkv = qkv.to(dtype)
    angles = torch.rand(B, T, 1, D, generator=g) * 6
    rope = (angles.cos().to(dtype), angles.sin().to(dtype))
    kv = tuple(torch.randn(B, nkv, 12, D, generator=g).to(dtype) for _ in range(2))
    write_pos = torch.tensor([[5, 6, 7], [2, 3, 4]])
    mask = torch.rand(B, 1, (nh // nkv) * T, S, generator=g) < 0.6
    for b in range(B):
        for t in range(T):
            mask[b, 0, t::T, write_pos[b, t]] = True
    scale = D ** -0.5
    want, want_k, want_v = _attention_block_by_torch_ops(qkv, rope, write_pos, kv, mask, nh, scale)
    got = attention_block(qkv, rope, write_pos, kv, mask, nh, scale)
    assert _same_bits(got, want)
    assert _same_bits(kv[0], want_k) and _same_bits(kv[1], want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D, n_rep", [(64, 3), (40, 4), (16, 2), (96, 3), (20, 3)])
def test_query_heads_sharing_their_keys_keep_their_own_bits(dtype, D, n_rep):
    """The fused block lets the query heads of one kv head share each loaded key and value over the keys that
    begin all their lists alike (groups of up to 3 rows, a token's heads first; 4 heads a kv head make groups
    across tokens). Here a 4-token causal block after 37 committed keys (lists not a multiple of 4 long), a
    committed key that one token's heads do not see and one that a single head does not (lists that part in
    the middle), NaN and Inf in visible and masked keys, values and queries, head dims of whole 32s, of 32
    and 8, of 8s, and one of no whole octets (20: no sharing): every row and both caches carry the bits of the
    torch ops."""
    from spec_decode.cpu.attention import attention_block

    B, T, nkv, S0 = 2, 4, 2, 37
    nh, S = nkv * n_rep, S0 + T
    g = torch.Generator().manual_seed(D + n_rep)
    qkv = torch.randn(B, T, (nh + 2 * nkv) * D, generator=g)
    qkv[1, 3, 5] = float("nan")                                   # a query element of head 0, token 3
    qkv = qkv.to(dtype)
    angles = torch.rand(B, T, 1, D, generator=g) * 6
    rope = (angles.cos().to(dtype), angles.sin().to(dtype))
    kv = [torch.randn(B, nkv, S + 3, D, generator=g) for _ in range(2)]
    kv[0][0, 0, 10, 3] = float("nan")                             # a key every row of kv head 0 sees
    kv[1][1, 1, 20, 0] = float("inf")                             # a value token 2 at b = 1 does not see
    kv[0][1, 1, S + 1, 2] = float("nan")                          # a row past the block: never visible
    kv = tuple(c.to(dtype) for c in kv)
    write_pos = torch.arange(S0, S0 + T).expand(B, T)
    mask = torch.zeros(B, 1, n_rep * T, S, dtype=torch.bool)
    for t in range(T):
        mask[:, 0, t::T, :S0 + t + 1] = True                      # committed keys, then the block causally
    mask[1, 0, 2::T, 20] = False                                  # every head of token 2 at b = 1
    mask[0, 0, 1 * T + 1, 5] = False                              # head rep 1 of token 1 at b = 0 alone
    scale = D ** -0.5
    want, want_k, want_v = _attention_block_by_torch_ops(qkv, rope, write_pos, kv, mask, nh, scale)
    got = attention_block(qkv, rope, write_pos, kv, mask, nh, scale)
    assert _same_bits(got, want)
    assert _same_bits(kv[0], want_k) and _same_bits(kv[1], want_v)
    finite = got.view(B, T, nh, D).float().isfinite().all(-1)
    assert finite[1, 2, n_rep:].all() and not finite[1, :2, n_rep:].any()   # the Inf value: token 2 spared
