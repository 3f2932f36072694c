"""spec_decode.models.checkpoint under damaged input: every unreadable file is named, never a bare library error.

A parametrized probe suite: each case damages one file of a valid checkpoint directory and asserts
the error type and that the message names that file. A garbage ``pytorch_model.bin`` must not come
back with torch's advice to retry with ``weights_only=False`` (that would run the file's code).
"""

from __future__ import annotations

import json
import shutil
import traceback
from pathlib import Path

import pytest
import torch

from spec_decode.fixtures import TARGET_SUBDIR, find_fixtures_dir
from spec_decode.models import ModelConfig, Transformer
from spec_decode.models.checkpoint import (CONFIG_NAME, PT_INDEX_NAME, PT_NAME, SAFETENSORS_INDEX_NAME, SAFETENSORS_NAME,
                                    CheckpointError, load_state_dict, read_config, read_key_names, save_state_dict)

STATE = {"a.weight": torch.arange(12.0).reshape(3, 4), "b.bias": torch.ones(5)}


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A valid checkpoint directory: config.json + model.safetensors."""
    save_state_dict(STATE, tmp_path, {"hidden_size": 4})
    return tmp_path


def _truncate(file: Path, keep: float) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:int(len(data) * keep)])


def _shard(ckpt: Path, fmt: str) -> Path:
    """Replace model.safetensors by a one-shard index of ``fmt``; return the shard."""
    from safetensors.torch import save_file

    (ckpt / SAFETENSORS_NAME).unlink()
    shard = ckpt / ("model-00001-of-00001.safetensors" if fmt == "safetensors" else "pytorch_model-00001-of-00001.bin")
    save_file(STATE, shard) if fmt == "safetensors" else torch.save(STATE, shard)
    index = SAFETENSORS_INDEX_NAME if fmt == "safetensors" else PT_INDEX_NAME
    (ckpt / index).write_text(json.dumps({"weight_map": {k: shard.name for k in STATE}}))
    return shard


def _to_pt(ckpt: Path) -> Path:
    (ckpt / SAFETENSORS_NAME).unlink()
    torch.save(STATE, ckpt / PT_NAME)
    return ckpt / PT_NAME


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


# Each probe damages the directory and returns the file the error must name.
PROBES = {
    "safetensors_truncated_half": lambda d: (_truncate(d / SAFETENSORS_NAME, 0.5), d / SAFETENSORS_NAME)[1],
    "safetensors_truncated_in_header": lambda d: (_truncate(d / SAFETENSORS_NAME, 0.02), d / SAFETENSORS_NAME)[1],
    "safetensors_empty": lambda d: ((d / SAFETENSORS_NAME).write_bytes(b""), d / SAFETENSORS_NAME)[1],
    "safetensors_garbage": lambda d: ((d / SAFETENSORS_NAME).write_bytes(b"\xff" * 64), d / SAFETENSORS_NAME)[1],
    "shard_truncated": lambda d: (lambda s: (_truncate(s, 0.6), s)[1])(_shard(d, "safetensors")),
    "index_without_weight_map": lambda d: (_shard(d, "safetensors"),
                                           (d / SAFETENSORS_INDEX_NAME).write_text('{"metadata": {}}'),
                                           d / SAFETENSORS_INDEX_NAME)[2],
    "index_weight_map_not_object": lambda d: (_shard(d, "pt"), (d / PT_INDEX_NAME).write_text('{"weight_map": [1]}'),
                                              d / PT_INDEX_NAME)[2],
    "index_weight_map_escapes_dir": lambda d: (_shard(d, "safetensors"), (d / SAFETENSORS_INDEX_NAME).write_text(
        json.dumps({"weight_map": {"a.weight": "../x.safetensors"}})), d / SAFETENSORS_INDEX_NAME)[2],
    "index_not_json": lambda d: (_shard(d, "safetensors"), (d / SAFETENSORS_INDEX_NAME).write_text("{weight_map"),
                                 d / SAFETENSORS_INDEX_NAME)[2],
    "pt_garbage": lambda d: (lambda f: (f.write_bytes(b"garbage" * 20), f)[1])(_to_pt(d)),
    "pt_truncated": lambda d: (lambda f: (_truncate(f, 0.5), f)[1])(_to_pt(d)),
    "pt_empty": lambda d: (lambda f: (f.write_bytes(b""), f)[1])(_to_pt(d)),
    "pt_code_object": lambda d: (lambda f: (torch.save({"x": _Evil()}, f), f)[1])(_to_pt(d)),
    "pt_not_a_dict": lambda d: (lambda f: (torch.save([torch.ones(1)], f), f)[1])(_to_pt(d)),
}


@pytest.mark.parametrize("probe", list(PROBES))
@pytest.mark.parametrize("reader", [load_state_dict, read_key_names], ids=["load_state_dict", "read_key_names"])
def test_damaged_weights_name_the_file(ckpt, probe, reader, capsys):
    named = PROBES[probe](ckpt)
    with pytest.raises(ValueError) as exc:
        reader(ckpt)
    assert isinstance(exc.value, CheckpointError)
    assert str(named) in str(exc.value)
    text = "".join(traceback.format_exception(exc.value))   # the chained causes too
    assert "weights_only=False" not in text and "weights_only` set to `False" not in text
    assert "this must never run" not in capsys.readouterr().out


@pytest.mark.parametrize("content, needle", [
    ("", "not valid JSON"),
    ("{hidden_size: 4}", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('"llama"', "JSON object"),
    (b"\xff\xfe{}", "not valid JSON"),
])
def test_bad_config_names_the_file(ckpt, content, needle):
    f = ckpt / CONFIG_NAME
    f.write_bytes(content) if isinstance(content, bytes) else f.write_text(content)
    with pytest.raises(CheckpointError, match=needle) as exc:
        read_config(ckpt)
    assert str(f) in str(exc.value)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_config(tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_state_dict(tmp_path)
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        load_state_dict(tmp_path / "absent")


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "sharded_safetensors", "sharded_pt"])
def test_valid_checkpoints_still_load(ckpt, fmt):
    if fmt == "pt":
        _to_pt(ckpt)
    elif fmt.startswith("sharded"):
        _shard(ckpt, fmt.removeprefix("sharded_"))
    state = load_state_dict(ckpt)
    assert set(state) == set(STATE) == read_key_names(ckpt)
    assert all(torch.equal(state[k], STATE[k]) for k in STATE)
    assert read_config(ckpt) == {"hidden_size": 4}


def test_model_loaders_pass_the_named_error_on(ckpt, tmp_path):
    """Transformer.from_pretrained on a truncated file: the message still names it."""
    from spec_decode.models import Transformer
    from tiny_models import make_tiny_target

    path = make_tiny_target(tmp_path / "m", name="t")
    _truncate(path / SAFETENSORS_NAME, 0.5)
    with pytest.raises(ValueError, match="model.safetensors"):
        Transformer.from_pretrained(path, dtype=torch.float32)


# ---------------------------------------------------------------- loader errors name the file and the key
FX = find_fixtures_dir()


@pytest.fixture
def shipped_ckpt(tmp_path):
    """A copy of the shipped target, with ``edit(config dict)`` rewriting its config.json."""
    if FX is None:
        pytest.skip("no shipped fixtures")
    path = shutil.copytree(FX / TARGET_SUBDIR, tmp_path / "target")

    def edit(change, name="config.json"):
        file = path / name
        data = json.loads(file.read_text()) if file.exists() else {}
        file.write_text(change(data) if callable(change) and change.__name__ == "raw" else json.dumps({**data, **change}))
        return path
    return edit


def test_an_integer_past_pythons_digit_limit_names_the_file(shipped_ckpt):
    """A 5001-digit integer in config.json raised "Exceeds the limit (4300 digits)" naming no file."""
    def raw(data):
        return json.dumps(data)[:-1] + ', "x": ' + "9" * 5001 + "}"
    path = shipped_ckpt(raw)
    with pytest.raises(ValueError, match=f"{path / 'config.json'}.*not valid JSON"):
        Transformer.from_pretrained(path)


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_a_rope_dict_that_is_not_a_dict_names_the_key(shipped_ckpt, key):
    """``rope_parameters: "x"`` named the file but not the key."""
    path = shipped_ckpt({key: "x"})
    with pytest.raises(ValueError, match=f"config.json: {key} must be a dict or null"):
        Transformer.from_pretrained(path)


def test_an_eos_id_outside_the_vocabulary_names_the_file(shipped_ckpt):
    """``eos_token_id: 99999`` in generation_config.json (vocabulary 4096) was accepted."""
    path = shipped_ckpt({"eos_token_id": 99999}, "generation_config.json")
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id 99999 is outside the vocabulary"):
        Transformer.from_pretrained(path)


@pytest.mark.parametrize("change, named", [({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
                                           ({"architectures": ["Qwen3ForCausalLM"]}, "Qwen3ForCausalLM"),
                                           ({"model_type": "qwen3"}, "qwen3")])
def test_an_architecture_neither_llama_nor_qwen2_is_refused_naming_it(shipped_ckpt, change, named):
    """These loaded as a Llama."""
    path = shipped_ckpt(change)
    with pytest.raises(ValueError, match=f"config.json: .*'{named}'.*not supported"):
        Transformer.from_pretrained(path)


def test_supported_architectures_and_drafter_heads_still_load():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    for arch, model_type in (("LlamaForCausalLM", "llama"), ("Qwen2ForCausalLM", "qwen2")):
        ModelConfig.from_hf_dict({**base, "architectures": [arch], "model_type": model_type})
    ModelConfig.from_hf_dict({**base, "architectures": ["LlamaForCausalLMEagle3"]}, drafter=True)
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        ModelConfig.from_hf_dict({**base, "architectures": ["LlamaForCausalLMEagle3"]})
