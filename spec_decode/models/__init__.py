"""The models: a Llama-family target or draft LM (``Transformer``), the EAGLE heads, the KV cache, checkpoints.

Glossary
--------
committed rows
    K/V rows ``0 .. lengths[b]-1`` of slot ``b``: tokens that are part of request ``b``'s sequence.
new block
    The ``T`` tokens of one forward call. Their K/V rows are written at ``lengths[b] + t`` but are not
    committed: ``KVCache.commit`` later keeps the accepted ones (moving them if they were tree nodes
    off the first path) and advances ``lengths``.
tree mask
    ``tree_mask[b, t, j]`` is True when new token ``t`` may attend to uncommitted row ``lengths[b] + j`` (its
    ancestors and itself). Shape [B, T, S] with S >= T: the new block is written at the last T of the S
    uncommitted rows, so a drafter can append one tree depth per call and attend to the rows it wrote
    before (nothing is committed until ``KVCache.commit``). ``None`` means causal, i.e. a chain.

Modules: ``config`` (``ModelConfig``), ``rope`` (rotary embedding), ``kv_cache``, ``masks`` (a forward's positions and
attention mask), ``layers``, ``transformer``, ``eagle`` (the EAGLE-1/2 and EAGLE-3 heads),
``checkpoint`` (HF checkpoint files). Linear layers come from ``spec_decode.cpu``, the one seam to
the CPU backend.
"""

from spec_decode.models.config import ModelConfig
from spec_decode.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from spec_decode.models.eagle import DraftOutput, Eagle3Head, EagleHead, load_drafter
from spec_decode.models.kv_cache import KVCache
from spec_decode.models.layers import (Attention, DecoderLayer, RMSNorm, batch_invariant_blocker, batch_invariant_in_force,
                                       ordinary_parameters, set_batch_invariant, set_exact_nan)
from spec_decode.models.masks import LayerInputs, build_attention_mask, causal_block_mask, prepare_block
from spec_decode.models.transformer import ModelOutput, Transformer

__all__ = ["Attention", "DecoderLayer", "DraftOutput", "Eagle3Head", "EagleHead", "KVCache", "LayerInputs",
           "ModelConfig", "ModelOutput", "RMSNorm", "Transformer", "apply_rope", "build_attention_mask",
           "batch_invariant_blocker", "batch_invariant_in_force", "causal_block_mask", "load_drafter",
           "ordinary_parameters", "prepare_block", "rope_cos_sin", "rope_inv_freq", "set_batch_invariant",
           "set_exact_nan"]
