"""Write small GGUF files from transformers models, the way llama.cpp's converter lays them out."""

from __future__ import annotations

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
# Byte offsets of the float16 scale fields in each K-quant block (ggml's block_qN_K structs).
_K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def byte_level_vocab(n_merges: int = 20, n_control: int = 4):
    """tokens, merges, token types of a small GPT-2 style vocabulary."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
                 ("a", "t"), ("e", "n"), ("Ġ", "w"), ("o", "r"), ("Ġ", "c"), ("i", "s"), ("Ġ", "b"), ("a", "n"),
                 ("Ġ", "f"), ("e", "s"), ("Ġ", "p"), ("l", "l")][:n_merges]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"][:n_control]
    types = [1] * len(tokens) + [3] * len(specials)
    return tokens + specials, merges, types


def random_quant_bytes(shape: tuple[int, int], qtype, gen: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (no numpy quantizer exists for them) with small, finite float16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    data = gen.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in _K_SCALE_OFFSETS[qtype]:
        data[..., off:off + 2] = np.frombuffer(np.float16(2e-4).tobytes(), dtype=np.uint8)
    return data.reshape(rows, -1)


def encode_tensor(arr: np.ndarray, qtype, gen: np.random.Generator):
    if qtype == Q.F32:
        return arr.astype(np.float32), None
    if qtype == Q.F16:
        return arr.astype(np.float16), None
    if qtype in _K_SCALE_OFFSETS:
        return random_quant_bytes(arr.shape, qtype, gen), qtype
    return gguf.quants.quantize(arr.astype(np.float32), qtype), qtype


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model: torch.nn.Module, quant_types: list, *, arch: str = "llama", tokenizer: str = "gpt2",
               chat_template: str | None = None, seed: int = 0) -> None:
    """Write `model` (a transformers Llama/Qwen2) as GGUF, cycling 2-D weights through `quant_types`."""
    cfg = model.config
    gen = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer == "gpt2":
        tokens, merges, types = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_merges(merges)
    else:  # SentencePiece: <unk> <s> </s>, 256 byte tokens, then scored pieces
        pieces = ["▁", "▁t", "▁th", "▁the", "h", "e", "t", "a", "▁a", "he", "at", "▁h", "▁hat", "▁c", "▁cat", "c", "s", "▁s",
                  "x", "y", "w", "xy", "yw"]  # "xyw" splits differently if merges are applied in the wrong order
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces
        types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
        w.add_tokenizer_model("llama")
        w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    pad = cfg.vocab_size - len(tokens)
    tokens, types = tokens + [f"<extra_{i}>" for i in range(pad)], types + [4] * pad
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(cfg.bos_token_id if tokenizer != "gpt2" else len(tokens) - pad - 4)
    w.add_eos_token_id(cfg.eos_token_id if tokenizer != "gpt2" else len(tokens) - pad - 2)
    if chat_template:
        w.add_chat_template(chat_template)

    cycle = iter(quant_types * 100)
    for name, t in model.state_dict().items():
        arr = t.float().numpy()
        parts = name.split(".")
        if name == "lm_head.weight":
            gname = "output.weight"
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            module = ".".join(parts[3:-1])  # e.g. self_attn.q_proj or input_layernorm
            gname = f"blk.{parts[2]}.{_HF_TO_GGUF[module]}.{parts[-1]}"
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            arr = llama_permute(arr, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        data, raw = encode_tensor(arr, next(cycle) if arr.ndim == 2 else Q.F32, gen)
        w.add_tensor(gname, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
