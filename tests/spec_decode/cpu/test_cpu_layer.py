"""Tests for spec_decode.cpu.layer: a decoder layer in one C call gives the bits of its modules one call at a
time (logits and every cache row), and runs only where every part would take its batch-invariant C route."""
from __future__ import annotations

import pytest
import torch

from spec_decode.cpu import cpu_gemm
from tiny_models import decode_blocks

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="the kernel needs cpu_gemm (x86-64, AVX2, a C compiler)")


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal dtype and bits, NaN included (any NaN payload counts as the same NaN)."""
    bits = lambda t: t.float().nan_to_num(0.0).view(torch.int32)
    return (got.shape == want.shape and got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
            and torch.equal(bits(got), bits(want)))


@pytest.fixture
def one_call_count(monkeypatch):
    """Counts the layers that ran as one call; ``off()`` sends every layer through its modules."""
    from spec_decode.models import layers

    calls = []
    original = layers.decoder_layer
    monkeypatch.setattr(layers, "decoder_layer", lambda *a, **k: calls.append(1) or original(*a, **k))

    class Count:
        def __len__(self):
            return len(calls)

        @staticmethod
        def off():
            monkeypatch.setattr(layers, "decoder_layer_fits", lambda *a, **k: False)

    return Count()


def _model(tmp_path, dtype, heads=(4, 2), head_dim=8, **config):
    from spec_decode.models import Transformer
    from tiny_models import make_tiny_target

    nh, nkv = heads
    path = make_tiny_target(tmp_path, seed=3, num_attention_heads=nh, num_key_value_heads=nkv,
                            hidden_size=head_dim * nh, **config)
    return Transformer.from_pretrained(path, dtype=dtype)


def _prompts():
    return torch.randint(1, 97, (3, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 8), ((6, 3), 16), ((3, 1), 20), ((4, 4), 64)])
def test_one_call_gives_the_modules_bits(tmp_path, one_call_count, dtype, heads, head_dim):
    model = _model(tmp_path, dtype, heads, head_dim)
    one_call = decode_blocks(model, _prompts())
    assert len(one_call_count) == 4 * model.config.num_hidden_layers, "a layer did not run as one call"
    one_call_count.off()
    for a, b in zip(one_call, decode_blocks(model, _prompts())):
        assert _same_bits(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biases_a_missing_input_norm_and_special_values_keep_the_bits(tmp_path, one_call_count, dtype):
    """q/k/v and o_proj biases, a layer without input_layernorm (EAGLE-1/2's layer 0), and NaN, Inf and huge
    values in a token's embedding: the one-call layer puts every bit where the modules do."""
    model = _model(tmp_path, dtype, attention_bias=True)
    assert model.layers[0].self_attn.o_proj.bias is not None
    model.layers[0].input_layernorm = None
    with torch.no_grad():
        emb = model.embed_tokens.weight
        emb[5, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        emb[7, :2] = torch.tensor([3.0e38, -3.0e38])
    prompts = _prompts()
    prompts[1, 2], prompts[2, 0] = 5, 7
    one_call = decode_blocks(model, prompts)
    assert len(one_call_count) > 0
    one_call_count.off()
    unfused = decode_blocks(model, prompts)
    assert any(t.isnan().any() for t in unfused[:4]), "the special values reached no logits"
    for a, b in zip(one_call, unfused):
        assert _same_bits(a, b)


def test_a_hook_grad_mode_or_exact_nan_sends_the_layer_through_its_modules(tmp_path, one_call_count):
    model = _model(tmp_path, torch.bfloat16)
    ids = _prompts()[:1, :4]
    seen = []
    handle = model.layers[1].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        model(ids, model.new_cache(1, 8))
    handle.remove()
    assert seen == [torch.Size([1, 4, model.config.hidden_size])]   # the hooked part ran as a module
    L = model.config.num_hidden_layers
    assert len(one_call_count) == L - 1, "the hooked module's layer ran as one call"
    model(ids, model.new_cache(1, 8))                               # grad mode: autograd needs the modules
    assert len(one_call_count) == L - 1
    with torch.no_grad():
        model.layers[0].self_attn.exact_nan = True
        model(ids, model.new_cache(1, 8))
    assert len(one_call_count) == 2 * (L - 1)                         # every layer but the exact_nan one


def test_a_changed_weight_is_seen(tmp_path):
    """The kept pointers follow a weight changed in place (packed anew) and a norm weight replaced."""
    from torch import nn

    model = _model(tmp_path, torch.float32)
    ids = _prompts()[:1, :4]
    with torch.no_grad():
        before = model(ids, model.new_cache(1, 8)).logits
        model.layers[0].mlp.down_proj.weight.mul_(2)
        doubled = model(ids, model.new_cache(1, 8)).logits
        model.layers[0].post_attention_layernorm.weight = nn.Parameter(torch.full((model.config.hidden_size,), 3.0))
        replaced = model(ids, model.new_cache(1, 8)).logits
    assert not torch.equal(before, doubled) and not torch.equal(doubled, replaced)
    for layer in model.layers:
        layer.__dict__.pop("_one_call", None)
    with torch.no_grad():
        assert torch.equal(model(ids, model.new_cache(1, 8)).logits, replaced)   # rebuilt from scratch: the same


def test_layer_weights_name_a_projection_that_does_not_chain(tmp_path):
    from spec_decode.cpu.layer import LayerWeights

    model = _model(tmp_path, torch.float32)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    x = torch.zeros(1, 1, model.config.hidden_size)
    with torch.no_grad():
        qkv, o, gu, down = (p.invariant_panels(x if p is not mlp.down_proj else torch.zeros(1, 1, p.in_features))
                            for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
    norm = model.layers[0].post_attention_layernorm.weight
    LayerWeights((None, norm), (1e-5, 1e-5), (4, 2, 8), (qkv, o, gu, down))      # the layer's own: fine
    with pytest.raises(ValueError, match="gate_up"):
        LayerWeights((None, norm), (1e-5, 1e-5), (4, 2, 8), (qkv, o, o, down))
    with pytest.raises(ValueError, match="qkv"):
        LayerWeights((None, norm), (1e-5, 1e-5), (4, 1, 8), (qkv, o, gu, down))
    with pytest.raises(ValueError, match="post_norm"):
        LayerWeights((None, norm[:-1]), (1e-5, 1e-5), (4, 2, 8), (qkv, o, gu, down))


def test_a_norm_weight_given_new_storage_is_seen(tmp_path):
    """``param.data = ...`` keeps the parameter object and moves its storage: the layer reads the new values."""
    model = _model(tmp_path, torch.float32)
    ids = _prompts()[:1, :4]
    with torch.no_grad():
        before = model(ids, model.new_cache(1, 8)).logits
        norm = model.layers[2].post_attention_layernorm
        norm.weight.data = norm.weight.data * 2
        after = model(ids, model.new_cache(1, 8)).logits
        for layer in model.layers:
            layer.__dict__.pop("_one_call", None)
        assert not torch.equal(before, after)
        assert torch.equal(model(ids, model.new_cache(1, 8)).logits, after)
