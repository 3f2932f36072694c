"""What every layer of one forward reads: write positions, rope rows and the attention mask of a new block.

Terms (committed rows, new block, tree mask) as in the glossary of ``spec_decode.models``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from spec_decode.models.kv_cache import KVCache
from spec_decode.models.rope import RopeFrequencies, rope_rows


@dataclass
class LayerInputs:
    """What every decoder layer of one forward reads, in the layers' layout; built once per forward
    by ``prepare_block``.

    Shape:
        cos, sin: [B, T, 1, D] (heads after tokens, as the fused q/k/v projection lays them out)
        write_pos: [B, T] int64
        row_index: [B, n_kv, T, D] int64, ``write_pos`` laid out for ``KVCache.write_rows``
        mask: [B, 1, n_rep * T, S] bool: the n_rep query heads that share a kv head folded into the query axis
        bias: [B, 1, n_rep * T, S] in the model dtype: 0 where ``mask``, -inf elsewhere. SDPA gives the same
            bits with it as with ``mask`` but converts a bool mask again in every layer.
    """

    cos: Tensor
    sin: Tensor
    write_pos: Tensor
    row_index: Tensor
    mask: Tensor
    bias: Tensor


@dataclass   # plain like LayerInputs: built inside every (possibly compiled) forward, read only
class BlockPlacement:
    """Where a forward's new block sits and what it attends to: the forward's keywords, gathered once.

    Shape: position_ids [B, T] or None; tree_mask [B, T, S] bool or None; input_lens [B] or None.
    ``kv_len``: host int or None. ``block``: one call's entry of ``chain_block_inputs``, which fixes the
    positions, the mask and the keys itself, so it comes alone (``block_inputs``).
    """

    position_ids: Tensor | None = None
    tree_mask: Tensor | None = None
    input_lens: Tensor | None = None
    kv_len: int | None = None
    block: LayerInputs | None = None


def build_attention_mask(lengths: Tensor, num_new: int, kv_len: int, tree_mask: Tensor | None = None,
                         input_lens: Tensor | None = None, n_rep: int = 1) -> Tensor:
    """Boolean attention mask for a new block of ``num_new`` tokens written after the committed rows.

    The uncommitted region of request ``b`` starts at ``lengths[b]`` and holds ``S`` rows
    (``S = tree_mask.shape[-1]``, or ``num_new`` without a tree mask); the new block is its last
    ``num_new`` rows, so the first ``S - num_new`` were written by earlier forwards (a drafter that
    appends each depth of its tree). Key ``s`` is visible to new token ``t`` when ``s < lengths[b]``
    (committed), or when ``s = lengths[b] + j`` with ``tree_mask[b, t, j]`` (causal if None) and, for
    a key inside the new block, ``j - (S - num_new) < input_lens[b]``. The token's own row is always
    visible, so no softmax row is empty (padded rows stay finite).

    ``n_rep``: the query heads that share one kv head are folded into the query axis (grouped-query
    attention without copying the cache): row ``r * T + t`` is token ``t`` of the r-th of them.

    Built on the small [B, T, S] span and spread over the ``kv_len`` keys with one gather: a forward
    pays a dozen small ops for it, which matters for a one-layer drafter.

    Shape:
        lengths: [B] int64; tree_mask: [B, T, S] bool (S >= T) or None; input_lens: [B] or None
        returns: [B, 1, n_rep * T, kv_len] bool
    """
    device = lengths.device
    B = lengths.shape[0]
    span = num_new if tree_mask is None else tree_mask.shape[-1]
    past = span - num_new  # uncommitted rows written before this block
    j = _positions(span, device)
    own_row = j[past:, None]  # (T, 1): each token's own row in the span
    if tree_mask is None:
        vis = j <= own_row  # causal (T, S), own row included (past == 0)
    else:
        vis = tree_mask | (j == own_row)
    if input_lens is not None:
        vis = (vis & (j - past < input_lens[:, None, None].to(j.dtype))) | (j == own_row)
    vis = vis.expand(B, num_new, span)
    if n_rep > 1:   # expand + reshape: one copy
        vis = vis[:, None].expand(B, n_rep, num_new, span).reshape(B, n_rep * num_new, span)
    # column 0 stands for every committed key (visible), 1..S for the span, S + 1 for the keys after it
    ext = F.pad(F.pad(vis, (1, 0), value=True), (0, 1), value=False)  # (B, R, S + 2)
    col = (_positions(kv_len + 1, device)[1:] - lengths[:, None]).clamp_(0, span + 1)  # (B, kv_len)
    return ext.gather(2, col[:, None, :].expand(B, ext.shape[1], kv_len))[:, None]


def causal_block_mask(write_pos: Tensor, kv_len: int, n_rep: int = 1) -> Tensor:
    """``build_attention_mask`` for a causal block without padding (no tree mask, no ``input_lens``).

    Token ``t`` of request ``b`` sees exactly the keys ``s <= write_pos[b, t]``: the committed rows, the
    block's rows before it and its own. Three ops instead of the general path's dozen: plain decode
    steps, chain verifies, chain drafter calls and unpadded catch-ups take this path (tree depths do not).

    Shape: write_pos [B, T] int64 -> [B, 1, n_rep * T, kv_len] bool (query heads folded as there).
    """
    B, T = write_pos.shape
    vis = _positions(kv_len, write_pos.device) <= write_pos[:, :, None]  # (B, T, kv_len)
    if n_rep > 1:   # a view when T == 1, one copy otherwise
        vis = vis[:, None].expand(B, n_rep, T, kv_len).reshape(B, n_rep * T, kv_len)
    return vis[:, None]


@functools.lru_cache(maxsize=16)
def _arange_table(n: int, device: torch.device) -> Tensor:
    return torch.arange(n, device=device)


def _positions(n: int, device: torch.device) -> Tensor:
    """``torch.arange(n)`` as a view of a cached table (grown in powers of two, never written to).

    A forward's mask and write positions take an arange or two, and a one-layer drafter pays them once
    per call (``docs/performance.md`` has what the cache is worth).
    """
    if torch.compiler.is_compiling():   # a graph makes its own; the cache is for eager op counts
        return torch.arange(n, device=device)
    size = 1 << max(n - 1, 0).bit_length()
    return _arange_table(max(size, 64), device)[:n]


@functools.lru_cache(maxsize=16)
def _bias_values(dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """0 and -inf as 0-d tensors of ``dtype`` (the two values of an attention bias), cached."""
    return (torch.zeros((), dtype=dtype, device=device), torch.full((), float("-inf"), dtype=dtype, device=device))


def check_block_args(input_ids: Tensor, cache: KVCache, where: BlockPlacement, device: torch.device) -> None:
    """Shape/dtype/device checks for a forward over a new block (host-side metadata only, no sync)."""
    position_ids, tree_mask, input_lens, kv_len = where.position_ids, where.tree_mask, where.input_lens, where.kv_len
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an int32/int64 tensor [B, T], got {input_ids.dtype} {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if T < 1:
        raise ValueError("input_ids must hold at least one token per row (T >= 1)")
    if input_ids.device != device:
        raise ValueError(f"input_ids is on {input_ids.device}, the model on {device}")
    if cache.batch_size != B:
        raise ValueError(f"cache has batch size {cache.batch_size}, input_ids has {B}")
    if position_ids is not None and tuple(position_ids.shape) != (B, T):
        raise ValueError(f"position_ids must have shape {(B, T)}, got {tuple(position_ids.shape)}")
    span = T
    if tree_mask is not None:
        span = tree_mask.shape[-1] if tree_mask.dim() == 3 else -1
        if tree_mask.dtype != torch.bool or tuple(tree_mask.shape[:2]) != (B, T) or span < T:
            raise ValueError(f"tree_mask must be bool [B, T, S] with B={B}, T={T}, S >= T, got "
                             f"{tree_mask.dtype} {tuple(tree_mask.shape)}")
    if input_lens is not None and tuple(input_lens.shape) != (B,):
        raise ValueError(f"input_lens must have shape {(B,)}, got {tuple(input_lens.shape)}")
    if kv_len is not None and not (span <= kv_len <= cache.max_len):
        raise ValueError(f"kv_len ({kv_len}) must be in [S={span}, cache.max_len={cache.max_len}]")
    if span > cache.max_len:
        raise ValueError(f"new block of {span} rows does not fit cache.max_len={cache.max_len}")


def prepare_block(module: RopeFrequencies, cache: KVCache, num_new: int, dtype: torch.dtype,
                  position_ids: Tensor | None, tree_mask: Tensor | None, input_lens: Tensor | None,
                  kv_len: int | None) -> LayerInputs:
    """Rope tables, write positions and mask of a new block of ``num_new`` tokens (no host sync).

    ``module`` is the model or head that runs the block (its config gives the grouped-query layout and
    its ``rope_table`` the cos/sin). With a tree mask [B, T, S] the block is written at the last T of
    the S uncommitted rows. Positions must lie in ``[0, cache.max_len)``, as every write position does.
    """
    lengths = cache.lengths
    past = 0 if tree_mask is None else tree_mask.shape[-1] - num_new
    write_pos = lengths[:, None] + _positions(past + num_new, lengths.device)[past:]  # (B, T)
    if position_ids is None:
        position_ids = write_pos
    cos_sin = rope_rows(module, cache, position_ids.to(lengths.device), dtype)  # (B, T, 2D)
    B, D = lengths.shape[0], cos_sin.shape[-1] // 2
    cos_sin = cos_sin.view(B, num_new, 1, 2 * D)
    n_rep = _n_rep(module)
    if tree_mask is None and input_lens is None:
        mask = causal_block_mask(write_pos, kv_len or cache.max_len, n_rep)
    else:
        mask = build_attention_mask(lengths, num_new, kv_len or cache.max_len, tree_mask, input_lens, n_rep)
    return LayerInputs(cos_sin[..., :D], cos_sin[..., D:], write_pos, cache.row_index(write_pos), mask,
                       _mask_bias(mask, dtype))


def _n_rep(module: RopeFrequencies) -> int:
    """Query heads per kv head (folded into the query axis of the masks)."""
    c = module.config
    return c.num_attention_heads // c.num_key_value_heads


def _mask_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``mask``, -inf elsewhere, in ``dtype``: one op, not full + masked_fill_ (a compiled graph
    makes its own two values)."""
    values = _bias_values.__wrapped__ if torch.compiler.is_compiling() else _bias_values
    return torch.where(mask, *values(dtype, mask.device))


def chain_block_inputs(module: RopeFrequencies, cache: KVCache, num_calls: int, dtype: torch.dtype,
                       kv_len: int | None) -> list[LayerInputs]:
    """``prepare_block``'s inputs of ``num_calls`` successive one-token causal forwards, built at once.

    Call ``d`` (0-based) writes its token at ``cache.lengths + d`` (the lengths as they are now: the
    caller does not advance them between calls) and attends over the first ``kv_len + d + 1`` rows
    (every row when ``kv_len`` is None), exactly what ``prepare_block(module, cache, 1, ...)`` gives
    after ``d`` increments of ``cache.lengths``. A chain drafter pays a dozen small ops for its inputs
    once per chain instead of once per depth (``docs/performance.md``). The masks and biases are views
    of one [num_calls, B, 1, n_rep, S] buffer, so each call's bias is strided, not contiguous.

    Shape: returns ``num_calls`` LayerInputs of a [B, 1] block (``LayerInputs``' shapes with T = 1).
    """
    if num_calls < 1:
        raise ValueError(f"num_calls must be >= 1, got {num_calls}")
    if kv_len is not None and not 0 <= kv_len <= cache.max_len - num_calls:
        raise ValueError(f"a chain of {num_calls} calls after kv_len={kv_len} rows does not fit the cache "
                         f"(max_len {cache.max_len})")
    lengths = cache.lengths
    B, C = lengths.shape[0], num_calls
    write_pos = lengths[:, None] + _positions(C, lengths.device)  # (B, C)
    cos_sin = rope_rows(module, cache, write_pos, dtype)  # (B, C, 2D)
    D = cos_sin.shape[-1] // 2
    n_rep = _n_rep(module)
    full = cache.max_len if kv_len is None else kv_len + C
    # every call's mask at once, calls first: C * B one-token rows of causal_block_mask
    mask = causal_block_mask(write_pos.T.reshape(C * B, 1), full, n_rep).view(C, B, 1, n_rep, full)
    bias = _mask_bias(mask, dtype)
    # one unbind (or split) per input, not a slice per call and input: fewer ops
    cs = cos_sin.view(B, C, 1, 1, 2 * D)
    cos, sin = cs[..., :D].unbind(1), cs[..., D:].unbind(1)                       # C x (B, 1, 1, D)
    pos = write_pos.view(B, C, 1).unbind(1)                                       # C x (B, 1)
    rows = cache.row_index(write_pos).split(1, dim=2)                             # C x (B, n_kv, 1, D)
    masks, biases = mask.unbind(0), bias.unbind(0)                                # C x (B, 1, n_rep, full)
    if kv_len is None:
        return [LayerInputs(*a) for a in zip(cos, sin, pos, rows, masks, biases)]
    return [LayerInputs(cos[d], sin[d], pos[d], rows[d], masks[d][..., :kv_len + d + 1],
                        biases[d][..., :kv_len + d + 1]) for d in range(C)]


def block_inputs(module: RopeFrequencies, cache: KVCache, num_new: int, dtype: torch.dtype,
                 where: BlockPlacement) -> LayerInputs:
    """``where.block`` (one call's entry of ``chain_block_inputs``) when given, else ``prepare_block``'s inputs.

    A given block already fixes the positions, the mask and the keys, so it comes alone: with
    ``position_ids``, ``tree_mask``, ``input_lens`` or ``kv_len``, or for more than one token, ValueError.
    """
    position_ids, tree_mask, input_lens, kv_len, block = (
        where.position_ids, where.tree_mask, where.input_lens, where.kv_len, where.block)
    if block is None:
        return prepare_block(module, cache, num_new, dtype, position_ids, tree_mask, input_lens, kv_len)
    if not isinstance(block, LayerInputs):
        raise ValueError(f"block must be a LayerInputs from chain_block_inputs, got {type(block).__name__}")
    given = [n for n, v in (("position_ids", position_ids), ("tree_mask", tree_mask), ("input_lens", input_lens),
                            ("kv_len", kv_len)) if v is not None]
    if given or num_new != 1:
        raise ValueError(f"block is for one causal token and comes alone; got {num_new} tokens"
                         + (f" and {', '.join(given)}" if given else ""))
    if block.mask.shape[-1] > cache.max_len or block.write_pos.shape[0] != cache.batch_size:
        raise ValueError(f"block was built for another cache (batch {block.write_pos.shape[0]}, "
                         f"{block.mask.shape[-1]} keys; this cache: batch {cache.batch_size}, "
                         f"max_len {cache.max_len})")
    return block
