"""Named model shapes for dummy (random) weights: real architectures, no checkpoint needed."""

from __future__ import annotations

from flashpage.config import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_ids=[2]),
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, eos_token_ids=[2]),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, eos_token_ids=[128001, 128009]),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                         rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, rms_norm_eps=1e-5,
                         eos_token_ids=[128001, 128008, 128009]),
    "llama-3.1-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                          rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, rms_norm_eps=1e-5,
                          eos_token_ids=[128001, 128008, 128009]),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                         rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, eos_token_ids=[128001, 128008, 128009]),
    "mistral-7b": dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-5, architecture="mistral", eos_token_ids=[2]),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True, architecture="qwen2",
                       eos_token_ids=[151645, 151643]),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return ModelConfig(**PRESETS[name])
