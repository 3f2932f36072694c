"""Checkpoint file IO for Hugging Face-layout directories.

Reads, in this order of preference:

1. ``model.safetensors``
2. ``model.safetensors.index.json`` (sharded safetensors; ``weight_map`` names the shard of each key)
3. ``pytorch_model.bin``
4. ``pytorch_model.bin.index.json`` (sharded pickles)

Pickles are read with ``torch.load(weights_only=True)``, so a checkpoint cannot run code at load time.
Nothing here knows about model architectures: callers map key names.

Errors name the file: FileNotFoundError for a missing one, ValueError (``CheckpointError``) for one
that is there but unreadable: invalid JSON, an index without ``weight_map``, a truncated or empty
safetensors file, a pickle that is not a plain tensor dict. A rejected pickle is never answered with
torch's advice to retry with ``weights_only=False``: that would run the file's code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
PT_NAME = "pytorch_model.bin"
PT_INDEX_NAME = "pytorch_model.bin.index.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"


class CheckpointError(ValueError):
    """A checkpoint file exists but cannot be used; the message names the file."""


def _read_json_object(file: str, what: str) -> dict:
    """The JSON object in ``file``; CheckpointError naming the file when it is not one."""
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:   # ValueError: JSONDecodeError, or an int past 4300 digits
        raise CheckpointError(f"{what} {file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {file} must hold a JSON object, got {type(data).__name__}")
    return data


GGUF_HINT = ("a .gguf file loads only as a target (Transformer.from_pretrained, SpecDecoder.from_pretrained's "
             "target_path, spec-bench --target); convert it to a checkpoint directory with "
             "spec_decode.models.gguf.save_gguf_as_hf_dir to use it elsewhere")
"""What a GGUF file given where a checkpoint directory is read (a drafter) can do instead."""


def check_local_dir(path: str | os.PathLike) -> str:
    """``path`` as a string; FileNotFoundError naming it, and saying that checkpoints load from local
    directories only, when it is not a directory on this machine (a Hub id such as ``org/model``);
    CheckpointError naming it when it is a file (a ``.gguf`` one: what such a file loads as, ``GGUF_HINT``)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"a checkpoint path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if os.path.isfile(path):
        hint = GGUF_HINT if path.lower().endswith(".gguf") else "pass the directory that holds config.json"
        raise CheckpointError(f"{path!r} is a file, not a checkpoint directory (config.json and weights): {hint}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path!r}. safespec loads checkpoints from local "
                                "directories only (nothing is downloaded): download the checkpoint first and "
                                "pass its directory")
    return path


def read_config(path: str | os.PathLike) -> dict:
    """Read ``config.json`` from checkpoint directory ``path``.

    Raises FileNotFoundError naming the missing directory or file; CheckpointError (a ValueError)
    naming the file when it is not a JSON object.
    """
    cfg_path = os.path.join(check_local_dir(path), CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"checkpoint config not found: {cfg_path}")
    return _read_json_object(cfg_path, "checkpoint config")


def eos_ids(value, where: str, vocab_size: int | None = None) -> tuple[int, ...]:
    """An ``eos_token_id`` value (null, an int or a list of ints, each below ``vocab_size`` when given) as a
    tuple; CheckpointError naming ``where`` otherwise (an id past the vocabulary could never be emitted, so
    a request would never stop at it)."""
    items = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in items):
        raise CheckpointError(f"{where}: eos_token_id must be null, an id or a list of ids, got {value!r}")
    outside = [t for t in items if vocab_size is not None and t >= vocab_size]
    if outside:
        raise CheckpointError(f"{where}: eos_token_id {outside[0]} is outside the vocabulary [0, {vocab_size})")
    return tuple(items)


def read_eos_token_ids(path: str | os.PathLike, vocab_size: int | None = None) -> tuple[int, ...]:
    """The EOS ids of checkpoint directory ``path``: ``generation_config.json``'s ``eos_token_id`` when
    that file sets it (as HF ``generate`` reads it), else ``config.json``'s; () when neither does. With
    ``vocab_size``, an id outside [0, vocab_size) is a CheckpointError naming the file."""
    path = check_local_dir(path)
    for name in (GENERATION_CONFIG_NAME, CONFIG_NAME):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            data = _read_json_object(file, "checkpoint config")
            if data.get("eos_token_id") is not None:
                return eos_ids(data["eos_token_id"], file, vocab_size)
    return ()


def _read_weight_map(index_path: str) -> dict[str, str]:
    """``weight_map`` (tensor name -> shard file name) of a sharded index; CheckpointError naming the index."""
    weight_map = _read_json_object(index_path, "checkpoint index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"checkpoint index {index_path} has no 'weight_map' (a non-empty object mapping "
                              "tensor names to shard files)")
    bad = [v for v in weight_map.values() if not isinstance(v, str) or os.path.basename(v) != v]
    if bad:
        raise CheckpointError(f"checkpoint index {index_path}: 'weight_map' values must be shard file names in the "
                              f"same directory, got {bad[0]!r}")
    return weight_map


def _weight_files(path: str) -> tuple[str, list[str]]:
    """Return (format, files) for the weights in ``path``; format is "safetensors" or "pt"."""
    for name, fmt in ((SAFETENSORS_NAME, "safetensors"), (PT_NAME, "pt")):
        if os.path.isfile(os.path.join(path, name)):
            return fmt, [os.path.join(path, name)]
    for name, fmt in ((SAFETENSORS_INDEX_NAME, "safetensors"), (PT_INDEX_NAME, "pt")):
        index_path = os.path.join(path, name)
        if os.path.isfile(index_path):
            weight_map = _read_weight_map(index_path)
            files = [os.path.join(path, shard) for shard in sorted(set(weight_map.values()))]
            for shard in files:
                if not os.path.isfile(shard):
                    raise FileNotFoundError(f"checkpoint shard listed in {index_path} not found: {shard}")
            return fmt, files
    raise FileNotFoundError(
        f"no checkpoint weights in {path}: expected one of {SAFETENSORS_NAME}, {SAFETENSORS_INDEX_NAME}, "
        f"{PT_NAME}, {PT_INDEX_NAME}"
    )


def load_state_dict(path: str | os.PathLike, *, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Load every tensor of the checkpoint directory ``path`` into one dict (original key names and dtypes).

    Raises FileNotFoundError naming ``path`` (or the missing shard) when no weights are there, and
    CheckpointError (a ValueError) naming the file that is unreadable (module docstring).
    """
    path = check_local_dir(path)
    fmt, files = _weight_files(path)
    map_location = torch.device(device) if device is not None else torch.device("cpu")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(_load_safetensors(file) if fmt == "safetensors" else _load_pickle(file))
    if map_location.type != "cpu":
        state = {k: v.to(map_location) for k, v in state.items()}
    return state


def _load_safetensors(file: str) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, on CPU; CheckpointError naming a truncated, empty or corrupt file."""
    SafetensorError, load_file = _safetensors("SafetensorError"), _safetensors("load_file")

    try:
        # safetensors cannot load straight onto "meta" etc.; cpu then .to() keeps it simple
        return load_file(file, device="cpu")
    except SafetensorError as e:
        raise CheckpointError(f"{file} is not a readable safetensors file (truncated, empty or corrupt: {e})") from None


def _load_pickle(file: str) -> dict[str, torch.Tensor]:
    """The tensor dict of one ``pytorch_model.bin``, read with ``weights_only=True``.

    CheckpointError naming the file when it is corrupt or holds anything but tensors. torch's own
    message is not passed on (not even as ``__cause__``): it advises ``weights_only=False``, which
    would run code from the file.
    """
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:   # UnpicklingError, RuntimeError (bad zip), EOFError, ...: all mean "unusable"
        kind = type(e).__name__
        raise CheckpointError(f"{file} is not a readable PyTorch weights file ({kind}): it is corrupt, truncated, or "
                              "holds objects other than tensors, which safespec does not load. Convert a "
                              "trusted checkpoint to safetensors (model.safetensors).") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{file} must hold a dict of tensors, got {type(state).__name__}")
    return state


def read_key_names(path: str | os.PathLike) -> set[str]:
    """Return the tensor names stored in checkpoint directory ``path`` without loading safetensors data.

    Raises as ``load_state_dict`` does (a truncated safetensors file fails here already: its header
    must cover the whole file).
    """
    path = check_local_dir(path)
    fmt, files = _weight_files(path)
    if fmt == "pt":
        return set(load_state_dict(path).keys())
    SafetensorError, safe_open = _safetensors("SafetensorError"), _safetensors("safe_open")

    names: set[str] = set()
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                names.update(f.keys())
        except SafetensorError as e:
            raise CheckpointError(f"{file} is not a readable safetensors file (truncated, empty or corrupt: "
                                  f"{e})") from None
    return names


def save_state_dict(state: Mapping[str, torch.Tensor], path: str | os.PathLike, config: dict | None = None) -> None:
    """Write ``state`` to ``path/model.safetensors`` (and ``config`` to ``path/config.json`` when given).

    Tensors are made contiguous and moved to CPU; tied (shared-storage) tensors must be dropped by the caller.
    """
    save_file = _safetensors("save_file")

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, os.path.join(path, SAFETENSORS_NAME), metadata={"format": "pt"})
    if config is not None:
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)


def _safetensors(name: str):
    """``name`` from safetensors (an optional dependency, imported on use); ImportError naming the extra."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        raise ImportError('reading and writing checkpoints needs the safetensors package: pip install '
                          '"safespec[models]" (or pip install safetensors)') from None
    return getattr(safetensors.torch, name, None) or getattr(safetensors, name)
