"""Peers for the end-to-end benchmarks, on the same weights as the flashpage model (shared, not copied):

- `to_transformers`: transformers' LlamaForCausalLM (eager, SDPA attention), for `generate`.
- `StaticLlama`: a decode loop in the style of gpt-fast: plain PyTorch, a static KV cache, and one decode step
  compiled with `torch.compile(mode="reduce-overhead")` (CUDA graphs). The strongest single-request peer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.model import LlamaForCausalLM
from flashpage.model.rope import rope_cos_sin


def to_transformers(model: LlamaForCausalLM):
    """transformers' Llama over the same parameter storage (the fused projections are split as views)."""
    import transformers

    cfg = model.config
    rope = {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})}
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, rope_parameters=rope,
        attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias, torch_dtype=next(model.parameters()).dtype,
        attn_implementation="sdpa")
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_cfg)
    state = {}
    for name, p in model.named_parameters():
        key = name if name.startswith("lm_head") else "model." + name
        if ".qkv_proj." in name:
            a = model.layers[0].self_attn
            for part, t in zip(("q_proj", "k_proj", "v_proj"), p.split([a.q_size, a.kv_size, a.kv_size])):
                state[key.replace("qkv_proj", part)] = t
        elif ".gate_up_proj." in name:
            for part, t in zip(("gate_proj", "up_proj"), p.chunk(2)):
                state[key.replace("gate_up_proj", part)] = t
        else:
            state[key] = p
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = model.embed_tokens.weight
    hf.load_state_dict(state, strict=True, assign=True)
    device = next(model.parameters()).device
    with torch.device(device):  # its buffers were made on meta
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg)
    return hf.eval()


class StaticLlama(nn.Module):
    """gpt-fast's decoder: [B, S] tokens at positions input_pos [S], K/V written into a static cache
    [layers, B, Hkv, max_len, D] with index_copy_, attention by SDPA under a mask sliced from a causal one."""

    def __init__(self, model: LlamaForCausalLM, batch: int, max_len: int):
        super().__init__()
        self.m, cfg = model, model.config
        param = next(model.parameters())
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=param.dtype, device=param.device)
        self.v_cache = torch.zeros(shape, dtype=param.dtype, device=param.device)
        self.causal = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool, device=param.device))
        self.inv_freq = model._inv_freq.to(param.device)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        m = self.m
        b, s = idx.shape
        cos, sin = rope_cos_sin(self.inv_freq, input_pos, self.k_cache.dtype)
        mask = self.causal[None, None, input_pos]
        h = m.embed_tokens(idx)
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            x = _rms(h, layer.input_layernorm)
            q, k, v = a.qkv_proj(x).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            q = _rope(q.view(b, s, a.num_heads, a.head_dim).transpose(1, 2), cos, sin)
            k = _rope(k.view(b, s, a.num_kv_heads, a.head_dim).transpose(1, 2), cos, sin)
            v = v.view(b, s, a.num_kv_heads, a.head_dim).transpose(1, 2)
            self.k_cache[i].index_copy_(2, input_pos, k)
            self.v_cache[i].index_copy_(2, input_pos, v)
            o = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask, enable_gqa=True)
            h = h + a.o_proj(o.transpose(1, 2).reshape(b, s, -1))
            gate, up = layer.mlp.gate_up_proj(_rms(h, layer.post_attention_layernorm)).chunk(2, dim=-1)
            h = h + layer.mlp.down_proj(F.silu(gate) * up)
        weight = m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight
        return F.linear(_rms(h, m.norm), weight).float()


def _rms(x, norm):
    f = x.float()
    return norm.weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def gpt_fast_generate(net: StaticLlama, decode, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """gpt-fast's greedy loop: prefill eagerly, then `decode` (the compiled step) once per token, positions kept on
    the device. Returns tokens [B, new_tokens] and the mean time of a decode step in ms (CUDA events)."""
    s = prompt.shape[1]
    with torch.inference_mode():
        token = greedy_step(net, prompt, torch.arange(s, device=prompt.device))
        out = [token]
        pos = torch.tensor([s], device=prompt.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(new_tokens - 1):
            token = decode(net, token.clone(), pos).clone()
            pos += 1
            out.append(token)
        end.record()
        end.synchronize()
    return torch.cat(out, 1), start.elapsed_time(end) / max(new_tokens - 1, 1)


def greedy_step(net: StaticLlama, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return net(tokens, pos)[:, -1].argmax(-1, keepdim=True)


def compiled_greedy_step():
    """The decode step as gpt-fast compiles it."""
    return torch.compile(greedy_step, mode="reduce-overhead", fullgraph=True)
