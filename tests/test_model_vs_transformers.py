"""Our decoder computes what transformers computes: logits per position and greedy continuations."""

from __future__ import annotations

import zlib

import pytest
import torch

from conftest import rel_err, tiny_configs
from flashpage import LLM, SamplingParams
from flashpage.loader import load_model
from flashpage.model import AttentionMetadata

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "Hi",
]


def our_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        t = torch.tensor(ids)
        return model.compute_logits(model(t, AttentionMetadata.prefill([len(ids)])))


def test_smollm_gguf_logits_match_transformers(smollm_llm, smollm_hf):
    model, tok = smollm_llm.engine.runner.model, smollm_llm.tokenizer
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = smollm_hf(torch.tensor([ids])).logits[0]
        assert rel_err(our_logits(model, ids), ref) <= 1e-4, prompt


def test_smollm_varlen_batch_equals_single_sequences(smollm_llm):
    """Packing several sequences into one forward gives each the logits it gets alone."""
    model, tok = smollm_llm.engine.runner.model, smollm_llm.tokenizer
    seqs = [tok.encode(p) for p in PROMPTS]
    flat = torch.tensor([t for s in seqs for t in s])
    with torch.no_grad():
        batched = model.compute_logits(model(flat, AttentionMetadata.prefill([len(s) for s in seqs])))
    for chunk, s in zip(batched.split([len(s) for s in seqs]), seqs):
        assert rel_err(chunk, our_logits(model, s)) <= 1e-5


def test_smollm_greedy_32_tokens_match_transformers_generate(smollm_llm, smollm_hf):
    tok = smollm_llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    outs = smollm_llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for out in outs:
        with torch.no_grad():
            ref = smollm_hf.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=32, min_new_tokens=32,
                                     do_sample=False)[0, len(out.prompt_token_ids):].tolist()
        assert out.outputs[0].token_ids == ref, out.prompt
        assert out.outputs[0].text == tok.decode(ref)


@pytest.mark.parametrize("name", list(tiny_configs()))
def test_tiny_checkpoint_logits_and_greedy_match_transformers(tiny_checkpoints, name):
    path, ref_model = tiny_checkpoints[name]
    loaded = load_model(str(path), dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    for length in (1, 7, 40):  # 40 > the mistral window (12) and > llama3's original context (32)
        ids = torch.randint(0, ref_model.config.vocab_size, (length,), generator=gen).tolist()
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0]
        assert rel_err(our_logits(loaded.model, ids), ref) <= 1e-4, (name, length)

    llm = LLM(str(path), dtype="float32", device="cpu")
    prompts = [torch.randint(0, ref_model.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 11, 29)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        if getattr(ref_model.config, "sliding_window", None) is None:
            with torch.no_grad():
                ref = ref_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        else:
            # transformers 5.23's generate() with a sliding window disagrees with its own forward pass once the
            # sequence passes the window (with or without its cache); greedy over full forwards is the definition.
            ref = full_forward_greedy(ref_model, prompt, 32)
        assert out.outputs[0].token_ids == ref, (name, prompt)


def full_forward_greedy(model, prompt: list[int], steps: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]
