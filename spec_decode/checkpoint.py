"""Checkpoint file IO for Hugging Face-layout directories.

Reads, in this order of preference:

1. ``model.safetensors``
2. ``model.safetensors.index.json`` (sharded safetensors; ``weight_map`` names the shard of each key)
3. ``pytorch_model.bin``
4. ``pytorch_model.bin.index.json`` (sharded pickles)

Pickles are read with ``torch.load(weights_only=True)``, so a checkpoint cannot run code at load time.
Nothing here knows about model architectures: callers map key names.
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


def read_config(path: str | os.PathLike) -> dict:
    """Read ``config.json`` from checkpoint directory ``path``.

    Raises FileNotFoundError naming the missing file.
    """
    cfg_path = os.path.join(os.fspath(path), CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"checkpoint config not found: {cfg_path}")
    with open(cfg_path) as f:
        return json.load(f)


def _weight_files(path: str) -> tuple[str, list[str]]:
    """Return (format, files) for the weights in ``path``; format is "safetensors" or "pt"."""
    for name, fmt in ((SAFETENSORS_NAME, "safetensors"), (PT_NAME, "pt")):
        if os.path.isfile(os.path.join(path, name)):
            return fmt, [os.path.join(path, name)]
    for name, fmt in ((SAFETENSORS_INDEX_NAME, "safetensors"), (PT_INDEX_NAME, "pt")):
        index_path = os.path.join(path, name)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
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

    Raises FileNotFoundError naming ``path`` (or the missing shard) when no weights are there.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    fmt, files = _weight_files(path)
    map_location = torch.device(device) if device is not None else torch.device("cpu")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if fmt == "safetensors":
            from safetensors.torch import load_file  # optional dependency; imported on use

            # safetensors cannot load straight onto "meta" etc.; cpu then .to() keeps it simple
            part = load_file(file, device="cpu")
        else:
            part = torch.load(file, map_location="cpu", weights_only=True)
        state.update(part)
    if map_location.type != "cpu":
        state = {k: v.to(map_location) for k, v in state.items()}
    return state


def read_key_names(path: str | os.PathLike) -> set[str]:
    """Return the tensor names stored in checkpoint directory ``path`` without loading safetensors data."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    fmt, files = _weight_files(path)
    if fmt == "pt":
        return set(load_state_dict(path).keys())
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names


def save_state_dict(state: Mapping[str, torch.Tensor], path: str | os.PathLike, config: dict | None = None) -> None:
    """Write ``state`` to ``path/model.safetensors`` (and ``config`` to ``path/config.json`` when given).

    Tensors are made contiguous and moved to CPU; tied (shared-storage) tensors must be dropped by the caller.
    """
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, os.path.join(path, SAFETENSORS_NAME), metadata={"format": "pt"})
    if config is not None:
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
