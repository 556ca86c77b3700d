"""Turn a model spec (a directory, a .gguf file, a known name or a dummy preset) into a ready model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flashpage.config import ModelConfig
from flashpage.kernels.fp8 import check_fp8_support
from flashpage.loader.default_model import KNOWN_MODELS, resolve_known_model
from flashpage.loader.gguf_file import GGUFModel
from flashpage.loader.hf_dir import HFModelDir
from flashpage.loader.hub import is_hub_id, resolve_hub_model
from flashpage.loader.presets import PRESETS, preset_config
from flashpage.model.fp8 import use_fp8_weights
from flashpage.model.gguf_blocks import pack_int4_weights, use_int4_weights
from flashpage.model.llama import LlamaForCausalLM
from flashpage.parallel.group import TensorParallel
from flashpage.tokenizer import Tokenizer

LOAD_FORMATS = ("auto", "dummy")
# fp8: flashpage.model.fp8; gguf: a GGUF file's 4-bit weights kept as stored (flashpage.model.gguf_blocks)
QUANTIZATIONS = ("fp8", "gguf")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16_matmul() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AMX tiles): there a decode step's products ran
    1.5x (one row) to 3.7x (32 rows) faster in bfloat16 than in float32 (docs/cpu.md); elsewhere bfloat16 is
    emulated and float32 is as fast."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(is_amx and is_amx())


def open_source(model: str, load_format: str = "auto", revision: str | None = None, gguf_file: str | None = None):
    """The checkpoint behind a model spec: an HFModelDir, a GGUFModel, or None for a bare dummy preset. A Hub id
    ("org/name", optionally a GGUF repo's `gguf_file`) is fetched into the Hugging Face cache first."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; choose one of {', '.join(LOAD_FORMATS)}")
    path = Path(model).expanduser()
    if not path.exists() and is_hub_id(model):
        path = resolve_hub_model(model, revision=revision, gguf_file=gguf_file, weights=load_format != "dummy")
    elif revision or gguf_file:
        raise ValueError(f"revision and gguf_file name a version or file of a Hugging Face Hub model ('org/name'), "
                         f"not of {model!r}")
    if path.is_dir():
        return HFModelDir(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is not a .gguf file or a model directory")
        return GGUFModel(path)
    if load_format == "dummy" and model in PRESETS:
        return None
    if model in KNOWN_MODELS:
        return GGUFModel(resolve_known_model(model))
    if "/" in model or model.endswith(".gguf"):
        raise ValueError(f"model path {model!r} does not exist (a Hugging Face Hub id is 'org/name')")
    raise ValueError(
        f"unknown model {model!r}: give a model directory, a .gguf file, or one of {', '.join(sorted(KNOWN_MODELS))}; "
        f"random weights of a preset shape ({', '.join(sorted(PRESETS))}) need load_format='dummy'"
    )


def model_config(cfg) -> ModelConfig:
    """The shape of the model an EngineConfig names, read without loading weights."""
    source = open_source(cfg.model, cfg.load_format, cfg.revision, cfg.gguf_file)
    return preset_config(cfg.model) if source is None else source.config


def build_empty(config: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TensorParallel | None = None,
                quantization: str | None = None) -> LlamaForCausalLM:
    """Allocate the model (this rank's shard of it, under tensor parallelism) directly in its final dtype on its
    device, without initialising it; with quantization="fp8", its layers' projections in FP8, with "gguf", as
    4-bit codes."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp=tp).to(dtype)
        if quantization == "fp8":
            use_fp8_weights(model)
        elif quantization == "gguf":
            use_int4_weights(model)
    return model.to_empty(device=device).eval().requires_grad_(False)


def checkpoint_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each tensor of a transformers checkpoint of this shape, by name."""
    q, kv, h, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size, \
        c.intermediate_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
                 "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                 "mlp.down_proj.weight": (h, inter)}
        if c.qkv_bias:
            layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
        if c.o_bias:
            layer["self_attn.o_proj.bias"] = (h,)
        if c.mlp_bias:
            layer |= {"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,), "mlp.down_proj.bias": (h,)}
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def auto_quantization(source, dtype, load_format: str, device: torch.device, tp: TensorParallel | None) -> str | None:
    """"gguf" for a GGUF file whose projections are Q4_0/Q4_1, loaded with dtype "auto" on one CPU rank where auto
    means bfloat16 (measured there: SmolLM2 at one prompt 70 tok/s against 39 with the weights dequantized to
    bfloat16, perplexity -0.15% against float32; docs/cpu.md); otherwise None, the weights dequantized to the
    model's dtype, as an explicit dtype asks."""
    keep = (dtype == "auto" and device.type == "cpu" and cpu_has_bf16_matmul() and isinstance(source, GGUFModel)
            and load_format != "dummy" and (tp is None or tp.size == 1))
    return "gguf" if keep and source.projections_in_kept_types() else None


def check_gguf_blocks(source, load_format: str, device: torch.device, tp: TensorParallel | None) -> None:
    """ValueError unless quantization 'gguf' can run: a GGUF file's weights, on the CPU, one rank."""
    if not isinstance(source, GGUFModel) or load_format == "dummy":
        raise ValueError("quantization 'gguf' keeps a GGUF file's 4-bit weights as stored; the model is not a "
                         ".gguf file")
    if device.type != "cpu":
        raise ValueError("quantization 'gguf' runs on the CPU (PyTorch's int4 CPU kernel); on CUDA leave it unset "
                         "and the GGUF weights load in the model's dtype")
    if tp is not None and tp.size > 1:
        raise ValueError("quantization 'gguf' does not support tensor parallelism")


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights scaled as the model's own init (normal(0, initializer_range), norms 1, biases 0), drawn for
    the whole checkpoint in one order and loaded like a checkpoint's, so every rank of a tensor-parallel group gets
    its shard of the same model."""
    param = next(model.parameters())
    gen = torch.Generator(device=param.device).manual_seed(seed)
    std = model.config.initializer_range

    def tensors():
        for name, shape in checkpoint_shapes(model.config).items():
            t = torch.empty(shape, dtype=param.dtype, device=param.device)
            if name.endswith("norm.weight"):
                yield name, t.fill_(1.0)
            elif name.endswith("bias"):
                yield name, t.zero_()
            else:
                yield name, t.normal_(0.0, std, generator=gen)

    model.load_weights(tensors())


def load_model(model: str, *, load_format: str = "auto", dtype="auto", device="cpu", seed: int = 0,
               revision: str | None = None, gguf_file: str | None = None,
               tp: TensorParallel | None = None, quantization: str | None = None) -> LoadedModel:
    """The model (this rank's shard under tensor parallelism `tp`), its config and tokenizer. `quantization`:
    "fp8", quantize the layers' weights as they load (a checkpoint stored in FP8 loads in FP8 anyway); "gguf", keep
    a GGUF file's 4-bit weights as stored (CPU)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is available; use device='cpu'")
    torch_dtype = resolve_dtype(dtype, device)
    source = open_source(model, load_format, revision, gguf_file)
    config = preset_config(model) if source is None else source.config
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization {quantization!r} is not supported; choose one of {', '.join(QUANTIZATIONS)}")
    quantization = quantization or config.quantization or auto_quantization(source, dtype, load_format, device, tp)
    if quantization == "fp8":
        check_fp8_support(device, "quantization 'fp8'")
    if quantization == "gguf":
        check_gguf_blocks(source, load_format, device, tp)
    net = build_empty(config, torch_dtype, device, tp, quantization)
    if load_format == "dummy":
        init_dummy_weights(net, seed)
    elif quantization == "gguf":
        net.load_weights(source.weights(keep_blocks=True))
        pack_int4_weights(net)
    else:
        net.load_weights(source.weights())
    tokenizer = None if source is None else source.tokenizer()
    if tokenizer is not None and not config.eos_token_ids:
        config.eos_token_ids = list(tokenizer.eos_token_ids)
    return LoadedModel(config, net, tokenizer)
