"""quantization="gguf": a GGUF file's Q4_0 / Q4_1 weights kept as stored, multiplied by PyTorch's int4 CPU kernel."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conftest import rel_err
from flashpage import LLM, SamplingParams
from flashpage.kernels.int4 import int4_linear
from flashpage.loader import load_model
from flashpage.model import AttentionMetadata
from flashpage.model.gguf_blocks import unpack_blocks
from gguf_factory import Q, write_gguf
from test_gguf import tiny_hf_model


def blocks_of(shape, qtype, gen):
    """Random weights quantized by gguf's own quantizer: (bytes, the weights gguf dequantizes them to)."""
    rows = gen.standard_normal((shape[0], 1)).astype(np.float32) * 0.02  # (rows off zero: Q4_1's minimum matters)
    w = gen.standard_normal(shape).astype(np.float32) * 0.05 + rows
    raw = gguf.quants.quantize(w, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(shape)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_unpacked_blocks_give_gguf_s_weights(qtype):
    gen = np.random.default_rng()
    raw, want = blocks_of((48, 96), Q[qtype], gen)
    codes, sz = unpack_blocks(raw, qtype, (48, 96))
    assert codes.dtype == np.uint8 and codes.max() <= 15
    got = (codes.reshape(48, 3, 32).astype(np.float32) - 8) * sz[..., :1] + sz[..., 1:]
    np.testing.assert_allclose(got.reshape(48, 96), want, rtol=0, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_linear_within_twice_the_error_of_its_bfloat16_math(m, qtype):
    """Against float64 on the file's exact weights: at most twice the error of the same math done by hand (x,
    scales and zeros rounded to bfloat16, the product rounded to bfloat16)."""
    gen = np.random.default_rng()
    n, k = 64, 160
    raw, w = blocks_of((n, k), Q[qtype], gen)
    codes, sz = unpack_blocks(raw, qtype, (n, k))
    packed = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes).int(), 1)
    sz_bf16 = torch.from_numpy(sz).transpose(0, 1).to(torch.bfloat16).contiguous()
    x = torch.randn(m, k)
    exact = x.double() @ torch.from_numpy(w).double().T
    s, z = (sz_bf16[..., i].T.double().repeat_interleave(32, dim=1) for i in (0, 1))
    by_hand = (x.bfloat16().double() @ ((torch.from_numpy(codes).double() - 8) * s + z).T).bfloat16()
    got = int4_linear(x, packed, sz_bf16)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert rel_err(got, exact) <= 2 * rel_err(by_hand, exact) + 1e-4


@pytest.mark.parametrize("m", [1, 8, 21])
def test_cpu_kernel_set_multiplies_4_bit_weights_as_int4_linear(m):
    """From INT4_ROWS rows on the CPU set multiplies a dequantized copy of the codes (in x's dtype): the same
    weights as the 4-bit kernel's, so within bfloat16's rounding of it; the copy is exactly the codes' values."""
    from flashpage.kernels import cpu

    gen = np.random.default_rng()
    n, k = 48, 96
    raw, _ = blocks_of((n, k), Q["Q4_1"], gen)
    codes, sz = unpack_blocks(raw, "Q4_1", (n, k))
    packed = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes).int(), 1)
    sz_bf16 = torch.from_numpy(sz).transpose(0, 1).to(torch.bfloat16).contiguous()
    s, z = (sz_bf16[..., i].T.float().repeat_interleave(32, dim=1) for i in (0, 1))
    by_hand = ((torch.from_numpy(codes).float() - 8) * s + z).bfloat16()
    assert torch.equal(cpu.dequantize_int4(packed, sz_bf16), by_hand)
    for dtype in (torch.float32, torch.bfloat16):
        x, residual = torch.randn(m, k, dtype=dtype), torch.randn(m, n, dtype=dtype)
        got = cpu.linear(x, packed, residual=residual, weight_scale=sz_bf16)
        assert got.dtype == dtype
        assert rel_err(got, int4_linear(x, packed, sz_bf16) + residual) < 1e-2


@pytest.fixture(scope="module")
def tiny_q4_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4") / "tiny-q4.gguf"
    write_gguf(path, tiny_hf_model("llama", seed=7), [Q.Q4_0, Q.Q4_1], arch="llama", seed=7)
    return path


def test_kept_blocks_model_matches_the_dequantized_model(tiny_q4_gguf):
    """The same file, its 4-bit weights kept against dequantized to float32 (transformers' reading, tested in
    test_gguf): logits within bfloat16's reach, across prompt lengths (1, odd, several pages)."""
    dense = load_model(str(tiny_q4_gguf), dtype="float32", device="cpu")
    kept = load_model(str(tiny_q4_gguf), dtype="float32", device="cpu", quantization="gguf")
    qkv = kept.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.uint8 and qkv.weight_scale.dtype == torch.bfloat16
    for length in (1, 13, 50):
        ids = torch.randint(0, 320, (length,))
        meta = AttentionMetadata.prefill([length])
        with torch.no_grad():
            want = dense.model.compute_logits(dense.model(ids, meta))
            got = kept.model.compute_logits(kept.model(ids, meta))
        assert torch.isfinite(got).all()
        assert rel_err(got, want) < 3e-2, length


def test_kept_blocks_serve_through_the_engine(tiny_q4_gguf):
    """Decode through the paged cache gives the tokens of the same model's prefill-only forward (no block leaks)."""
    llm = LLM(str(tiny_q4_gguf), dtype="float32", device="cpu", quantization="gguf")
    prompts = [[5, 9, 11], list(range(20, 37))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    model = llm.engine.runner.model
    for p, out in zip(prompts, outs):
        ids = p + list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = model.compute_logits(model(torch.tensor(ids), AttentionMetadata.prefill([len(ids)])))
        assert logits[len(p) - 1:-1].argmax(-1).tolist() == list(out.outputs[0].token_ids)
    assert llm.stats()["kv_slots_allocated"] == 0


def test_kept_blocks_on_smollm2_cost_little(smollm_llm, smollm_gguf):
    """SmolLM2 on CPython's documentation: perplexity over 2,048 tokens within 1% of float32's (measured: README)."""
    from pydoc_data.topics import topics

    from flashpage.bench.quality import perplexity

    ids = smollm_llm.tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics))[:30000])[:2048]
    kept = LLM(str(smollm_gguf), dtype="float32", device="cpu", quantization="gguf")
    dense_ppl, kept_ppl = perplexity(smollm_llm, ids, 1024), perplexity(kept, ids, 1024)
    assert kept_ppl / dense_ppl - 1 < 0.01, (dense_ppl, kept_ppl)


def test_auto_keeps_4_bit_blocks_only_with_dtype_auto_on_a_bfloat16_cpu(tiny_q4_gguf, tmp_path, monkeypatch):
    """dtype "auto" on a CPU with AMX: bfloat16 and the file's Q4 blocks kept; an explicit dtype, a CPU without
    AMX, or projections stored otherwise (Q8_0): dequantized, no error."""
    import flashpage.loader as loader

    def kept(path, **kw):
        model = load_model(str(path), device="cpu", **kw).model
        return model.layers[0].self_attn.qkv_proj.weight.dtype == torch.uint8, next(model.parameters()).dtype

    monkeypatch.setattr(loader, "cpu_has_bf16_matmul", lambda: True)
    assert kept(tiny_q4_gguf) == (True, torch.bfloat16)
    assert kept(tiny_q4_gguf, dtype="float32") == (False, torch.float32)
    q8 = tmp_path / "q8.gguf"
    write_gguf(q8, tiny_hf_model("llama", seed=1), [Q.Q8_0], arch="llama")
    assert kept(q8) == (False, torch.bfloat16)
    monkeypatch.setattr(loader, "cpu_has_bf16_matmul", lambda: False)
    assert kept(tiny_q4_gguf) == (False, torch.float32)


def test_bad_gguf_quantization_settings_fail_before_loading(tiny_checkpoints, tmp_path):
    hf_dir, _ = tiny_checkpoints["llama3-rope-scaling"]
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM(str(hf_dir), device="cpu", quantization="gguf")
    q8 = tmp_path / "q8.gguf"
    write_gguf(q8, tiny_hf_model("llama", seed=1), [Q.Q8_0], arch="llama")
    with pytest.raises(ValueError, match="keeps Q4_0 and Q4_1 .* is Q8_0"):
        LLM(str(q8), device="cpu", quantization="gguf")
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM(str(q8), device="cpu", quantization="gguf", load_format="dummy")
