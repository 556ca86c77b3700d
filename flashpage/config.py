"""ModelConfig: the shape of a Llama-family decoder, whatever file it came from."""

from __future__ import annotations

from dataclasses import dataclass, field

# Architectures one decoder covers; they differ only in the flags below.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    # Per-frequency divisors stored by llama.cpp for llama3-style rope (tensor `rope_freqs.weight`).
    rope_freq_factors: list[float] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    architecture: str = "llama"
    initializer_range: float = 0.02
    quantization: str | None = None  # how the checkpoint's weights are stored: None, or "fp8" (flashpage.model.fp8)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("default", "llama3", "linear"):
                raise ValueError(f"rope_scaling of type {kind!r} is not supported (supported: llama3, linear)")

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from a transformers `config.json` dict."""
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"flashpage supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        window = cfg.get("sliding_window")
        if arch == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
            # transformers >= 5 folds rope_theta and the scaling into `rope_parameters`.
            params = cfg["rope_parameters"]
            rope_theta = params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "qwen2" or cfg.get("attention_bias", False),
            o_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else list(eos) if isinstance(eos, list) else [eos],
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            architecture=arch,
            initializer_range=cfg.get("initializer_range", 0.02),
            quantization=checkpoint_quantization(cfg),
        )

    def num_parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        qkv = h * d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        if self.qkv_bias:
            qkv += d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        layer = qkv + self.num_attention_heads * d * h + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embed + h


def checkpoint_quantization(hf_config: dict) -> str | None:
    """The quantization a transformers config.json declares: None or "fp8"; ValueError for one flashpage
    cannot read."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8" or q.get("weight_block_size"):
        what = f"{method!r}" + (f" with weight_block_size {q['weight_block_size']}" if q.get("weight_block_size") else "")
        raise ValueError(f"the checkpoint's quantization_config (quant_method {what}) is not supported; flashpage "
                         f"reads quant_method 'fp8' with per-tensor or per-channel weight scales")
    return "fp8"
