"""EngineConfig: every engine setting, declared once with its type, default and help.

`LLM(model, **settings)`, the command line (`flashpage generate/chat/serve ... --max-num-seqs 64`) and the server
are built from these fields; an unknown or invalid setting fails with one message naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field

from flashpage.engine.sparse import SparseAttentionConfig
from flashpage.engine.spec.config import SpeculativeConfig
from flashpage.errors import ParameterError
from flashpage.loader.default_model import DEFAULT_MODEL


def _setting(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineConfig:
    model: str = _setting(DEFAULT_MODEL, "Hugging Face Hub id (org/name), model directory, .gguf file, or known name")
    revision: str | None = _setting(None, "Hub model: the branch, tag or commit (default: main)")
    gguf_file: str | None = _setting(None, "Hub model: the .gguf file of a GGUF repo to load")
    load_format: str = _setting("auto", "dummy: random weights of the model's shape", ("auto", "dummy"))
    dtype: str = _setting("auto", "auto (bfloat16 on CUDA and on CPUs with AMX, else float32), float32, bfloat16, float16")
    device: str = _setting("auto", "cpu, cuda, or auto (cuda when available)")
    seed: int = _setting(0, "seeds the dummy weights and requests that bring no seed")
    max_model_len: int | None = _setting(None, "context (prompt plus output) in tokens; default: the model's")
    kernels: str = _setting("auto", "auto: triton on CUDA, cpu on CPU; torch: the PyTorch references; "
                            "batch_invariant: what deterministic picks", ("auto", "torch", "cpu", "triton", "batch_invariant"))
    block_size: int | None = _setting(None, "tokens per KV-cache block, a power of two (default: 16; 64 with SparQ, "
                                      "whose scores then read 64-byte runs of its key copy, not 16)")
    num_gpu_blocks: int | None = _setting(None, "KV cache size in blocks (default: from the memory settings)")
    gpu_memory_utilization: float = _setting(0.9, "CUDA: fraction of the GPU's memory flashpage may fill")
    cpu_kv_cache_gb: float = _setting(1.0, "CPU: KV cache size in GiB")
    max_num_seqs: int = _setting(512, "sequences per step at most")
    max_num_batched_tokens: int = _setting(16384, "tokens per step at most; longer prompts are prefilled in chunks")
    enable_prefix_caching: bool = _setting(True, "reuse the KV blocks of prompts seen before")
    enforce_eager: bool = _setting(False, "CUDA: no CUDA graphs, every step eager")
    overlap: bool = _setting(True, "schedule step N+1 before reading step N's tokens back")
    max_logprobs: int = _setting(20, "most log-probs a request may ask for per token (-1: no limit)")
    cpu_threads: int | None = _setting(None, "CPU: PyTorch threads (default: OMP_NUM_THREADS if set, else the "
                                             "physical cores this process may use)")
    deterministic: bool = _setting(False, "batch-invariant kernels: a request's tokens and log-probs are the same "
                                   "whatever else is batched (CUDA)")
    quantization: str | None = _setting(None, "fp8: FP8 (e4m3) weights, quantized as they load, and per-token FP8 "
                                        "activations; gguf (CPU): a GGUF file's Q4_0/Q4_1 weights kept as stored, "
                                        "bfloat16 activations at their products (default: gguf for such a file "
                                        "with dtype auto on a CPU with AMX; otherwise as the checkpoint is stored, "
                                        "dequantized)", ("fp8", "gguf"))
    kv_cache_dtype: str = _setting("auto", "auto: the model's dtype; fp8 (or vLLM's name for it, fp8_e4m3): e4m3, "
                                   "one scale per layer and KV head (1, or the checkpoint's); int8: one scale per "
                                   "token and KV head; either holds about twice the tokens of a 16-bit cache in the "
                                   "same memory", ("auto", "fp8", "fp8_e4m3", "int8"))
    tensor_parallel_size: int = _setting(1, "split the model over this many ranks, one process per GPU (CPU: "
                                         "processes over gloo); under torchrun, its world size")
    speculative_config: dict | None = _setting(None, "speculative decoding, as vLLM's dict (JSON on the command "
                                               "line): method ngram or draft_model, num_speculative_tokens, ...")
    sparse_attention: dict | None = _setting(None, "opt-in, lossy sparse attention (JSON on the command line): "
                                             '{"method": "sparq", "r": 16, "k": 256}, SparQ for decode; '
                                             '{"method": "block", "block": 64, "sink": 1, "local": 16, '
                                             '"stride": 0}, block-sparse prefill')

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), _TYPES[f.name]
            optional = kind is not bool and f.default is None
            if isinstance(value, bool):  # (a bool is an int to isinstance)
                ok = kind is bool
            elif value is None:
                ok = optional
            else:
                ok = isinstance(value, (int, float) if kind is float else kind)
            if not ok:
                raise ParameterError(f.name, f"engine setting {f.name} must be {kind.__name__}"
                                     f"{' or None' if optional else ''}, got {value!r}")
            if f.metadata["choices"] and value is not None and value not in f.metadata["choices"]:
                raise ParameterError(f.name, f"engine setting {f.name} must be one of {', '.join(f.metadata['choices'])}"
                                     f", got {value!r}")
        if self.kv_cache_dtype == "fp8_e4m3":  # vLLM's other name for its e4m3 cache
            self.kv_cache_dtype = "fp8"
        if self.block_size is None:
            self.block_size = 64 if self.sparse is not None and self.sparse.method == "sparq" else 16
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ParameterError("block_size", f"block_size must be a power of two, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks", "cpu_threads", "tensor_parallel_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ParameterError(name, f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ParameterError("gpu_memory_utilization", "gpu_memory_utilization must be in (0, 1], got "
                                 f"{self.gpu_memory_utilization}")
        if self.max_logprobs < -1:
            raise ParameterError("max_logprobs", f"max_logprobs must be >= -1, got {self.max_logprobs}")
        if not self.cpu_kv_cache_gb > 0:
            raise ParameterError("cpu_kv_cache_gb", f"cpu_kv_cache_gb must be > 0, got {self.cpu_kv_cache_gb}")
        self.speculative  # (checks it)
        self.sparse

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_dict(self.speculative_config) if self.speculative_config is not None else None

    @property
    def sparse(self) -> SparseAttentionConfig | None:
        return SparseAttentionConfig.from_dict(self.sparse_attention) if self.sparse_attention is not None else None

    @classmethod
    def from_settings(cls, **settings) -> EngineConfig:
        unknown = sorted(set(settings) - set(_TYPES))
        if unknown:
            raise ParameterError(unknown[0], f"unknown engine setting(s) {', '.join(map(repr, unknown))}; known: "
                                 f"{', '.join(_TYPES)}")
        return cls(**settings)

    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser, **defaults) -> None:
        """One option per setting: --max-num-seqs N, --enable-prefix-caching / --no-enable-prefix-caching, ...;
        `defaults` replaces some settings' defaults for this command."""
        for f in dataclasses.fields(cls):
            flag, kind, meta = "--" + f.name.replace("_", "-"), _TYPES[f.name], f.metadata
            value = defaults.get(f.name, f.default)
            default = f"default {value}" if value is not None else "optional"
            if kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value,
                                    help=f"{meta['help']} ({default})")
            elif kind is dict:
                parser.add_argument(flag, type=_json_object, default=value, help=f"{meta['help']} ({default})")
            else:
                parser.add_argument(flag, type=kind, default=value, choices=meta["choices"],
                                    help=f"{meta['help']} ({default})")

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{name: getattr(args, name) for name in _TYPES})


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


_json_object.__name__ = "JSON object"  # argparse's error says "invalid JSON object value: ..."


# each setting's plain type (int for `int | None`)
_TYPES = {name: next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
          for name, hint in typing.get_type_hints(EngineConfig).items()}
