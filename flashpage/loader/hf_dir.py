"""Hugging Face model directories: config.json + *.safetensors (single or sharded) + tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from flashpage.config import ModelConfig


class HFModelDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg_file = self.path / "config.json"
        if not cfg_file.exists():
            raise ValueError(f"{self.path} is not a model directory: it has no config.json")
        self.config = ModelConfig.from_hf(json.loads(cfg_file.read_text()))

    def weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [self.path / s for s in shards]
            missing = [str(f) for f in files if not f.exists()]
            if missing:
                raise ValueError(f"shard(s) named in {index.name} are missing: {', '.join(missing)}")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.path} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
        return files

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for f in self.weight_files():
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)

    def tokenizer(self):
        from flashpage.tokenizer import Tokenizer

        return Tokenizer.from_hf_dir(self.path) if (self.path / "tokenizer.json").exists() else None
