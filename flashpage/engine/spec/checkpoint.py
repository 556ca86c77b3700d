"""The weights of a speculative method's own modules (Medusa heads, an EAGLE draft): a directory with config.json
and the tensors, or a Hugging Face Hub id. Each function raises `bad(message)`, the caller's error (a
ParameterError naming its setting), naming what is missing."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

Bad = Callable[[str], Exception]

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def checkpoint_dir(model: str, what: str, bad: Bad) -> Path:
    """The local directory of `model`, a checkpoint of `what` (a Hub id is fetched, `.pt` and `.bin` files too)."""
    path = Path(model)
    if path.is_dir():
        return path
    from flashpage.loader.hub import is_hub_id, resolve_hub_model
    if not path.exists() and is_hub_id(model):
        try:
            return resolve_hub_model(model, extra_patterns=["*.pt", "*.bin"])
        except ValueError as e:
            raise bad(str(e)) from None
    raise bad(f"{model!r} is not a directory of {what} (config.json and the weights)")


def read_config(path: Path, bad: Bad) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise bad(f"cannot read {path / 'config.json'}: {e}") from None


def read_tensors(path: Path, bad: Bad, files: tuple[str, ...] = WEIGHT_FILES) -> dict[str, torch.Tensor]:
    """The tensors of the first of `files` that `path` holds (safetensors, or a PyTorch pickle of tensors only)."""
    file = next((path / name for name in files if (path / name).exists()), None)
    if file is None:
        raise bad(f"{path} holds none of {', '.join(files)}")
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(file)
    return torch.load(file, map_location="cpu", weights_only=True)
