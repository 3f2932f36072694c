"""Tests for spec_decode.eagle: both published head layouts, checkpoint round trips, layout detection, errors,
and the forward math against a cache-free reference written with plain matmuls (float32, atol 1e-5)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from spec_decode.eagle import DraftOutput, Eagle3Head, EagleHead, default_eagle3_aux_layers, load_drafter
from spec_decode.model import Transformer, apply_rope, rope_cos_sin

from tiny_models import make_tiny_eagle, make_tiny_eagle3, make_tiny_target

ATOL = 1e-5

EAGLE_KEYS = {
    "fc.weight", "fc.bias",
    *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    "layers.0.post_attention_layernorm.weight",
}
EAGLE3_KEYS = {
    "fc.weight",
    "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return Transformer.from_pretrained(make_tiny_target(tmp_path_factory.mktemp("t")), dtype=torch.float32)


def _ids(B, T, seed=0, V=97):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _features(target, ids, aux_layers=()):
    with torch.no_grad():
        return target(ids, target.new_cache(ids.shape[0], ids.shape[1]), aux_layers=aux_layers)


def _stored_keys(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


# ------------------------------------------------------------------------------------------ round trips
@torch.no_grad()
def test_eagle_roundtrip_bit_identical_and_key_names(target, tmp_path):
    head = make_tiny_eagle(target, tmp_path / "e")
    assert _stored_keys(tmp_path / "e") == EAGLE_KEYS
    assert json.loads((tmp_path / "e" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    loaded = EagleHead.from_pretrained(tmp_path / "e", target)
    ids = _ids(2, 7)
    feat = _features(target, ids).hidden
    a = head(ids, feat, head.new_cache(2, 8))
    b = loaded(ids, feat, loaded.new_cache(2, 8))
    assert isinstance(b, DraftOutput) and b.logits.shape == (2, 7, 97) and b.hidden.shape == (2, 7, 32)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
    assert loaded.embed_tokens is target.embed_tokens and loaded.lm_head is target.lm_head


@torch.no_grad()
def test_eagle3_roundtrip_bit_identical_and_key_names(target, tmp_path):
    head = make_tiny_eagle3(target, tmp_path / "e3", draft_vocab_size=40, aux_layers=(0, 1, 3))
    assert _stored_keys(tmp_path / "e3") == EAGLE3_KEYS
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 40 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    loaded = Eagle3Head.from_pretrained(tmp_path / "e3", target)
    assert loaded.aux_layers == (0, 1, 3) and loaded.draft_vocab_size == 40
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    ids = _ids(2, 7)
    tout = _features(target, ids, loaded.aux_layers)
    a = head(ids, head.fuse(tout.aux_hidden), head.new_cache(2, 8))
    b = loaded(ids, loaded.fuse(tout.aux_hidden), loaded.new_cache(2, 8))
    assert b.logits.shape == (2, 7, 40) and b.hidden.shape == (2, 7, 32)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)


@torch.no_grad()
def test_heads_load_pytorch_bin_with_model_prefix(target, tmp_path):
    for make, cls in ((make_tiny_eagle, EagleHead), (make_tiny_eagle3, Eagle3Head)):
        d = tmp_path / cls.__name__
        head = make(target, d)
        (d / "model.safetensors").unlink()
        torch.save({"model." + k: v for k, v in head.state_dict().items()}, d / "pytorch_model.bin")
        loaded = load_drafter(d, target)
        assert type(loaded) is cls
        for k, v in head.state_dict().items():
            assert torch.equal(v, loaded.state_dict()[k]), k


def test_eagle3_full_vocab_checkpoint_without_maps(target, tmp_path):
    from safetensors.torch import load_file, save_file

    make_tiny_eagle3(target, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["d2t"], state["t2d"]
    save_file(state, tmp_path / "model.safetensors")
    head = Eagle3Head.from_pretrained(tmp_path, target)
    ids = torch.arange(97)
    assert torch.equal(head.to_target_ids(ids), ids) and bool(head.t2d.all())


def test_load_drafter_detects_layouts(target, tmp_path):
    make_tiny_eagle(target, tmp_path / "e")
    make_tiny_eagle3(target, tmp_path / "e3")
    assert type(load_drafter(tmp_path / "e", target)) is EagleHead
    assert type(load_drafter(tmp_path / "e3", target)) is Eagle3Head
    draft_lm = load_drafter(make_tiny_target(tmp_path, name="lm", num_hidden_layers=1, seed=3), target)
    assert type(draft_lm) is Transformer and draft_lm.dtype == target.dtype
    with pytest.raises(ValueError, match="vocab size 50 does not match the target's vocab size 97"):
        load_drafter(make_tiny_target(tmp_path, name="lm50", vocab_size=50), target)
    from safetensors.torch import save_file

    (tmp_path / "odd").mkdir()
    save_file({"something.weight": torch.zeros(2)}, tmp_path / "odd" / "model.safetensors")
    with pytest.raises(ValueError, match="cannot detect the drafter layout"):
        load_drafter(tmp_path / "odd", target)


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("make", [make_tiny_eagle, make_tiny_eagle3])
def test_mismatched_sizes_raise_value_error_naming_both(target, tmp_path, make):
    other = Transformer.from_pretrained(make_tiny_target(tmp_path, name="wide", hidden_size=48), dtype=torch.float32)
    make(other, tmp_path / "h48")
    with pytest.raises(ValueError, match="hidden size 48 does not match the target's hidden size 32"):
        load_drafter(tmp_path / "h48", target)
    other = Transformer.from_pretrained(make_tiny_target(tmp_path, name="v50", vocab_size=50), dtype=torch.float32)
    make(other, tmp_path / "v50h")
    with pytest.raises(ValueError, match="vocab size 50 does not match the target's vocab size 97"):
        make(other).__class__.from_pretrained(tmp_path / "v50h", target)


def test_missing_files_raise_file_not_found(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_drafter(tmp_path / "nowhere", target)
    make_tiny_eagle(target, tmp_path / "e")
    (tmp_path / "e" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        EagleHead.from_pretrained(tmp_path / "e", target)
    make_tiny_eagle3(target, tmp_path / "e3")
    (tmp_path / "e3" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no checkpoint weights"):
        Eagle3Head.from_pretrained(tmp_path / "e3", target)


def test_bad_forward_inputs(target):
    head = make_tiny_eagle3(target)
    ids = _ids(2, 3)
    with pytest.raises(ValueError, match="hidden must have shape"):
        head(ids, torch.zeros(2, 3, 31), head.new_cache(2, 4))
    with pytest.raises(ValueError, match="aux_hidden must hold 3"):
        head.fuse((torch.zeros(2, 3, 32),) * 2)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        make_tiny_eagle3(target, aux_layers=(0, 1, 9))


# ------------------------------------------------------------------------------------------ vocab maps
def test_eagle3_vocab_maps(target):
    head = make_tiny_eagle3(target, draft_vocab_size=40)  # draft vocab = even target ids 0, 2, ..., 78
    draft_ids = torch.tensor([[0, 1, 39]])
    assert head.to_target_ids(draft_ids).tolist() == [[0, 2, 78]]
    assert int(head.t2d.sum()) == 40 and bool(head.t2d[78]) and not bool(head.t2d[1])
    probs = torch.softmax(torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(0)), -1)
    full = head.to_target_probs(probs)
    assert full.shape == (2, 3, 97)
    torch.testing.assert_close(full.sum(-1), probs.sum(-1))
    assert torch.equal(full[..., ::2][..., :40], probs) and (full[..., 1::2] == 0).all()
    assert torch.equal(head.to_target_ids(probs.argmax(-1)), full.argmax(-1))
    e = make_tiny_eagle(target)
    assert e.to_target_ids(draft_ids) is draft_ids and e.draft_vocab_size == 97 and e.aux_layers == ()


def test_default_aux_layers_follow_sglang(target):
    assert default_eagle3_aux_layers(32) == (1, 15, 28)
    assert default_eagle3_aux_layers(4) == (1, 1, 0)
    assert make_tiny_eagle3(target).aux_layers == (1, 1, 0)  # target has 4 layers


# ------------------------------------------------------------------------------------------ forward math
def _ref_attention(attn, x, positions, inv_freq):
    """Causal attention with explicit matmuls, no cache. x [1, T, in_dim]."""
    T = x.shape[1]
    nh, nkv, D = attn.n_heads, attn.n_kv, attn.head_dim
    q = attn.q_proj(x).view(1, T, nh, D).transpose(1, 2)
    k = attn.k_proj(x).view(1, T, nkv, D).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    v = attn.v_proj(x).view(1, T, nkv, D).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    cos, sin = rope_cos_sin(inv_freq, positions[None], x.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scores = q @ k.transpose(-1, -2) / D**0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, T, nh * D)
    return attn.o_proj(out)


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _mlp(m, x):
    return m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))


@torch.no_grad()
def test_eagle_forward_matches_reference(target):
    head = make_tiny_eagle(target)
    ids = _ids(1, 6, seed=3)
    feat = _features(target, ids).hidden
    pos = torch.arange(6)
    x = head.fc(torch.cat((target.embed_tokens(ids), feat), -1))
    layer = head.layers[0]  # no input_layernorm on layer 0
    assert layer.input_layernorm is None
    x = x + _ref_attention(layer.self_attn, x, pos, head.inv_freq())
    x = x + _mlp(layer.mlp, _rms(x, layer.post_attention_layernorm.weight))
    out = head(ids, feat, head.new_cache(1, 6))
    torch.testing.assert_close(out.hidden, x, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits, target.lm_head(x), atol=ATOL, rtol=0)


@torch.no_grad()
def test_eagle3_forward_matches_reference(target):
    head = make_tiny_eagle3(target, draft_vocab_size=40)
    ids = _ids(1, 6, seed=4)
    aux = _features(target, ids, head.aux_layers).aux_hidden
    m = head.midlayer
    feat = head.fc(torch.cat(aux, -1))
    h = torch.cat((_rms(target.embed_tokens(ids), m.input_layernorm.weight), _rms(feat, m.hidden_norm.weight)), -1)
    x = feat + _ref_attention(m.self_attn, h, torch.arange(6), head.inv_freq())
    x = x + _mlp(m.mlp, _rms(x, m.post_attention_layernorm.weight))
    out = head(ids, head.fuse(aux), head.new_cache(1, 6))
    torch.testing.assert_close(out.hidden, x, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits, head.lm_head(_rms(x, head.norm.weight)), atol=ATOL, rtol=0)
    # a [B, T, 3H] concatenation is fused inside forward
    torch.testing.assert_close(head(ids, torch.cat(aux, -1), head.new_cache(1, 6)).logits, out.logits, atol=0, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("make", [make_tiny_eagle, make_tiny_eagle3])
def test_head_cache_step_by_step_equals_full(target, make):
    head = make(target)
    ids = _ids(2, 6, seed=5)
    feat = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(6))
    full = head(ids, feat, head.new_cache(2, 8)).logits
    cache = head.new_cache(2, 8)
    parts = [head(ids[:, :3], feat[:, :3], cache).logits]
    cache.commit(torch.full((2,), 3))
    for t in range(3, 6):
        parts.append(head(ids[:, t:t + 1], feat[:, t:t + 1], cache).logits)
        cache.commit(torch.ones(2, dtype=torch.long))
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=ATOL, rtol=0)


def test_heads_are_trainable(target):
    """The fixtures pipeline trains heads with these modules: gradients reach fc and the decoder layer."""
    for head in (make_tiny_eagle(target), make_tiny_eagle3(target)):
        head.train()
        ids = _ids(2, 5)
        feat = torch.randn(2, 5, 32 if head.layout == "eagle" else 96)  # eagle3: fused in forward via fc
        loss = head(ids, feat, head.new_cache(2, 5)).logits.logsumexp(-1).mean()
        loss.backward()
        assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0
        assert all(p.grad is not None for p in head.parameters())
