"""The batched KV cache: one slot per request, committed rows and the new block (glossary in ``spec_decode.models``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def scatter_rows(dest: Tensor, row_index: Tensor, rows: Tensor) -> None:
    """``dest.scatter_(2, row_index, rows)``: copy ``rows`` [B, n_kv, T, D] into ``dest`` [B, n_kv, S, D] at the
    positions ``row_index`` [B, n_kv, T, D] (expanded along D).

    torch's CPU scatter of bfloat16 and float16 takes a slow generic path, several times the integer one's
    cost, and a forward writes two cache rows a layer; the copy moves bits, so 2-byte floats go through
    int16 views of the same memory. Tensors under autograd keep the float scatter (an integer view has
    no gradient).
    """
    if (rows.dtype in (torch.bfloat16, torch.float16) and dest.dtype == rows.dtype
            and not ((rows.requires_grad or dest.requires_grad) and torch.is_grad_enabled())):
        dest.view(torch.int16).scatter_(2, row_index, rows.view(torch.int16))
    else:
        dest.scatter_(2, row_index, rows)


@dataclass
class KVCache:
    """Batched KV cache: one slot per request, ``lengths[b]`` committed rows in slot ``b``.

    Shape:
        k, v: [num_layers, B, n_kv, max_len, head_dim]
        lengths: [B] int64, on the same device
    """

    k: Tensor
    v: Tensor
    lengths: Tensor

    @classmethod
    def empty(cls, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
              *, dtype: torch.dtype, device: torch.device | str | None = None) -> "KVCache":
        """Zeroed cache with all lengths 0."""
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"batch_size ({batch_size}) and max_len ({max_len}) must be >= 1")
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        return cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            lengths=torch.zeros(batch_size, dtype=torch.long, device=device),
        )

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """Rows per slot. Callers check ``lengths + T <= max_len`` on the host before a forward."""
        return self.k.shape[3]

    def write(self, layer: int, write_pos: Tensor, k: Tensor, v: Tensor) -> None:
        """Write new rows ``k``/``v`` [B, n_kv, T, D] of ``layer`` at positions ``write_pos`` [B, T]."""
        self.write_rows(layer, self.row_index(write_pos), k, v)

    def row_index(self, write_pos: Tensor) -> Tensor:
        """``write_pos`` [B, T] laid out for ``write_rows``: [B, n_kv, T, D] (an expanded view, no copy)."""
        B, T = write_pos.shape
        return write_pos[:, None, :, None].expand(B, self.k.shape[2], T, self.k.shape[4])

    def write_rows(self, layer: int, row_index: Tensor, k: Tensor, v: Tensor) -> None:
        """``write`` with the index from ``row_index``, built once per forward rather than once per layer."""
        # each on its own: under autocast k (roped against a float32 table) and v can differ
        if k.dtype != self.k.dtype:
            k = k.to(self.k.dtype)
        if v.dtype != self.v.dtype:
            v = v.to(self.v.dtype)
        scatter_rows(self.k[layer], row_index, k)
        scatter_rows(self.v[layer], row_index, v)

    def commit(self, num: Tensor, rel_idx: Tensor | None = None) -> None:
        """Keep ``num[b]`` rows of the last new block and advance ``lengths`` by ``num``.

        Row ``j < num[b]`` of request ``b`` becomes new row ``rel_idx[b, j]`` (default ``j``: a chain whose
        first ``num[b]`` tokens were accepted). Entries ``j >= num[b]`` are ignored (may be -1). All sources
        are gathered before anything is written, so overlapping moves are safe. Requires
        ``lengths[b] + A <= max_len`` (true when A does not exceed the new block that was written).
        No host sync.

        Shape:
            num: [B] integer
            rel_idx: [B, A] integer, or None
        """
        num = num.to(device=self.lengths.device, dtype=torch.long)
        if num.shape != self.lengths.shape:
            raise ValueError(f"num must have shape {tuple(self.lengths.shape)}, got {tuple(num.shape)}")
        if rel_idx is not None:
            if rel_idx.dim() != 2 or rel_idx.shape[0] != self.batch_size:
                raise ValueError(f"rel_idx must have shape [B={self.batch_size}, A], got {tuple(rel_idx.shape)}")
            rel_idx = rel_idx.to(device=self.lengths.device, dtype=torch.long)
            j = torch.arange(rel_idx.shape[1], device=rel_idx.device)
            keep = j[None, :] < num[:, None]  # (B, A)
            dst = self.lengths[:, None] + j[None, :]  # (B, A)
            # rows beyond num move onto themselves: a no-op that keeps every destination written once
            src = torch.where(keep, self.lengths[:, None] + rel_idx, dst)
            slot = torch.arange(self.batch_size, device=src.device)[:, None].expand_as(src)  # (B, A)
            for buf in (self.k, self.v):
                # indexing touches only the A moved rows (scatter_ on CPU copied the whole buffer);
                # the read is a copy, taken before any write
                buf[:, slot, :, dst] = buf[:, slot, :, src]  # (B, A, L, H, D)
        self.lengths += num

    def select(self, slots: Tensor) -> "KVCache":
        """A new cache holding only ``slots`` (in that order), e.g. the requests still running.

        Shape: slots [B'] int64 -> KVCache with batch size B'.
        """
        return KVCache(self.k.index_select(1, slots), self.v.index_select(1, slots),
                       self.lengths.index_select(0, slots))

    def reset_slots(self, slot_mask: Tensor) -> None:
        """Zero the K/V rows and the length of every slot where ``slot_mask`` is True. No host sync.

        Shape: slot_mask [B] bool.
        """
        if slot_mask.shape != self.lengths.shape or slot_mask.dtype != torch.bool:
            raise ValueError(f"slot_mask must be bool of shape {tuple(self.lengths.shape)}, got "
                             f"{slot_mask.dtype} {tuple(slot_mask.shape)}")
        slot_mask = slot_mask.to(self.lengths.device)
        m = slot_mask[None, :, None, None, None]
        self.k.masked_fill_(m, 0)
        self.v.masked_fill_(m, 0)
        self.lengths.masked_fill_(slot_mask, 0)
