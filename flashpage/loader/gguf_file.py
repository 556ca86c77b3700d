"""GGUF files (llama.cpp): config from metadata, tensors dequantized by the `gguf` package, tokenizer from metadata."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from flashpage.config import ModelConfig
from flashpage.model.gguf_blocks import KEPT_TYPES, unpack_blocks

# Quant types we dequantize (through gguf.quants) and test.
SUPPORTED_QUANTS = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
SUPPORTED_ARCHS = ("llama", "qwen2")

# GGUF tensor name (after "blk.N.") -> transformers name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFModel:
    """An opened GGUF file: `config`, `metadata`, and `weights()` yielding transformers-named tensors."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # truncated or not a GGUF at all
            raise ValueError(f"{self.path} is not a readable GGUF file: {e}") from e
        self.metadata = {k: _field_value(f) for k, f in self.reader.fields.items() if not k.startswith("GGUF.")}
        self.arch = self.metadata.get("general.architecture")
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"GGUF architecture {self.arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
        bad = sorted({t.tensor_type.name for t in self.reader.tensors} - SUPPORTED_QUANTS)
        if bad:
            raise ValueError(f"GGUF quant type(s) {', '.join(bad)} not supported (supported: {', '.join(sorted(SUPPORTED_QUANTS))})")
        self.config = self._config()

    def _config(self) -> ModelConfig:
        m, a = self.metadata, self.arch + "."
        heads = m[a + "attention.head_count"]
        hidden = m[a + "embedding_length"]
        names = {t.name for t in self.reader.tensors}
        freq_factors = None
        if "rope_freqs.weight" in names:
            t = next(t for t in self.reader.tensors if t.name == "rope_freqs.weight")
            freq_factors = np.asarray(t.data, dtype=np.float32).tolist()
        scaling = None
        if m.get(a + "rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": m[a + "rope.scaling.factor"]}
        eos = [m[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in m]
        return ModelConfig(
            vocab_size=m.get(a + "vocab_size") or len(m["tokenizer.ggml.tokens"]),
            hidden_size=hidden,
            intermediate_size=m[a + "feed_forward_length"],
            num_hidden_layers=m[a + "block_count"],
            num_attention_heads=heads,
            num_key_value_heads=m.get(a + "attention.head_count_kv", heads),
            head_dim=m.get(a + "attention.key_length") or m.get(a + "rope.dimension_count") or hidden // heads,
            max_position_embeddings=m.get(a + "context_length", 2048),
            rms_norm_eps=m.get(a + "attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=m.get(a + "rope.freq_base", 10000.0),
            rope_scaling=scaling,
            rope_freq_factors=freq_factors,
            tie_word_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            sliding_window=m.get(a + "attention.sliding_window"),
            bos_token_id=m.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(eos)),
            architecture=self.arch,
        )

    def projections_in_kept_types(self) -> bool:
        """Whether every projection of the decoder layers is stored in a type `keep_blocks` keeps."""
        return all(t.tensor_type.name in KEPT_TYPES for t in self.reader.tensors
                   if _hf_name(t.name).endswith("_proj.weight"))

    def weights(self, keep_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (transformers name, float32 tensor) one at a time, so peak memory is one tensor. `keep_blocks`:
        the decoder layers' projections as their 4-bit codes (uint8) and, named `weight_scale`, their blocks'
        (scale, zero) (`flashpage.model.gguf_blocks`); ValueError if one is stored otherwise."""
        from gguf.quants import dequantize

        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                continue
            name = _hf_name(t.name)
            shape = [int(d) for d in reversed(t.shape)]
            if keep_blocks and name.endswith("_proj.weight"):
                if t.tensor_type.name not in KEPT_TYPES:
                    raise ValueError(f"quantization 'gguf' keeps {' and '.join(KEPT_TYPES)} weights as they are "
                                     f"stored; {t.name} is {t.tensor_type.name} (leave quantization unset to load "
                                     f"it in the model's dtype)")
                codes, scales_zeros = unpack_blocks(t.data, t.tensor_type.name, shape)
                yield name, self._tensor(name, codes)
                yield f"{name}_scale", self._tensor(name, scales_zeros)
                continue
            yield name, self._tensor(name, np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape))

    def _tensor(self, name: str, data: np.ndarray) -> torch.Tensor:
        """A tensor of `name` as torch, its rows in transformers' order: llama.cpp interleaves Q/K rows for its
        rope layout; undone here for the rotate-half layout."""
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            data = _unpermute(data, self.config.num_attention_heads if ".q_proj." in name else
                              self.config.num_key_value_heads)
        data = np.ascontiguousarray(data)
        return torch.from_numpy(data if data.flags.writeable else data.copy())

    def tokenizer(self):
        from flashpage.tokenizer import Tokenizer

        if "tokenizer.ggml.tokens" not in self.metadata:
            return None
        return Tokenizer.from_gguf_metadata(self.metadata)


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a Llama-family model")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field_value(field):
    try:
        return field.contents()
    except Exception:
        return None
