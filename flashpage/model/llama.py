"""One decoder for the Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5, SmolLM2.

Tokens come flattened (all sequences of a step back to back) with their positions. Every operation runs through
a kernel set (`flashpage.kernels`: PyTorch references or Triton), which the model holds as `ops`. The residual
stream h is carried from layer to layer; each projection is one `ops.linear` that takes in its neighbours: the
RMSNorm before Q/K/V and before gate/up, SiLU-and-mul after gate/up, the residual add after o_proj and down_proj
(at decode sizes, one Triton kernel each). Rotary embedding is fused with the KV-cache write. Q/K/V and gate/up
are each one matmul; `load_weights` takes transformers' tensor names and hands each tensor to its parameter's
module's `weight_loader`, which places it (the fused projections fill their slices; a tensor-parallel module can
take its shard).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from flashpage.config import ModelConfig
from flashpage.kernels import kernel_set
from flashpage.kv import KVCache
from flashpage.model.attention import AttentionMetadata, attention
from flashpage.model.rope import rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    """The norm's weight and epsilon; applied by the `ops.linear` that reads the normalised input."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps


def weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
    """Copy a checkpoint tensor into a parameter (any dtype/device)."""
    _copy_checked(param.data, tensor)


def _copy_checked(dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ValueError(f"has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)


class MergedLinear(nn.Linear):
    """Several projections of one input stacked as one matmul (Q/K/V, gate/up); checkpoints store them apart."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
        _copy_checked(param.data.narrow(0, sum(self.output_sizes[:shard]), self.output_sizes[shard]), tensor)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = self.head_dim**-0.5
        self.sliding_window = cfg.sliding_window

    def forward(self, ops, h, norm: RMSNorm, cos, sin, meta, kv_cache):
        """h + attention(norm(h))."""
        qkv = ops.linear(h, self.qkv_proj.weight, self.qkv_proj.bias, norm_weight=norm.weight, eps=norm.eps)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = attention(ops, q, k, v, cos, sin, kv_cache, meta, self.scale, self.sliding_window)
        return ops.linear(o.flatten(1), self.o_proj.weight, self.o_proj.bias, residual=h)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, ops, h, norm: RMSNorm):
        """h + down(silu(gate(norm(h))) * up(norm(h)))."""
        act = ops.linear(h, self.gate_up_proj.weight, self.gate_up_proj.bias, norm_weight=norm.weight, eps=norm.eps,
                         silu_mul=True)
        return ops.linear(act, self.down_proj.weight, self.down_proj.bias, residual=h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, ops, h, cos, sin, meta, kv_cache):
        h = self.self_attn(ops, h, self.input_layernorm, cos, sin, meta, kv_cache)
        return self.mlp(ops, h, self.post_attention_layernorm)


# transformers name fragment -> (our parameter fragment, shard index) for the fused projections.
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: str = "torch"):
        super().__init__()
        self.config = cfg
        self.ops = kernel_set(kernels)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tied models read the embedding matrix at the head (a shared Parameter would not survive to_empty()).
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._inv_freq = rope_inv_freq(cfg)  # CPU float32; not a buffer, so meta/dtype moves leave it exact

    def set_kernels(self, name: str) -> None:
        """'torch' (PyTorch references) or 'triton'."""
        self.ops = kernel_set(name)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache] | None = None) -> torch.Tensor:
        """input_ids: [T], at meta.positions. Returns the residual stream after the last layer [T, hidden] (the
        final norm is applied by `compute_logits`, on the rows that need logits)."""
        h = self.embed_tokens(input_ids)
        if self._inv_freq.device != h.device:
            self._inv_freq = self._inv_freq.to(h.device)
        cos, sin = rope_cos_sin(self._inv_freq, meta.positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(self.ops, h, cos, sin, meta, None if kv_caches is None else kv_caches[i])
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of rows of `forward`'s output."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.ops.linear(hidden, weight, norm_weight=self.norm.weight, eps=self.norm.eps, out_dtype=torch.float32)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand tensors named as in transformers to their parameters' loaders (any dtype/device; one at a time).

        Raises ValueError naming any tensor that has no home here or has the wrong shape, and any
        parameter no tensor filled.
        """
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store a copy of the embedding
            target, shard = name, None
            for frag, (fused, idx) in _STACKED.items():
                if frag in name:
                    target, shard = name.replace(frag, fused), idx
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in the model")
            module = self.get_submodule(target.rpartition(".")[0])
            try:
                getattr(module, "weight_loader", weight_loader)(params[target], tensor, shard)
            except ValueError as e:
                raise ValueError(f"tensor {name!r} {e}") from None
            filled[target] = filled.get(target, 0) + 1
        missing = sorted(n for n in params if filled.get(n, 0) != len(getattr(
            self.get_submodule(n.rpartition(".")[0]), "output_sizes", [n])))
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing weights for {len(missing)} parameter(s): {shown}")
