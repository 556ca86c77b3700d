"""Shared fixtures: the default model loaded once per session, and tiny random transformers checkpoints."""

from __future__ import annotations

import math
import os
import platform

# Triton's CPU interpreter multiplies tiles with numpy's matmul, whose OpenBLAS kernels depend on the CPU (or on
# OPENBLAS_CORETYPE, which CI's machines set to Haswell): with Haswell's, a row's product depends on its position
# in the tile, which the batch-invariance tests would take for a kernel bug. Sandybridge's kernels (AVX, which
# every x86-64 CPU has that these tests run on) compute every row alike. Chosen before numpy loads.
if platform.machine() in ("x86_64", "AMD64"):
    os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter; it must be chosen before triton is imported.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashpage.loader.default_model import DEFAULT_MODEL, resolve_known_model


def chi2_limit(dof: int) -> float:
    """99.99% quantile of chi-square with `dof` degrees of freedom (Wilson-Hilferty): a correct sampler fails about
    once in ten thousand runs (at 99.9% the suite's two dozen such checks failed a CI run in about forty: one did,
    on 2026-11-25, with 16.9 against 16.5)."""
    z = 3.719
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3 if dof > 0 else 0.0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max over positions of ||out - ref|| / ||ref|| along the last dim."""
    out, ref = out.double(), ref.double()
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


@pytest.fixture(scope="session")
def smollm_gguf():
    return resolve_known_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm_llm(smollm_gguf):
    from flashpage import LLM

    return LLM(str(smollm_gguf), dtype="float32", device="cpu", seed=0)


@pytest.fixture(scope="session")
def smollm_hf(smollm_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_gguf.parent), gguf_file=smollm_gguf.name, dtype=torch.float32).eval()


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that greedy decoding has clear winners; norms and biases not trivially 1 / 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen) if p.dim() > 1 else 0.1 * torch.randn(p.shape, generator=gen))


TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def tiny_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    llama3_rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return {
        "llama3-rope-scaling": LlamaConfig(**TINY, rope_parameters=llama3_rope),
        "llama-linear-rope": LlamaConfig(**TINY, rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 4.0}),
        "qwen2-bias": Qwen2Config(**{**TINY, "num_key_value_heads": 1}),  # MQA as well
        "mistral-window": MistralConfig(**{**TINY, "num_key_value_heads": 4}, sliding_window=12),
        "llama-tied": LlamaConfig(**{**TINY, "num_key_value_heads": 8}, tie_word_embeddings=True),
    }


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """name -> (directory written by save_pretrained, the transformers model)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (name, cfg) in enumerate(tiny_configs().items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        randomize_(model, seed=100 + i)
        path = tmp_path_factory.mktemp(name)
        # the tied model is also written sharded, to exercise model.safetensors.index.json
        model.save_pretrained(path, max_shard_size="100KB" if name == "llama-tied" else "1GB")
        out[name] = (path, model)
    return out


def engine_from(llm, **cfg):
    """A second engine over the session's already-loaded model (no reload)."""
    from flashpage.engine.config import EngineConfig
    from flashpage.engine.llm_engine import LLMEngine
    from flashpage.loader import LoadedModel

    loaded = LoadedModel(llm.config, llm.engine.runner.model, llm.tokenizer)
    dtype = str(llm.engine.runner.dtype).removeprefix("torch.")  # (a draft model loads in the engine's dtype)
    return LLMEngine(EngineConfig(**{"device": "cpu", "dtype": dtype, **cfg}), loaded)


def wait_until(condition, timeout: float = 30.0) -> None:
    """Poll `condition` until it holds; fail after `timeout` seconds."""
    import time

    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "condition not met in time"
        time.sleep(0.02)


def record_rows(engine, plan, rows: torch.Tensor, into: list) -> None:
    """For each sequence of a step's plan: (its tokens up to its last position, its positions, its rows of `rows`),
    appended to `into` (rows laid out as the plan's tokens)."""
    row = 0
    for s in plan.seqs:
        tokens = engine.seqs[s.seq_id].token_ids[:s.positions[-1] + 1]
        into.append((tokens, s.positions, rows[row:row + len(s.token_ids)].clone()))
        row += len(s.token_ids)
