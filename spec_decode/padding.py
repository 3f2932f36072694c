"""The prefill's token layouts: prompts right-padded into one tensor, and the first token placed after them."""

from __future__ import annotations

import torch


def right_pad(prompts, device):
    """Shape: -> ids [B, Pmax] (pad 0), lens [B]."""
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    return ids.to(device), torch.tensor([len(p) for p in prompts], device=device)


def shift_left_insert(ids, lens, token):
    """tokens[b, t] = ids[b, t+1] for t < lens[b]-1 and token[b] at lens[b]-1. Shape: [B, P]."""
    shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
    return shifted.scatter(1, (lens - 1)[:, None], token[:, None])


def append_at(ids, lens, token):
    """ids with token[b] written at position lens[b]. Shape: [B, P+1]."""
    padded = torch.cat([ids, torch.zeros_like(ids[:, :1])], 1)
    return padded.scatter(1, lens[:, None], token[:, None])
