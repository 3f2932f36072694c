"""Triton kernel for ``coupled_noise`` and ``coupled_scores``: the hash, the uniform and the Gumbel in one pass.

Three layers: ``_coupled_noise_kernel`` (private), ``coupled_noise_triton`` (host launcher,
checks the backend can run), and the public ``samplers.coupled_noise`` / ``coupled_scores``
(``backend="triton"``), whose torch path ``samplers.coupled._coupled_noise_reference`` is
the reference: the same bits (the words and uniforms are integer-exact; the two logs are
float64 and the one rounding to float32 happens in the same place).

The words are uint64 here (Triton has unsigned arithmetic), where the torch reference
emulates them with int64; the top 52 bits ``(h >> 12) ^ 2**51`` equal its signed
``(h >> 12) + 2**51``. triton is imported only when this module is imported.
"""

from __future__ import annotations

import os

import torch

from numerics.triton_import import tl, triton


if triton is not None:

    @triton.jit
    def _mix(z):
        # SplitMix64's finalizer on uint64 words (logical shifts, products modulo 2**64).
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    @triton.jit
    def _stream(key, counter):
        # Output ``counter`` of the SplitMix64 stream seeded with ``key`` (uint64 in, uint64 out).
        return _mix(key + (counter + 1) * 0x9E3779B97F4A7C15)

    @triton.jit
    def _coupled_noise_kernel(
        seeds_ptr,  # [R] int64: row r's seed
        positions_ptr,  # [R] int64: row r's position
        token_ids_ptr,  # [V] int64: column j's token id if HAS_IDS (else unused: column j is token j)
        base_ptr,  # [R, V] float32, row stride stride_base: added to the noise if ADD_BASE (else unused)
        out_ptr,  # [R, V] float32, contiguous: G(seed, position, x) (+ base)
        V,
        stride_base,
        BLOCK_V: tl.constexpr,
        HAS_IDS: tl.constexpr,
        ADD_BASE: tl.constexpr,
    ):
        # Grid: (R, cdiv(V, BLOCK_V)). Each program writes BLOCK_V tokens of one row.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        in_row = cols < V
        seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
        position = tl.load(positions_ptr + row).to(tl.uint64, bitcast=True)
        key = _stream(_stream(seed, seed * 0), position)  # [ ] uint64: the row's token-stream key
        if HAS_IDS:
            tokens = tl.load(token_ids_ptr + cols, mask=in_row, other=0)
        else:
            tokens = cols
        word = _stream(key, tokens.to(tl.uint64, bitcast=True))  # [BLOCK_V] uint64
        # (k + 1/2) / 2**52 with k the top 52 bits, highest flipped: exact in float64, in (0, 1).
        k = (word >> 12) ^ (1 << 51)
        u = k.to(tl.float64) * 2.220446049250313e-16 + 1.1102230246251565e-16  # 2**-52, 2**-53
        noise = (-tl.log(-tl.log(u))).to(tl.float32)
        if ADD_BASE:
            noise = tl.load(base_ptr + row * stride_base + cols, mask=in_row, other=0.0) + noise
        tl.store(out_ptr + row * V + cols, noise, mask=in_row)


BLOCK_V = 1024


def interpreter_active() -> bool:
    """Whether the kernel runs under the Triton interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return type(_coupled_noise_kernel).__name__ == "InterpretedFunction"


def coupled_noise_triton(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                         token_ids: torch.Tensor | None = None, base: torch.Tensor | None = None) -> torch.Tensor:
    """Host launcher for the Triton backend (inputs already validated and flattened). No host sync.

    Shape:
        seeds, positions: int64 [R] on one device; token_ids: int64 [V], column j's token id, or
            None (column j is token j); base: float32 [R, V] or None.
        returns: float32 [R, V]: the Gumbel noise, plus ``base`` when given (a new tensor).

    NaN: a NaN in ``base`` stays NaN (added, not checked); the noise has none.
    """
    if triton is None:
        raise RuntimeError('backend="triton" needs the optional triton package: pip install "safespec[triton]"')
    if seeds.device.type == "cpu" and not interpreter_active():
        raise RuntimeError(
            'backend="triton" on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before '
            f"triton is first imported (now TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}), "
            'or use backend="torch"'
        )
    rows = seeds.shape[0]
    out = torch.empty(rows, vocab_size, dtype=torch.float32, device=seeds.device)
    if rows == 0:
        return out
    if base is not None and base.stride(-1) != 1:
        base = base.contiguous()
    block_v = min(BLOCK_V, triton.next_power_of_2(vocab_size))
    _coupled_noise_kernel[(rows, triton.cdiv(vocab_size, block_v))](
        seeds.contiguous(),
        positions.contiguous(),
        out if token_ids is None else token_ids.contiguous(),  # any pointer when unused
        out if base is None else base,
        out,
        vocab_size,
        0 if base is None else base.stride(0),
        BLOCK_V=block_v,
        HAS_IDS=token_ids is not None,
        ADD_BASE=base is not None,
    )
    return out
