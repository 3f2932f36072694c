"""Drive a real ``sglang.Engine`` on CPU with a tiny random bf16 Llama, for test_sglang_engine.py.

Run as a script, one engine per process, because a scheduler that dies (policy ``raise``)
sends SIGQUIT to its parent::

    python tests/spec_decode/integrations/_sglang_engine.py SPEC.json

SPEC holds ``model`` (a directory from ``write_tiny_llama``, or any HF-layout checkpoint), optional ``engine_args``
(merged over ``ENGINE_ARGS``, e.g. ``{"tp_size": 2}``), ``out`` (a JSON file the
results are written to after every call) and ``calls``: each ``{"input_ids": [[...], ...],
"rids": [...], "sampling_params": [{...}, ...], "stream": bool}``. A result per call:
``{"outputs": [{"rid", "output_ids", "finish_reason", "cached_tokens"}, ...]}`` or ``{"error": "..."}``;
streamed calls are collected per request. When a scheduler dies, SGLang's own SIGQUIT
handler kills the whole process tree, this driver included (SIGKILL): the results of the
calls before stay in ``out``, and the scheduler's error is in the driver's stderr.

``logit_bias`` plants NaN or -inf in one request's logits before the plugin's sampler hook:
SGLang adds it in ``ModelRunner._preprocess_logits``, ahead of ``Sampler._preprocess_logits``.
"""

from __future__ import annotations

import json
import os
import sys

VOCAB = 128
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 128

ENGINE_ARGS = dict(
    skip_tokenizer_init=True,  # token ids in and out: the tiny model has no tokenizer
    attention_backend="torch_native",
    device="cpu",
    dtype="bfloat16",
    disable_cuda_graph=True,
    max_total_tokens=2048,
    mem_fraction_static=0.05,
    log_level="info",
)


def write_tiny_llama(path: str, seed: int = 0) -> None:
    """Write a random bf16 LlamaForCausalLM (config.json + model.safetensors) to ``path``."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, hidden_act="silu",
    )
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (0.5 * torch.randn(*shape, generator=g)).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    head_dim = HIDDEN // HEADS
    weights = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": ones(HIDDEN),
               "lm_head.weight": rand(VOCAB, HIDDEN)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": ones(HIDDEN),
            p + "post_attention_layernorm.weight": ones(HIDDEN),
        }
    save_file(weights, os.path.join(path, "model.safetensors"))


def _outcome(item: dict) -> dict:
    meta = item.get("meta_info", {})
    return {"rid": meta.get("id"), "output_ids": item.get("output_ids", []), "finish_reason": meta.get("finish_reason"),
            "cached_tokens": meta.get("cached_tokens")}


def _run_call(engine, call: dict) -> dict:
    kwargs = dict(input_ids=call["input_ids"], sampling_params=call["sampling_params"], rid=call["rids"])
    if not call.get("stream"):
        return {"outputs": [_outcome(item) for item in engine.generate(**kwargs)]}
    # Streamed: chunks of every request interleave; keep each request's last chunk (it holds
    # the whole output so far, or the error for an aborted request).
    last = {}
    for chunk in engine.generate(stream=True, **kwargs):
        last[chunk.get("index", chunk["meta_info"]["id"])] = chunk
    return {"outputs": [_outcome(chunk) for chunk in last.values()]}


def main(spec_path: str) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    import sglang

    results = []

    def dump():
        with open(spec["out"], "w", encoding="utf-8") as f:
            json.dump(results, f)

    engine = sglang.Engine(model_path=spec["model"], **(ENGINE_ARGS | spec.get("engine_args", {})))
    try:
        for call in spec["calls"]:
            try:
                results.append(_run_call(engine, call))
            except Exception as exc:  # an aborted request surfaces here in a non-streamed call
                results.append({"error": f"{type(exc).__name__}: {getattr(exc, 'detail', exc)}"})
            dump()
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
