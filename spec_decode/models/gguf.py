"""GGUF files (llama.cpp's format) read as a HF-layout config and state dict: Llama and Qwen2.

A GGUF file holds the architecture's hyperparameters as ``<arch>.*`` metadata keys and its weights
under llama.cpp's names (``blk.0.attn_q.weight``), often quantized. ``read_gguf`` returns what
``config.json`` and ``model.safetensors`` would hold for the same model:

* weights dequantized to float32 (``gguf.quants``), renamed to HF's keys;
* Llama's q/k projections un-permuted: llama.cpp's converter interleaves each head's rotary halves
  (``rotate_half`` pairs ``(i, i + d/2)`` become neighbours); Qwen2's are stored as HF has them;
* ``tie_word_embeddings`` when the file has no ``output.weight``; the EOS and BOS ids from the
  tokenizer metadata.

Errors name the file: CheckpointError (a ValueError) for one that is not a readable GGUF file
(truncated, another format), holds an architecture other than Llama or Qwen2, or whose head counts
do not describe its q/k tensors (naming the metadata key); ImportError naming the extra when the
``gguf`` package is absent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from spec_decode.models.checkpoint import CheckpointError

GGUF_SUFFIX = ".gguf"
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""GGUF ``general.architecture`` -> the HF class whose checkpoint it converts to."""

_LAYER_KEYS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_KEYS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


@dataclass
class GGUFCheckpoint:
    """What ``read_gguf`` found: ``config`` as HF's ``config.json`` dict, ``state`` under HF's key names
    (float32), whether the file holds a tokenizer (``tokenizer.ggml.tokens``)."""

    config: dict
    state: dict[str, torch.Tensor]
    has_tokenizer: bool


def is_gguf_file(path) -> bool:
    """True when ``path`` ends in ``.gguf`` (any case) and is not a directory: a GGUF checkpoint, to be
    read by ``read_gguf`` (which names it when it is missing)."""
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).lower().endswith(GGUF_SUFFIX) \
        and not os.path.isdir(path)


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Read the GGUF file ``path`` as a HF-layout Llama or Qwen2 checkpoint (module docstring)."""
    path = os.fspath(path)
    reader = _open(path)
    fields = _Fields(reader, path)
    arch = fields.get("general.architecture")
    if arch not in HF_ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; safespec runs "
                              f"{', '.join(HF_ARCHITECTURES)} (HF {', '.join(HF_ARCHITECTURES.values())})")
    config = _hf_config(fields, arch, {t.name for t in reader.tensors})
    state = {}
    for tensor in reader.tensors:
        key = _hf_key(tensor.name, path)
        state[key] = _dequantized(tensor, path)
    _check_head_rows(config, state, path, arch)
    if arch == "llama":   # llama.cpp's converter permutes Llama's q/k rows; Qwen2's it leaves alone
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        for name, n in (("q_proj", heads), ("k_proj", kv_heads)):
            for i in range(config["num_hidden_layers"]):
                key = f"model.layers.{i}.self_attn.{name}.weight"
                if key in state:
                    state[key] = unpermute_rotary_rows(state[key], n)
    return GGUFCheckpoint(config, state, reader.get_field("tokenizer.ggml.tokens") is not None)


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: within each head, rows ``(2j, 2j + 1)`` go back to
    ``(j, j + d/2)``, HF's ``rotate_half`` layout.

    Shape: weight [num_heads * d, in] -> [num_heads * d, in].
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# ------------------------------------------------------------------------------------------- reading
def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError('reading GGUF files needs the gguf package: pip install "safespec[smollm2]" '
                          "(or pip install gguf)") from None
    return gguf


def _open(path: str):
    """A ``gguf.GGUFReader`` over ``path``; CheckpointError naming the file when it is not a GGUF file or
    its tensors run past its end (a truncated download)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path!r}")
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:   # the reader raises ValueError, KeyError, IndexError... on bad bytes
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise CheckpointError(f"{path} is truncated: tensor {t.name} needs {t.n_bytes} bytes, "
                                  f"the file holds {t.data.nbytes}")
    return reader


class _Fields:
    """Metadata lookup whose errors name the file and the key."""

    _MISSING = object()

    def __init__(self, reader, path: str):
        self.reader, self.path = reader, path

    def get(self, key: str, default=_MISSING):
        field = self.reader.get_field(key)
        if field is None:
            if default is self._MISSING:
                raise CheckpointError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        try:
            value = field.contents()
        except Exception as e:
            raise CheckpointError(f"{self.path}: GGUF metadata key {key!r} is unreadable: {e}") from None
        return value


def _float32_repr(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds back to it (1e-05, not 9.99e-06)."""
    import numpy as np   # the gguf package's own dependency

    return float(str(np.float32(value)))


def _hf_config(fields: _Fields, arch: str, tensor_names: set[str]) -> dict:
    """HF ``config.json`` for the file's ``arch`` hyperparameters."""
    heads = int(fields.get(f"{arch}.attention.head_count"))
    hidden = int(fields.get(f"{arch}.embedding_length"))
    kv_heads = int(fields.get(f"{arch}.attention.head_count_kv", heads))
    for key, n in (("head_count", heads), ("head_count_kv", kv_heads)):
        if n < 1:
            raise CheckpointError(f"{fields.path}: GGUF metadata key '{arch}.attention.{key}' must be >= 1, got {n}; "
                                  "the file is damaged: convert the model again")
    tokens = fields.get("tokenizer.ggml.tokens", None)
    vocab = fields.get(f"{arch}.vocab_size", None) or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise CheckpointError(f"{fields.path}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or "rope_freqs.weight" in tensor_names:
        raise CheckpointError(f"{fields.path}: GGUF rope scaling {scaling!r} (or a rope_freqs tensor) is not "
                              "supported; safespec reads unscaled and linear rope from GGUF")
    config = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(fields.get(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(fields.get(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(fields.get(f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": _float32_repr(fields.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_repr(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(fields.get(f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "float32",
    }
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(fields.get(f"{arch}.rope.scaling.factor"))}
    for name in ("bos_token_id", "eos_token_id"):
        token_id = fields.get(f"tokenizer.ggml.{name}", None)
        if token_id is not None:
            config[name] = int(token_id)
    return config


def _check_head_rows(config: dict, state: dict[str, torch.Tensor], path: str, arch: str) -> None:
    """Each layer's q/k projection has ``head_count`` / ``head_count_kv`` heads of ``head_dim`` rows;
    CheckpointError naming the file, the metadata key and the tensor otherwise (metadata that does not
    describe the tensors would fail as a reshape deep inside the load)."""
    head_dim = config["head_dim"]
    for name, heads_key, gguf_name in (("q_proj", "num_attention_heads", "attn_q"),
                                       ("k_proj", "num_key_value_heads", "attn_k")):
        n = config[heads_key]
        key = f"{arch}.attention.{'head_count' if name == 'q_proj' else 'head_count_kv'}"
        for i in range(config["num_hidden_layers"]):
            w = state.get(f"model.layers.{i}.self_attn.{name}.weight")
            if w is not None and w.shape[0] != n * head_dim:
                raise CheckpointError(
                    f"{path}: GGUF metadata key {key!r} = {n} heads of {head_dim} rows (head_dim: "
                    f"{arch}.rope.dimension_count, else embedding_length / head_count) make {n * head_dim} rows, "
                    f"but tensor blk.{i}.{gguf_name}.weight has {w.shape[0]}: the file's metadata does not "
                    "describe its tensors; convert the model again")


def _hf_key(name: str, path: str) -> str:
    """HF's key for llama.cpp tensor ``name``; CheckpointError naming the file for one it does not know."""
    if name in _TOP_KEYS:
        return _TOP_KEYS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_KEYS:
        return f"model.layers.{parts[1]}.{_LAYER_KEYS[parts[2]]}"
    raise CheckpointError(f"{path}: GGUF tensor {name!r} has no counterpart in a Llama/Qwen2 checkpoint")


def _dequantized(tensor, path: str) -> torch.Tensor:
    """One GGUF tensor as float32, in HF's [out, in] shape (GGUF lists dimensions innermost first)."""
    gguf = _gguf()
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {tensor.name} uses quantization {tensor.tensor_type.name}, "
                              "which the gguf package cannot dequantize") from None
    import numpy as np

    shape = tuple(int(d) for d in reversed(tensor.shape))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))   # a copy: the file is mapped read-only


# ------------------------------------------------------------------------------------------ converting
def save_gguf_as_hf_dir(path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Write the GGUF file ``path`` to ``out_dir`` as a HF-layout checkpoint: ``config.json``,
    ``generation_config.json`` (its EOS and BOS ids), ``model.safetensors`` (float32; a tied
    ``lm_head`` omitted, as HF saves it) and, where ``transformers`` is installed, the tokenizer
    files with the chat template (``AutoTokenizer.from_pretrained(gguf_file=)``) when the file has a tokenizer.

    Writes into ``out_dir`` as it goes: callers that need an all-or-nothing directory write into a
    temporary one and rename it (``spec_decode.fixtures.smollm2_target_dir``).
    """
    import json

    from spec_decode.models.checkpoint import GENERATION_CONFIG_NAME, save_state_dict

    checkpoint = read_gguf(path)
    state = dict(checkpoint.state)
    if checkpoint.config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    os.makedirs(out_dir, exist_ok=True)
    save_state_dict(state, out_dir, checkpoint.config)
    generation = {k: checkpoint.config[k] for k in ("bos_token_id", "eos_token_id") if k in checkpoint.config}
    with open(os.path.join(out_dir, GENERATION_CONFIG_NAME), "w") as f:
        json.dump(generation, f, indent=2, sort_keys=True)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return
    if not checkpoint.has_tokenizer:
        return
    folder, name = os.path.split(os.path.abspath(path))
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
