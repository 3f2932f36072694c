"""Tests for spec_decode.models: HF parity, checkpoint IO, and KV-cache semantics (tree, commit, padding, reset).

HF parity tolerance: float32, atol = rtol = 1e-4 on logits of O(1) magnitude (observed differences ~1e-6;
they come from a different attention kernel path and op order, not from semantics).
Cache-consistency tolerance: float32, atol = 1e-5 (same kernels, different query blocking).
"""

from __future__ import annotations

import json

import pytest
import torch

from spec_decode.models.checkpoint import SAFETENSORS_INDEX_NAME
from spec_decode.models import KVCache, ModelConfig, Transformer, build_attention_mask, causal_block_mask
from spec_decode.models.kv_cache import scatter_rows

from tiny_models import _randomize_, make_tiny_target, tiny_config

transformers = pytest.importorskip("transformers", reason="transformers not installed (HF parity tests need it)")

HF_ATOL = HF_RTOL = 1e-4
CACHE_ATOL = 1e-5

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def _hf_model(kind: str, seed: int = 0):
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0)
    elif kind == "llama3_rope":
        cfg = transformers.LlamaConfig(**common, rope_scaling=dict(LLAMA3_ROPE), rope_theta=500000.0)
    elif kind == "llama_linear_bias_mha":
        cfg = transformers.LlamaConfig(**{**common, "num_key_value_heads": 4}, attention_bias=True,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0})
    elif kind == "qwen2_tied":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    else:
        raise AssertionError(kind)
    torch.manual_seed(seed)
    model = {"qwen2_tied": transformers.Qwen2ForCausalLM}.get(kind, transformers.LlamaForCausalLM)(cfg).eval()
    _randomize_(model, seed)  # HF's init has zero biases and unit norms: randomize so every term matters
    return model


def _ids(B: int, T: int, V: int = 97, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "llama_linear_bias_mha", "qwen2_tied"])
def test_logits_match_transformers(kind, tmp_path):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    ours = Transformer.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = _ids(2, 40)  # positions up to 39 > original_max_position_embeddings=16: llama3 scaling is exercised
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = ours(ids, ours.new_cache(2, 48), aux_layers=(0, 1))
    torch.testing.assert_close(out.logits, ref.logits, atol=HF_ATOL, rtol=HF_RTOL)
    torch.testing.assert_close(out.hidden, ref.hidden_states[-1], atol=HF_ATOL, rtol=HF_RTOL)  # post final norm
    # aux layer i = residual stream after decoder layer i = HF hidden_states[i + 1]
    torch.testing.assert_close(out.aux_hidden[0], ref.hidden_states[1], atol=HF_ATOL, rtol=HF_RTOL)
    torch.testing.assert_close(out.aux_hidden[1], ref.hidden_states[2], atol=HF_ATOL, rtol=HF_RTOL)
    assert ref.logits.std() > 0.3  # the comparison is not between two near-zero tensors

    # our save -> transformers load gives the same model back
    ours.save_pretrained(tmp_path / "ours")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf2(ids).logits, ref.logits, atol=HF_ATOL, rtol=HF_RTOL)


def test_llama3_rope_scaling_changes_logits(tmp_path):
    """Guards the parity test above: without scaling the llama3 checkpoint's logits differ."""
    hf = _hf_model("llama3_rope")
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    ours = Transformer.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.config.rope_scaling["rope_type"] == "llama3"
    ours.config.rope_scaling = None
    ours.clear_inv_freq()
    ids = _ids(1, 40)
    with torch.no_grad():
        diff = (ours(ids, ours.new_cache(1, 40)).logits - hf(ids).logits).abs().max()
    assert diff > 1e-2, cfg


def test_config_parsing_variants():
    v4 = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
          "num_attention_heads": 2, "rope_theta": 5.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    c = ModelConfig.from_hf_dict(v4)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0} and c.rope_theta == 5.0
    assert c.num_key_value_heads == 2 and c.head_dim == 4 and not c.attention_bias
    v5 = {**v4, "rope_scaling": None, "rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}
    v5.pop("rope_theta")
    c5 = ModelConfig.from_hf_dict(v5)
    assert c5.rope_scaling is None and c5.rope_theta == 7.0
    assert ModelConfig.from_hf_dict({**v4, "model_type": "qwen2"}).attention_bias
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_hf_dict({**v4, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_dict({**v4, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_config(num_attention_heads=4, num_key_value_heads=3)


# ------------------------------------------------------------------------------------------ checkpoint IO
def _write_sharded(model: Transformer, path, fmt: str) -> None:
    """Write ``model`` as two shards plus an index (HF naming)."""
    from safetensors.torch import save_file

    model.save_pretrained(path)  # config.json + model.safetensors
    (path / "model.safetensors").unlink()
    state = {("model." + k if k != "lm_head.weight" else k): v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(state)
    ext = "safetensors" if fmt == "safetensors" else "bin"
    prefix = "model" if fmt == "safetensors" else "pytorch_model"
    shards = {f"{prefix}-00001-of-00002.{ext}": keys[: len(keys) // 2], f"{prefix}-00002-of-00002.{ext}": keys[len(keys) // 2:]}
    weight_map = {}
    for name, ks in shards.items():
        part = {k: state[k] for k in ks}
        save_file(part, path / name) if fmt == "safetensors" else torch.save(part, path / name)
        weight_map.update({k: name for k in ks})
    index = SAFETENSORS_INDEX_NAME if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (path / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


BAD_CONFIG_VALUES = [  # (key, bad value, message): each must raise a ValueError naming the key and the file
    ("rope_theta", float("nan"), "rope_theta must be a finite positive number, got nan"),
    ("rope_theta", float("inf"), "rope_theta must be a finite positive number, got inf"),
    ("rope_theta", 0.0, "rope_theta must be a finite positive number"),
    ("rope_theta", -1e4, "rope_theta must be a finite positive number"),
    ("rope_theta", "1e4", "rope_theta must be a finite positive number"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps must be a finite positive number"),
    ("rms_norm_eps", 0, "rms_norm_eps must be a finite positive number"),
    ("hidden_size", 0, "hidden_size must be a positive integer, got 0"),
    ("hidden_size", -32, "hidden_size must be a positive integer"),
    ("hidden_size", 32.0, "hidden_size must be a positive integer"),
    ("vocab_size", 0, "vocab_size must be a positive integer"),
    ("intermediate_size", "64", "intermediate_size must be a positive integer"),
    ("num_hidden_layers", 0, "num_hidden_layers must be a positive integer"),
    ("num_attention_heads", 0, "num_attention_heads must be a positive integer"),
    ("num_attention_heads", True, "num_attention_heads must be a positive integer"),
    ("num_attention_heads", 5, r"hidden_size \(32\) must be divisible by num_attention_heads \(5\) when head_dim"),
    ("num_key_value_heads", 0, "num_key_value_heads must be a positive integer"),
    ("num_key_value_heads", 3, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ("head_dim", 0, "head_dim must be a positive integer"),
    ("head_dim", 7, r"head_dim \(7\) must be even"),
    ("max_position_embeddings", -1, "max_position_embeddings must be a positive integer"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings must be true or false"),
    ("rope_scaling", {"rope_type": "linear", "factor": float("nan")}, "rope_scaling.factor must be a finite positive"),
    ("rope_scaling", {"rope_type": "linear"}, "rope_scaling.factor must be a finite positive number, got None"),
    ("rope_scaling", {**LLAMA3_ROPE, "factor": 0.0}, "rope_scaling.factor must be a finite positive"),
    ("rope_scaling", {**LLAMA3_ROPE, "low_freq_factor": 4.0, "high_freq_factor": 4.0},
     "low_freq_factor .* must be below rope_scaling.high_freq_factor"),
    ("rope_scaling", {**LLAMA3_ROPE, "original_max_position_embeddings": float("inf")},
     "rope_scaling.original_max_position_embeddings must be a finite positive"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_type 'yarn' is not supported"),
]


@pytest.mark.parametrize("key, value, match", BAD_CONFIG_VALUES,
                         ids=[f"{k}={v!r}"[:60] for k, v, _ in BAD_CONFIG_VALUES])
def test_bad_config_values_raise_value_error_naming_key_and_file(tmp_path, key, value, match):
    path = make_tiny_target(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg[key] = value
    if key == "num_attention_heads" and value == 5:
        cfg.pop("head_dim")  # derived from hidden_size, as most configs do
        cfg["num_key_value_heads"] = 5
    (path / "config.json").write_text(json.dumps(cfg))  # NaN/Infinity: Python's json writes and reads them
    with pytest.raises(ValueError, match=match) as err:
        Transformer.from_pretrained(path, dtype=torch.float32)
    assert str(path / "config.json") in str(err.value)
    if key != "rope_scaling":
        assert key in str(err.value)


def test_good_config_values_still_load(tmp_path):
    """Integer-valued rope_theta (common in HF configs) and head_dim given explicitly with H % nh != 0."""
    path = make_tiny_target(tmp_path, num_attention_heads=5, num_key_value_heads=1, head_dim=8)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_theta"] = 500000
    (path / "config.json").write_text(json.dumps(cfg))
    model = Transformer.from_pretrained(path, dtype=torch.float32)
    assert model.config.rope_theta == 500000.0 and isinstance(model.config.rope_theta, float)
    assert model.config.head_dim == 8


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_sharded_index_loading(tmp_path, fmt):
    src = Transformer.from_pretrained(make_tiny_target(tmp_path), dtype=torch.float32)
    _write_sharded(src, tmp_path / "sharded", fmt)
    loaded = Transformer.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    for (k, a), (k2, b) in zip(src.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k


def test_pytorch_model_bin_fallback(tmp_path):
    src = Transformer.from_pretrained(make_tiny_target(tmp_path), dtype=torch.float32)
    d = tmp_path / "bin"
    src.save_pretrained(d)
    (d / "model.safetensors").unlink()
    torch.save({"model." + k if k != "lm_head.weight" else k: v for k, v in src.state_dict().items()},
               d / "pytorch_model.bin")
    loaded = Transformer.from_pretrained(d, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), loaded.state_dict().values()))


def test_dtype_and_roundtrip(tmp_path):
    path = make_tiny_target(tmp_path)
    m = Transformer.from_pretrained(path)  # default bfloat16
    assert m.dtype == torch.bfloat16 and m.new_cache(1, 4).k.dtype == torch.bfloat16
    m.save_pretrained(tmp_path / "again")
    m2 = Transformer.from_pretrained(tmp_path / "again")
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    assert json.loads((tmp_path / "again" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_missing_files_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Transformer.from_pretrained(tmp_path)
    path = make_tiny_target(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=str(path)):
        Transformer.from_pretrained(path)
    src = Transformer.from_pretrained(make_tiny_target(tmp_path, name="t2"), dtype=torch.float32)
    _write_sharded(src, tmp_path / "sh", "safetensors")
    (tmp_path / "sh" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        Transformer.from_pretrained(tmp_path / "sh")


def test_key_mismatch_names_keys(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_target(tmp_path)
    state = load_file(path / "model.safetensors")
    state["model.layers.0.mystery.weight"] = state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing keys \[layers\.1\.mlp\.up_proj\.weight\].*unexpected keys "
                                         r"\[layers\.0\.mystery\.weight\]"):
        Transformer.from_pretrained(path)
    state["model.layers.1.mlp.up_proj.weight"] = state.pop("model.layers.0.mystery.weight")[:, :3].contiguous()
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj.weight has shape"):
        Transformer.from_pretrained(path)


# ------------------------------------------------------------------------------------------ cache semantics
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_target(tmp_path_factory.mktemp("model"), rope_scaling=dict(LLAMA3_ROPE))
    return Transformer.from_pretrained(path, dtype=torch.float32)


def _fresh_logits(model, ids_row: list[int]) -> torch.Tensor:
    """Logits of one request run as a single causal block on a fresh cache. Shape [T, V]."""
    ids = torch.tensor([ids_row])
    return model(ids, model.new_cache(1, len(ids_row))).logits[0]


@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(model):
    ids = _ids(3, 12, seed=1)
    full = model(ids, model.new_cache(3, 16)).logits
    cache = model.new_cache(3, 16)
    parts = [model(ids[:, :5], cache).logits]
    cache.commit(torch.full((3,), 5))
    for t in range(5, 12):
        parts.append(model(ids[:, t:t + 1], cache, kv_len=t + 1).logits)  # kv_len slicing exercised too
        cache.commit(torch.ones(3, dtype=torch.int32))
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=CACHE_ATOL, rtol=0)
    assert cache.lengths.tolist() == [12, 12, 12]


# tree:      0
#          / | \
#         1  2  3
#        / \     \
#       4   5     6
#           |
#           7
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 3, 5]


def _tree_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


@torch.no_grad()
def test_tree_block_equals_each_path_run_separately(model):
    prompts = _ids(2, 6, seed=2)
    tree_tokens = _ids(2, len(TREE_PARENTS), seed=3)
    mask = _tree_mask(TREE_PARENTS)[None].expand(2, -1, -1)
    depth = torch.tensor([len(_path(TREE_PARENTS, i)) - 1 for i in range(len(TREE_PARENTS))])
    cache = model.new_cache(2, 16)
    model(prompts, cache)
    cache.commit(torch.full((2,), 6))
    out = model(tree_tokens, cache, tree_mask=mask, position_ids=6 + depth[None].expand(2, -1)).logits
    for b in range(2):
        for node in range(len(TREE_PARENTS)):
            row = prompts[b].tolist() + [tree_tokens[b, i].item() for i in _path(TREE_PARENTS, node)]
            torch.testing.assert_close(out[b, node], _fresh_logits(model, row)[-1], atol=CACHE_ATOL, rtol=0)


@torch.no_grad()
def test_tree_mask_matters(model):
    """Mutant check for the test above: a causal mask over the same tree block gives different logits."""
    prompts, tree_tokens = _ids(1, 6, seed=2), _ids(1, len(TREE_PARENTS), seed=3)
    cache = model.new_cache(1, 16)
    model(prompts, cache)
    cache.commit(torch.tensor([6]))
    causal = model(tree_tokens, cache).logits[0, 2]
    row = prompts[0].tolist() + [tree_tokens[0, 0].item(), tree_tokens[0, 2].item()]
    assert (causal - _fresh_logits(model, row)[-1]).abs().max() > 1e-3


@torch.no_grad()
def test_commit_rel_idx_then_continue_equals_fresh_run(model):
    prompts = _ids(2, 6, seed=4)
    tree_tokens = _ids(2, len(TREE_PARENTS), seed=5)
    mask = _tree_mask(TREE_PARENTS)[None].expand(2, -1, -1)
    cache = model.new_cache(2, 20)
    model(prompts, cache)
    cache.commit(torch.full((2,), 6))
    depth = torch.tensor([len(_path(TREE_PARENTS, i)) - 1 for i in range(len(TREE_PARENTS))])
    model(tree_tokens, cache, tree_mask=mask, position_ids=6 + depth[None].expand(2, -1))
    # request 0 accepts 0 -> 1 -> 5 -> 7, request 1 accepts 0 -> 3 (padded with -1)
    accepted = torch.tensor([[0, 1, 5, 7], [0, 3, -1, -1]])
    num = torch.tensor([4, 2])
    cache.commit(num, accepted)
    assert cache.lengths.tolist() == [10, 8]
    nxt = _ids(2, 3, seed=6)
    out = model(nxt, cache).logits
    for b in range(2):
        path = [tree_tokens[b, i].item() for i in accepted[b, : num[b]].tolist()]
        ref = _fresh_logits(model, prompts[b].tolist() + path + nxt[b].tolist())[-3:]
        torch.testing.assert_close(out[b], ref, atol=CACHE_ATOL, rtol=0)


@torch.no_grad()
def test_commit_overlapping_moves_are_safe():
    """Row j := row rel_idx[j] with sources that are later overwritten (0 <- 1, 1 <- 2, 2 <- 0 rotation)."""
    cache = KVCache.empty(1, 1, 1, 6, 1, dtype=torch.float32)
    cache.k[0, 0, 0, :, 0] = torch.arange(6.0)
    cache.lengths.fill_(2)
    cache.commit(torch.tensor([3]), torch.tensor([[1, 2, 0, -1]]))
    assert cache.k[0, 0, 0, :, 0].tolist() == [0, 1, 3, 4, 2, 5]
    assert cache.lengths.tolist() == [5]


@torch.no_grad()
def test_right_padded_batch_equals_per_request_runs(model):
    lens = [5, 9, 1]
    prompts = [_ids(1, n, seed=10 + i)[0].tolist() for i, n in enumerate(lens)]
    padded = torch.zeros(3, 9, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = torch.tensor(p)
    input_lens = torch.tensor(lens)
    cache = model.new_cache(3, 12)
    out = model(padded, cache, input_lens=input_lens).logits
    assert torch.isfinite(out).all()  # padded query rows never see an empty softmax row
    cache.commit(input_lens)
    step = _ids(3, 2, seed=20)
    out2 = model(step, cache).logits
    for b, p in enumerate(prompts):
        ref = _fresh_logits(model, p + step[b].tolist())
        torch.testing.assert_close(out[b, : lens[b]], ref[: lens[b]], atol=CACHE_ATOL, rtol=0)
        torch.testing.assert_close(out2[b], ref[lens[b]:], atol=CACHE_ATOL, rtol=0)


def test_mask_has_no_empty_rows():
    lengths = torch.tensor([0, 3])
    tree = torch.zeros(2, 4, 4, dtype=torch.bool)  # even a tree mask without the diagonal
    m = build_attention_mask(lengths, 4, 8, tree, input_lens=torch.tensor([0, 2]))
    assert m.shape == (2, 1, 4, 8) and m.any(-1).all()
    causal = build_attention_mask(torch.tensor([2]), 3, 6)[0, 0]
    assert causal.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]


@torch.no_grad()
def test_reset_slots_zeros_only_masked_slots(model):
    cache = model.new_cache(3, 10)
    model(_ids(3, 5, seed=7), cache)
    cache.commit(torch.tensor([5, 4, 3]))
    before_k, before_v = cache.k.clone(), cache.v.clone()
    cache.reset_slots(torch.tensor([False, True, False]))
    assert cache.lengths.tolist() == [5, 0, 3]
    assert (cache.k[:, 1] == 0).all() and (cache.v[:, 1] == 0).all()
    for b in (0, 2):
        assert torch.equal(cache.k[:, b], before_k[:, b]) and torch.equal(cache.v[:, b], before_v[:, b])
    # a reset slot then behaves like a fresh one
    ids = _ids(3, 4, seed=8)
    out = model(ids, cache).logits[1]
    torch.testing.assert_close(out, _fresh_logits(model, ids[1].tolist()), atol=CACHE_ATOL, rtol=0)


def test_bad_inputs_raise_value_error(model):
    cache = model.new_cache(2, 8)
    ids = _ids(2, 3)
    with pytest.raises(ValueError, match="input_ids"):
        model(ids.float(), cache)
    with pytest.raises(ValueError, match="cache has batch size 2"):
        model(_ids(3, 3), cache)
    with pytest.raises(ValueError, match="tree_mask"):
        model(ids, cache, tree_mask=torch.ones(2, 3, 3))
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, cache, position_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="input_lens"):
        model(ids, cache, input_lens=torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="aux_layers"):
        model(ids, cache, aux_layers=(7,))
    with pytest.raises(ValueError, match="kv_len"):
        model(ids, cache, kv_len=9)
    with pytest.raises(ValueError, match="slot_mask"):
        cache.reset_slots(torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="rel_idx"):
        cache.commit(torch.ones(2), torch.zeros(3, 1, dtype=torch.long))


# ------------------------------------------------------------------ exact NaN propagation
def _tree_logits_with_poisoned_node(model, poison: int):
    """A 5-node tree after a 6-token prefix; node ``poison``'s K/V rows are NaN in every layer.

    Tree: 0 -> 1 -> 3, 0 -> 2 -> 4. Returns logits [5, V] of the block.
    """
    from spec_decode.drafting import ancestor_mask

    cache = model.new_cache(1, 16)
    model(torch.arange(1, 7)[None], cache)
    cache.commit(torch.tensor([6]))
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    mask = ancestor_mask(parents, 2)
    depth = torch.tensor([[0, 1, 1, 2, 2]])
    tokens = torch.tensor([[7, 8, 9, 10, 11]])
    model(tokens, cache, tree_mask=mask, position_ids=6 + depth)   # writes rows 6..10
    cache.k[:, 0, :, 6 + poison] = float("nan")
    cache.v[:, 0, :, 6 + poison] = float("nan")
    # Re-run the block without rewriting the poisoned row: attend to it as a cached row would be. The
    # fused attention block (and the one-call layer) writes the cache itself, so the layer's ops run one at a
    # time here (the
    # fused block's NaN reach: tests/spec_decode/cpu/test_cpu_attention.py).
    from spec_decode.models import layers

    hook, fits, layer_fits = cache.write_rows, layers.attention_block_fits, layers.decoder_layer_fits
    cache.write_rows = lambda layer, index, k, v: None
    layers.attention_block_fits = layers.decoder_layer_fits = lambda *a, **k: False
    try:
        return model(tokens, cache, tree_mask=mask, position_ids=6 + depth).logits[0]
    finally:
        cache.write_rows, layers.attention_block_fits, layers.decoder_layer_fits = hook, fits, layer_fits


@pytest.mark.parametrize("exact,invariant", [(True, False), (False, False), (False, None)],
                         ids=["exact", "plain_sdpa_mutant", "batch_invariant_kernel"])
def test_exact_nan_reaches_only_the_poisoned_branch(tiny_target_dir, exact, invariant):
    """exact_nan over SDPA, plain SDPA (the mutant: it leaks), and the batch-invariant kernel, which never
    reads a masked key, so it is exact without exact_nan."""
    from spec_decode.cpu import cpu_gemm
    from spec_decode.models import set_exact_nan

    if invariant is None and not cpu_gemm.available():
        pytest.skip("the batch-invariant kernel needs cpu_gemm")
    model = Transformer.from_pretrained(tiny_target_dir, dtype=torch.float32, batch_invariant=invariant)
    set_exact_nan(model, exact, torch.float32)
    with torch.no_grad():
        clean = _tree_logits_with_poisoned_node(model, poison=0).clone()   # root poisoned: all NaN
        got = _tree_logits_with_poisoned_node(model, poison=1)
    nan_rows = torch.isnan(got).any(-1).tolist()
    assert torch.isnan(clean).any(-1).all()
    if exact or invariant is None:
        assert nan_rows == [False, True, False, True, False]   # node 1 and its child 3 only
    else:
        assert nan_rows == [True] * 5                           # SDPA leaks 0 * NaN everywhere


def test_exact_nan_leaves_finite_results_bit_identical(tiny_target_dir):
    from spec_decode.models import set_exact_nan

    model = Transformer.from_pretrained(tiny_target_dir, dtype=torch.float32)
    ids = torch.arange(3, 20)[None]
    outs = []
    for flag in (False, True):
        set_exact_nan(model, flag, torch.float32)
        with torch.no_grad():
            outs.append(model(ids, model.new_cache(1, 32)).logits)
    assert torch.equal(outs[0], outs[1])


def test_exact_nan_defaults_on_for_float16_only(tiny_target_dir):
    from spec_decode.models import Attention

    for dtype, want in [(torch.float16, True), (torch.bfloat16, False), (torch.float32, False)]:
        model = Transformer.from_pretrained(tiny_target_dir, dtype=dtype)
        assert {m.exact_nan for m in model.modules() if isinstance(m, Attention)} == {want}


# ------------------------------------------------------------------------------------------ fused projections
def _unfused_attention(attn, x, li, cache, layer):
    """The attention as it was before q/k/v were fused: three linears from the published weights, rope on
    [B, nh, T, D], and a bool SDPA mask (the same kernels otherwise). Returns [B, T, H]."""
    import torch.nn.functional as F
    from spec_decode.models import apply_rope

    sd = attn.state_dict()
    B, T, _ = x.shape
    nh, nkv, D = attn.n_heads, attn.n_kv, attn.head_dim
    q = F.linear(x, sd["q_proj.weight"], sd.get("q_proj.bias")).view(B, T, nh, D).transpose(1, 2)
    k = F.linear(x, sd["k_proj.weight"], sd.get("k_proj.bias")).view(B, T, nkv, D).transpose(1, 2)
    v = F.linear(x, sd["v_proj.weight"], sd.get("v_proj.bias")).view(B, T, nkv, D).transpose(1, 2)
    cos, sin = li.cos.transpose(1, 2), li.sin.transpose(1, 2)  # [B, 1, T, D]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache.write(layer, li.write_pos, k, v)
    S = li.mask.shape[-1]
    q = q.reshape(B, nkv, nh // nkv * T, D)
    out = F.scaled_dot_product_attention(q, cache.k[layer][:, :, :S], cache.v[layer][:, :, :S], attn_mask=li.mask)
    return F.linear(out.view(B, nh, T, D).transpose(1, 2).reshape(B, T, nh * D), sd["o_proj.weight"],
                    sd.get("o_proj.bias"))


@pytest.mark.usefixtures("fast_routes")
@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2_bias"])
def test_fused_projections_equal_the_unfused_computation(tmp_path, dtype, bias):
    """Issue #13: one q/k/v linear and one gate/up linear compute what the separate ones did."""
    import torch.nn.functional as F
    from spec_decode.models import LayerInputs, prepare_block

    model = Transformer.from_pretrained(make_tiny_target(tmp_path, attention_bias=bias, model_type="qwen2" if bias
                                                         else "llama"), dtype=dtype)
    layer = model.layers[1]
    B, T = 2, 5
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    cache = model.new_cache(B, 16)
    cache.lengths.copy_(torch.tensor([3, 6]))
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool).expand(B, T, T)
    li = prepare_block(model, cache, T, dtype, None, tree, None, 12)
    ref_cache = KVCache(cache.k.clone(), cache.v.clone(), cache.lengths.clone())
    got = layer.self_attn(x, li, cache, 1)
    ref = _unfused_attention(layer.self_attn, x, li, ref_cache, 1)
    tol = dict(atol=1e-6, rtol=0) if dtype == torch.float32 else dict(atol=0, rtol=0)  # bf16: bit for bit here
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(cache.k, ref_cache.k, **tol)
    torch.testing.assert_close(cache.v, ref_cache.v, **tol)
    sd = layer.mlp.state_dict()
    ref_mlp = F.linear(F.silu(F.linear(x, sd["gate_proj.weight"])) * F.linear(x, sd["up_proj.weight"]),
                       sd["down_proj.weight"])
    torch.testing.assert_close(layer.mlp(x), ref_mlp, **tol)
    assert isinstance(li, LayerInputs)


def test_state_dict_keeps_the_published_layout(tmp_path):
    """Fused at load time only: state_dict, save_pretrained and load_state_dict speak the HF key names."""
    from safetensors import safe_open

    path = make_tiny_target(tmp_path, attention_bias=True, model_type="qwen2")
    model = Transformer.from_pretrained(path, dtype=torch.float32)
    keys = set(model.state_dict())
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in keys)
    for p in ("q", "k", "v"):
        assert f"layers.0.self_attn.{p}_proj.weight" in keys and f"layers.0.self_attn.{p}_proj.bias" in keys
    assert {"layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"} <= keys
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys()}
    for k, v in model.state_dict().items():
        hf = "lm_head.weight" if k == "lm_head.weight" else "model." + k
        assert torch.equal(v, on_disk[hf]), k
    model.save_pretrained(tmp_path / "again")
    with safe_open(str(tmp_path / "again" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(on_disk)
    # a plain state-dict round trip into a fresh model gives the same fused weights
    fresh = Transformer(model.config)
    fresh.load_state_dict(model.state_dict())
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
    # keep_vars: views of the fused parameters, so shapes and gradients follow them
    q = model.state_dict(keep_vars=True)["layers.0.self_attn.q_proj.weight"]
    assert q.shape == (32, 32) and q.data_ptr() == model.layers[0].self_attn.qkv_proj.weight.data_ptr()


# ------------------------------------------------------------------------------------------ block inputs
def _mask_by_definition(lengths, num_new, kv_len, tree_mask, input_lens, n_rep):
    """``build_attention_mask``'s docstring, element by element."""
    B = len(lengths)
    span = num_new if tree_mask is None else tree_mask.shape[-1]
    past = span - num_new
    out = torch.zeros(B, 1, n_rep * num_new, kv_len, dtype=torch.bool)
    for b in range(B):
        for t in range(num_new):
            for s in range(kv_len):
                j = s - int(lengths[b])
                if j < 0:
                    vis = True
                elif j >= span:
                    vis = False
                elif j == past + t:
                    vis = True
                else:
                    vis = bool(tree_mask[b, t, j]) if tree_mask is not None else j <= past + t
                    if input_lens is not None and j >= past:
                        vis = vis and j - past < int(input_lens[b])
                for r in range(n_rep):
                    out[b, 0, r * num_new + t, s] = vis
    return out


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("n_rep", [1, 3])
def test_attention_mask_matches_its_definition(tree, padded, n_rep):
    g = torch.Generator().manual_seed(n_rep * 4 + tree * 2 + padded)
    B, T, kv_len = 3, 4, 13
    span = T + 2 if tree else T                  # a tree block appended after 2 earlier rows
    lengths = torch.tensor([0, 3, 7])
    tree_mask = torch.rand(B, T, span, generator=g) < 0.5 if tree else None
    input_lens = torch.tensor([4, 1, 0]) if padded else None
    got = build_attention_mask(lengths, T, kv_len, tree_mask, input_lens, n_rep=n_rep)
    assert got.shape == (B, 1, n_rep * T, kv_len)
    assert torch.equal(got, _mask_by_definition(lengths, T, kv_len, tree_mask, input_lens, n_rep))


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("n_rep", [1, 3])
def test_causal_block_mask_is_the_general_mask_without_tree_or_padding(T, n_rep):
    """The fast path every decode step takes gives the definition's mask, bit for bit."""
    lengths, kv_len = torch.tensor([0, 3, 7]), 13
    write_pos = lengths[:, None] + torch.arange(T)
    got = causal_block_mask(write_pos, kv_len, n_rep)
    assert got.shape == (3, 1, n_rep * T, kv_len)
    assert torch.equal(got, _mask_by_definition(lengths, T, kv_len, None, None, n_rep))


def test_rope_table_holds_the_computed_cos_sin(model):
    from spec_decode.models import rope_cos_sin

    table = model.rope_table(300, torch.float32)
    assert table.shape == (512, 2 * model.config.head_dim)   # grown to a power of two >= 256
    assert model.rope_table(40, torch.float32) is table       # reused while long enough
    pos = torch.tensor([[0, 5, 299, 511]])
    cos, sin = rope_cos_sin(model.inv_freq(), pos, torch.float32)
    D = model.config.head_dim
    torch.testing.assert_close(table[pos[0], :D], cos[0, 0], atol=1e-6, rtol=0)
    torch.testing.assert_close(table[pos[0], D:], sin[0, 0], atol=1e-6, rtol=0)


@torch.no_grad()
def test_position_ids_outside_the_cache_are_named(model):
    cache = model.new_cache(1, 16)
    size = model.rope_table(16, torch.float32).shape[0]   # >= 256: the table outgrows small caches
    with pytest.raises(ValueError, match=rf"position_ids must lie in \[0, {size}\)"):
        model(torch.tensor([[1, 2]]), cache, position_ids=torch.tensor([[3, size]]))
    with pytest.raises(ValueError, match="position_ids"):
        model(torch.tensor([[1, 2]]), cache, position_ids=torch.tensor([[-1, 0]]))


def test_cache_write_casts_k_and_v_each_to_the_cache_dtype():
    """Under autocast k and v of one write can arrive in different dtypes (k roped in float32)."""
    cache = KVCache.empty(1, 1, 1, 4, 2, dtype=torch.float32)
    k = torch.tensor([[[[1.5, -2.0]]]])                        # float32
    v = torch.tensor([[[[0.25, 3.0]]]], dtype=torch.bfloat16)   # bf16
    cache.write(0, torch.tensor([[1]]), k, v)
    assert cache.k[0, 0, 0, 1].tolist() == [1.5, -2.0] and cache.v[0, 0, 0, 1].tolist() == [0.25, 3.0]
    assert cache.k.dtype == cache.v.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scatter_rows_copies_every_bit_as_the_float_scatter(dtype):
    """The 2-byte route (int16 views) writes the same bits as ``scatter_``: NaN payloads, -0.0, Inf,
    subnormals, from a transposed (non-contiguous) source, at scattered positions per request."""
    B, n_kv, S, T, D = 2, 3, 9, 3, 5
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-40, 3.0]).to(dtype)
    rows = torch.randn(B, T, n_kv, D).to(dtype)
    rows.view(-1)[:6] = special
    rows = rows.transpose(1, 2)                                   # [B, n_kv, T, D], not contiguous
    pos = torch.tensor([[4, 0, 7], [1, 8, 2]])
    index = pos[:, None, :, None].expand(B, n_kv, T, D)
    dest, want = torch.randn(B, n_kv, S, D).to(dtype), None
    want = dest.clone().scatter_(2, index, rows)
    scatter_rows(dest, index, rows)
    as_int = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(dest.view(as_int), want.view(as_int))


def test_scatter_rows_keeps_the_gradient_of_rows_under_autograd():
    rows = torch.randn(1, 1, 2, 4).to(torch.bfloat16).requires_grad_()
    dest = torch.zeros(1, 1, 5, 4, dtype=torch.bfloat16)
    index = torch.tensor([[1, 3]])[:, None, :, None].expand(1, 1, 2, 4)
    scatter_rows(dest, index, rows)
    dest.float().sum().backward()
    assert torch.equal(rows.grad, torch.ones_like(rows))
