"""One decoder for the Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5, SmolLM2.

Tokens come flattened (all sequences of a step back to back) with their positions. Every operation runs through
a kernel set (`flashpage.kernels`: PyTorch references or Triton), which the model holds as `ops`. The residual
stream h is carried from layer to layer; each projection is one `ops.linear` that takes in its neighbours: the
RMSNorm before Q/K/V and before gate/up, SiLU-and-mul after gate/up, the residual add after o_proj and down_proj
(at decode sizes, one Triton kernel each). Rotary embedding is fused with the KV-cache write. Q/K/V and gate/up
are each one matmul; `load_weights` takes transformers' tensor names and hands each tensor to its parameter's
module's `weight_loader`, which places it (the fused projections fill their slices) and, under tensor parallelism
(`flashpage.parallel`), cuts out this rank's shard, so no rank holds more than its share and one tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from flashpage.config import ModelConfig
from flashpage.kernels import kernel_set
from flashpage.kernels.fp8 import FP8
from flashpage.kv import KVCache
from flashpage.model.attention import AttentionMetadata, attention
from flashpage.model.fp8 import UNUSED_TENSORS, fold_norm_gains, load_scale, place
from flashpage.model.rope import rope_cos_sin, rope_inv_freq
from flashpage.parallel.group import TensorParallel, head_shard


class RMSNorm(nn.Module):
    """The norm's weight and epsilon; applied by the `ops.linear` that reads the normalised input."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps


def weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
    """Copy a checkpoint tensor into a parameter (any dtype/device)."""
    _copy_checked(param.data, tensor)


def _copy_checked(dest: torch.Tensor, tensor: torch.Tensor, full_shape: tuple[int, ...] | None = None,
                  dim: int = 0, start: int = 0, scale: torch.Tensor | None = None) -> None:
    """Copy `tensor` (checked to be `full_shape`, default dest's) into dest, or its slice from `start` along `dim`
    (`scale`: dest's rows' scales, where dest is an FP8 weight)."""
    expected = tuple(dest.shape) if full_shape is None else full_shape
    if tuple(tensor.shape) != expected:
        raise ValueError(f"has shape {tuple(tensor.shape)}, expected {expected}")
    place(dest, tensor.narrow(dim, start, dest.shape[dim]) if full_shape is not None else tensor, scale)


class MergedLinear(nn.Linear):
    """Several projections of one input stacked as one matmul (Q/K/V, gate/up); checkpoints store them apart.
    Column parallel: each rank holds rows [start, start + rows) of each projection; `shards` has (start, rows,
    the projection's rows in the checkpoint) per projection."""

    def __init__(self, in_features: int, shards: list[tuple[int, int, int]], bias: bool):
        super().__init__(in_features, sum(rows for _, rows, _ in shards), bias=bias)
        self.shards = shards
        self.register_parameter("weight_scale", None)  # FP8 weights' (flashpage.model.fp8)

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
        start, rows, full = self.shards[shard]
        offset = sum(r for _, r, _ in self.shards[:shard])
        if param is self.weight_scale:
            load_scale(param.data.narrow(0, offset, rows), tensor, full, start)
            return
        scale = self.weight_scale.data.narrow(0, offset, rows) if param is self.weight and \
            self.weight_scale is not None else None
        _copy_checked(param.data.narrow(0, offset, rows), tensor, (full, *param.shape[1:]), 0, start, scale)


class RowParallelLinear(nn.Linear):
    """o_proj and down_proj. Row parallel: each rank holds input columns [start, start + in_features) of the
    checkpoint's `full_in`, multiplies its share of the input (what its column-parallel neighbour produced) and
    the all-reduce sums the ranks' partial products; rank 0 alone adds the bias and the residual."""

    def __init__(self, in_features: int, out_features: int, bias: bool, start: int, full_in: int, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias)
        self.start, self.full_in, self.tp = start, full_in, tp
        self.register_parameter("weight_scale", None)  # FP8 weights' (flashpage.model.fp8)

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
        if param is self.weight_scale:  # (a row's scale covers every rank's part of it)
            load_scale(param.data, tensor, param.shape[0], 0)
        elif param.dim() == 1:  # the bias, whole on every rank
            _copy_checked(param.data, tensor)
        else:
            _copy_checked(param.data, tensor, (param.shape[0], self.full_in), 1, self.start, self.weight_scale)

    def residual_add(self, ops, x, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T + bias, whole on every rank (the module's own forward is nn.Linear's); x a tensor, or
        QuantizedRows for an FP8 weight."""
        first = self.tp.rank == 0
        out = ops.linear(x, self.weight, self.bias if first else None, residual=residual if first else None,
                         weight_scale=self.weight_scale)
        return self.tp.all_reduce(out)


class VocabParallelEmbedding(nn.Embedding):
    """The embedding, and the LM head's weight: each rank holds vocabulary rows [start, start + n), n =
    ceil(vocab / ranks) (the last rank's rows past the vocabulary are zeros)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        rows = -(-vocab_size // tp.size)
        super().__init__(rows, hidden_size)
        self.vocab_size, self.start, self.tp = vocab_size, tp.rank * rows, tp

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
        rows = max(0, min(param.shape[0], self.vocab_size - self.start))
        param.data[rows:].zero_()
        _copy_checked(param.data[:rows], tensor, (self.vocab_size, param.shape[1]), 0, self.start)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])  # another rank's rows: zeros here, summed in
        h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(h)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        heads, d = head_shard(cfg.num_attention_heads, cfg.num_key_value_heads, tp), cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        full_q, full_kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        q, kv = (heads.q_start * d, self.q_size, full_q), (heads.kv_start * d, self.kv_size, full_kv)
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q, kv, kv], bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_bias, heads.q_start * d, full_q, tp)
        self.scale = self.head_dim**-0.5
        self.sliding_window = cfg.sliding_window
        self.kv_start, self.total_kv_heads = heads.kv_start, cfg.num_key_value_heads
        # An FP8 KV cache's scales as the checkpoint gives them (`self_attn.k_scale` / `v_scale`, vLLM's names),
        # this rank's heads' [num_kv_heads]; used only when the cache is FP8 (flashpage.kv.cache).
        self.kv_cache_scales: dict[str, torch.Tensor] = {}

    def load_kv_cache_scale(self, kind: str, tensor: torch.Tensor) -> None:
        t = tensor.float().reshape(-1).cpu()
        if t.numel() == 1:
            t = t.expand(self.total_kv_heads)
        elif t.numel() != self.total_kv_heads:
            raise ValueError(f"has {t.numel()} scales, expected 1 or one per KV head ({self.total_kv_heads})")
        if not bool((t > 0).all()) or not bool(t.isfinite().all()):
            raise ValueError("holds a scale that is not a positive number")
        self.kv_cache_scales[kind] = t[self.kv_start:self.kv_start + self.num_kv_heads].clone()

    def forward(self, ops, h, norm: RMSNorm | None, cos, sin, meta, kv_cache, residual=None):
        """h + attention(norm(h)) (no norm: h + attention(h), as an EAGLE draft's first layer; `residual`: added
        instead of h, as an EAGLE-3 draft's attention reads more than its residual stream)."""
        qkv = ops.linear(h, self.qkv_proj.weight, self.qkv_proj.bias, norm_weight=norm and norm.weight,
                         eps=norm.eps if norm else 0.0, weight_scale=self.qkv_proj.weight_scale)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = attention(ops, q, k, v, cos, sin, kv_cache, meta, self.scale, self.sliding_window)
        return self.o_proj.residual_add(ops, o.flatten(1), residual=h if residual is None else residual)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        start, rows = tp.shard(cfg.intermediate_size)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [(start, rows, cfg.intermediate_size)] * 2, cfg.mlp_bias)
        self.down_proj = RowParallelLinear(rows, cfg.hidden_size, cfg.mlp_bias, start, cfg.intermediate_size, tp)

    def forward(self, ops, h, norm: RMSNorm):
        """h + down(silu(gate(norm(h))) * up(norm(h)))."""
        act = ops.linear(h, self.gate_up_proj.weight, self.gate_up_proj.bias, norm_weight=norm.weight, eps=norm.eps,
                         silu_mul=True, weight_scale=self.gate_up_proj.weight_scale,
                         quantized_output=self.down_proj.weight.dtype == FP8)
        return self.down_proj.residual_add(ops, act, residual=h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

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


def fused_name(name: str) -> tuple[str, int | None]:
    """A transformers tensor name's parameter here, and its shard of a fused projection (None: whole)."""
    for frag, (fused, idx) in _STACKED.items():
        if frag in name:
            return name.replace(frag, fused), idx
    return name, None


def load_tensor(model: nn.Module, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor,
                filled: dict[str, int], label: str | None = None) -> str:
    """Hand a checkpoint tensor, transformers' `name` for `model`'s naming, to its parameter's loader and count it
    in `filled`; returns the parameter's name. ValueError names the tensor (`label`: its name in the checkpoint)."""
    label = label or name
    target, shard = fused_name(name)
    if target not in params:
        raise ValueError(f"checkpoint tensor {label!r} has no matching parameter in the model")
    module = model.get_submodule(target.rpartition(".")[0])
    try:
        getattr(module, "weight_loader", weight_loader)(params[target], tensor, shard)
    except ValueError as e:
        raise ValueError(f"tensor {label!r} {e}") from None
    filled[target] = filled.get(target, 0) + 1
    return target


def unfilled(model: nn.Module, params: dict[str, nn.Parameter], filled: dict[str, int]) -> list[str]:
    """The parameters no tensor (or not every shard of a fused projection) filled."""
    return sorted(n for n in params if filled.get(n, 0) != len(getattr(
        model.get_submodule(n.rpartition(".")[0]), "shards", [n])))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: str = "torch", tp: TensorParallel | None = None):
        """`tp`: this rank's place in a tensor-parallel group (default: one rank, the whole model)."""
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TensorParallel()
        self.ops = kernel_set(kernels)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tied models read the embedding matrix at the head (a shared Parameter would not survive to_empty()).
        self.lm_head = None if cfg.tie_word_embeddings else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self._inv_freq = rope_inv_freq(cfg)  # CPU float32; not a buffer, so meta/dtype moves leave it exact

    def set_kernels(self, name: str) -> None:
        """'torch' (PyTorch references) or 'triton'."""
        self.ops = kernel_set(name)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache] | None = None,
                feature_layers: tuple[int, ...] = ()):
        """input_ids: [T], at meta.positions. Returns the residual stream after the last layer [T, hidden] (the
        final norm is applied by `compute_logits`, on the rows that need logits). With `feature_layers` (ascending;
        the number of layers stands for after the last), returns (that, the residual streams at the input of those
        layers, side by side [T, len(feature_layers) x hidden]): what a speculative draft reads of the target."""
        h = self.embed_tokens(input_ids)
        if self._inv_freq.device != h.device:
            self._inv_freq = self._inv_freq.to(h.device)
        cos, sin = rope_cos_sin(self._inv_freq, meta.positions, h.dtype)
        features = []
        for i, layer in enumerate(self.layers):
            if i in feature_layers:
                features.append(h)
            h = layer(self.ops, h, cos, sin, meta, None if kv_caches is None else kv_caches[i])
        if not feature_layers:
            return h
        if len(self.layers) in feature_layers:
            features.append(h)
        return h, features[0] if len(features) == 1 else torch.cat(features, -1)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits of rows of `forward`'s output (every rank gets all of them), written to `out` if given."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.ops.linear(hidden, weight, norm_weight=self.norm.weight, eps=self.norm.eps,
                                 out_dtype=torch.float32, out=out if self.tp.size == 1 else None)
        if self.tp.size == 1:
            return logits
        logits = self.tp.gather_last_dim(logits)[:, :self.config.vocab_size]
        return logits.contiguous() if out is None else out.copy_(logits)

    def _projection_norms(self) -> dict[str, str]:
        """Each checkpoint weight that multiplies an RMSNorm's output -> that norm's weight."""
        feeds = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}
        return {f"layers.{i}.{proj}.weight": f"layers.{i}.{norm}.weight"
                for i in range(len(self.layers)) for norm, projs in feeds.items() for proj in projs}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand tensors named as in transformers to their parameters' loaders (any dtype/device; one at a time).

        Raises ValueError naming any tensor that has no home here or has the wrong shape, and any
        parameter no tensor filled.
        """
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        weights = ((name.removeprefix("model."), tensor) for name, tensor in weights)
        # FP8 layers quantized here fold the norms' gains in first; a checkpoint stored in FP8 loads as stored
        if self.layers and self.layers[0].mlp.down_proj.weight.dtype == FP8 and self.config.quantization != "fp8":
            weights = fold_norm_gains(weights, self._projection_norms(), params["norm.weight"].device)
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store a copy of the embedding
            if name.endswith(UNUSED_TENSORS):
                continue
            if name.endswith((".self_attn.k_scale", ".self_attn.v_scale")):
                try:
                    self.get_submodule(name.rpartition(".")[0]).load_kv_cache_scale(name[-7], tensor)
                except (AttributeError, ValueError) as e:
                    raise ValueError(f"tensor {name!r} {e}") from None
                continue
            target = load_tensor(self, params, name, tensor, filled)
            if params[target].dtype != tensor.dtype and target.endswith(".weight") and \
                    f"{target}_scale" in params:  # quantized as it loaded: its scales are filled too
                filled[f"{target}_scale"] = filled.get(f"{target}_scale", 0) + 1
        missing = unfilled(self, params, filled)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing weights for {len(missing)} parameter(s): {shown}")
