"""GGUF loading: every supported quant type, Q/K un-permutation, tokenizers and chat template, clear errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conftest import randomize_, rel_err
from flashpage import LLM
from flashpage.loader import load_model
from flashpage.loader.gguf_file import SUPPORTED_QUANTS
from flashpage.model import AttentionMetadata
from gguf_factory import Q, write_gguf

ALL_QUANTS = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F32]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def tiny_hf_model(kind: str, seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    # K-quants need rows of 256 values, so hidden and intermediate sizes are multiples of 256.
    shape = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    cfg = LlamaConfig(**shape) if kind == "llama" else Qwen2Config(**shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize_(model, seed)
    return model


@pytest.mark.parametrize("arch,offset", [("llama", 0), ("llama", 5), ("qwen2", 3)])
def test_gguf_quant_types_match_transformers(tmp_path, arch, offset):
    """Each supported quant type lands on some weight matrix; logits equal transformers' reading of the same file."""
    from transformers import AutoModelForCausalLM

    quants = ALL_QUANTS[offset:] + ALL_QUANTS[:offset]
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf_model(arch, seed=offset), quants, arch=arch, seed=offset)
    ours = load_model(str(path), dtype="float32", device="cpu")
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    for length in (1, 13, 50):
        ids = torch.randint(0, 320, (length,))
        with torch.no_grad():
            out = ours.model.compute_logits(ours.model(ids, AttentionMetadata.prefill([length])))
            expected = ref(ids[None]).logits[0]
        assert torch.isfinite(out).all()
        assert rel_err(out, expected) <= 1e-4, (arch, length)


def test_all_supported_quants_are_exercised():
    assert {q.name for q in ALL_QUANTS} == SUPPORTED_QUANTS


def test_gguf_byte_level_tokenizer_and_chat_template_match_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "tok.gguf"
    write_gguf(path, tiny_hf_model("llama", 1), [Q.F16], chat_template=TEMPLATE)
    llm = LLM(str(path), dtype="float32", device="cpu")
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the cat is on the mat", "Whither, whence? In the beginning...", "héllo wörld 世界 🙂",
                 "<|im_start|>user\nhi<|im_end|>", "  spaced   out\n\n\tlines "]:
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert llm.tokenizer.decode(ids, skip_special_tokens=False) == text
    messages = [{"role": "user", "content": "the cat"}]
    assert llm.tokenizer.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                                  add_generation_prompt=True)
    assert llm.tokenizer.encode("<|im_end|>", add_special_tokens=False) == [llm.config.eos_token_ids[0]]


def test_gguf_sentencepiece_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "spm.gguf"
    write_gguf(path, tiny_hf_model("llama", 2), [Q.F16], tokenizer="llama")
    ours = load_model(str(path)).tokenizer
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the hat", "the cat sat", "a thesis", "zebra ü", "xyw yw"]:  # 'z', 'ü' fall back to byte tokens
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == text


def _write_minimal(path, arch: str, tensor_type=None):
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(1)
    if tensor_type is None:
        w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    else:
        block, size = gguf.GGML_QUANT_SIZES[tensor_type]
        w.add_tensor("token_embd.weight", np.zeros((4, 256 // block * size), dtype=np.uint8), raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_unsupported_architecture_is_a_clear_error(tmp_path):
    _write_minimal(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_model(str(tmp_path / "gpt2.gguf"))


def test_gguf_unsupported_quant_type_is_a_clear_error(tmp_path):
    _write_minimal(tmp_path / "iq.gguf", "llama", Q.IQ4_NL)
    with pytest.raises(ValueError, match="quant type.*IQ4_NL.*not supported"):
        load_model(str(tmp_path / "iq.gguf"))


def test_truncated_gguf_is_a_clear_error(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model(str(tmp_path / "bad.gguf"))
