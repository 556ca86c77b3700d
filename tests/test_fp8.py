"""FP8 weights (quantization="fp8"): the kernels, quantizing as a checkpoint loads, pre-quantized checkpoints in
vLLM's layout, bad settings, and the quality cost on the default model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import DEVICE, rel_err
from flashpage import LLM, SamplingParams
from flashpage.bench.quality import perplexity
from flashpage.kernels import reference
from flashpage.kernels.fp8 import FP8, FP8_MAX, quantize_rows


def test_quantize_rows_keeps_three_mantissa_bits():
    x = torch.randn(7, 300) * torch.logspace(-3, 3, 7)[:, None]
    x[3] = 0
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (7,) and scale[3] == 1 and (q[3].float() == 0).all()
    assert torch.equal(q.float().abs().amax(-1)[[0, 1, 2, 4, 5, 6]], torch.full((6,), FP8_MAX))
    back = q.float() * scale[:, None]
    normal = back.abs() >= 2**-6 * scale[:, None]  # (e4m3's subnormals have fewer bits)
    assert ((back - x).abs() <= 2**-4 * x.abs() + 1e-30)[normal].all()


@pytest.mark.parametrize("silu_mul", [False, True])
def test_decode_linear_streams_fp8_weights(silu_mul):
    """The Triton weight-streaming kernel (interpreter on CPU) with FP8 weights, 16-bit activations, against
    float64: no worse than the same kernel given the dequantized weight in bf16 (the interpreter rounds to bf16 by
    truncation, so both are worse than PyTorch's bf16), and within the 16-bit bound of the kernel's own tests."""
    from flashpage.kernels.linear import skinny_linear

    n, k = 50, 96
    x = torch.randn(5, k, dtype=torch.bfloat16, device=DEVICE)
    q, scale = quantize_rows(torch.randn(2 * n if silu_mul else n, k, device=DEVICE))
    bias, residual = (None, None) if silu_mul else (torch.randn(n, dtype=torch.bfloat16, device=DEVICE),
                                                    torch.randn(5, n, dtype=torch.bfloat16, device=DEVICE))
    out = skinny_linear(x, q, bias, silu_mul=silu_mul, residual=residual, weight_scale=scale)
    dequantized = q.double() * scale.double()[:, None]
    kw = dict(bias=bias, silu_mul=silu_mul, residual=residual)
    exact = reference.linear(x.double(), dequantized, **{k: v if v is None or isinstance(v, bool) else v.double()
                                                         for k, v in kw.items()})
    same_kernel_bf16 = skinny_linear(x, dequantized.bfloat16(), bias, silu_mul=silu_mul, residual=residual)
    assert rel_err(out, exact) <= 1.25 * rel_err(same_kernel_bf16, exact) + 1e-3
    assert rel_err(out, exact) < 3e-2


@pytest.mark.parametrize("silu_mul,norm", [(False, True), (True, True), (False, False)])
def test_fp8_linear_above_decode_rows(silu_mul, norm):
    """Past 16 rows an FP8 projection quantizes its activations per token (the RMSNorm in the same kernel) and
    multiplies e4m3 by e4m3 in Triton with the epilogues fused (interpreter on CPU; odd sizes, two row tiles):
    against float64 arithmetic on the kernel's own quantized activations, whose scales are checked against the
    reference quantizer's of the norm kernel's rows."""
    from flashpage.kernels import triton_ops
    from flashpage.kernels.norm import rms_norm
    from flashpage.kernels.quantize import quantize_rows as kernel

    m, n, k = 37, 45, 160
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE)
    norm_weight = torch.rand(k, dtype=torch.bfloat16, device=DEVICE) + 0.5 if norm else None
    q, scale = quantize_rows(torch.randn(2 * n if silu_mul else n, k, device=DEVICE))
    bias, residual = (None, None) if silu_mul else (torch.randn(n, dtype=torch.bfloat16, device=DEVICE),
                                                    torch.randn(m, n, dtype=torch.bfloat16, device=DEVICE))
    out = triton_ops.linear(x, q, bias, norm_weight=norm_weight, eps=1e-5, silu_mul=silu_mul, residual=residual,
                            weight_scale=scale)
    xq, x_scale = kernel(x, norm_weight, 1e-5)
    # the norm kernel's rows, quantized: the same scales as the norm in the quantizer
    assert torch.equal(x_scale.cpu(), quantize_rows(rms_norm(x, norm_weight, 1e-5) if norm else x)[1].cpu())
    y = (xq.double() @ q.double().t()) * x_scale.double()[:, None] * scale.double()[None, :]
    if silu_mul:  # rounded as the kernel (and the unfused model) rounds: gate and up, silu(gate)
        gate, up = y.bfloat16().double().chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate).bfloat16().double() * up
    else:
        y = y + bias.double() + residual.double()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    # (the interpreter rounds to bf16 by truncation, and SiLU-and-mul rounds three times; a scale missed or
    # applied twice is off by orders of magnitude)
    assert rel_err(out, y) < (3e-2 if silu_mul else 1e-2)


def test_reference_scales_activations_per_token():
    x, w = torch.randn(20, 64), torch.randn(30, 64)
    q, scale = quantize_rows(w)
    xq, x_scale = quantize_rows(x)
    expected = (xq.double() * x_scale.double()[:, None]) @ (q.double() * scale.double()[:, None]).t()
    out = reference.linear(x, q, weight_scale=scale)
    assert rel_err(out, expected) < 1e-6
    # What the two roundings cost, over the whole product: about 3.5% (at most 4.2% over 3,000 seeds). (The
    # largest row's error, the check before, passed 0.06 in 6% of draws.)
    exact = x.double() @ w.double().t()
    assert (out.double() - exact).norm() / exact.norm() < 0.05


def _logits(llm: LLM, prompts) -> torch.Tensor:
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, temperature=0),
                 use_tqdm=False)
    return llm.engine.runner.last_logits.clone()


PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 1, 42], list(range(20, 57)), [300]]


def test_a_checkpoint_quantizes_as_it_loads(tiny_checkpoints):
    path, _ = tiny_checkpoints["llama3-rope-scaling"]
    full = LLM(str(path), dtype="float32", device="cpu")
    fp8 = LLM(str(path), dtype="float32", device="cpu", quantization="fp8")
    dense, quantized = full.engine.runner.model.layers[1], fp8.engine.runner.model.layers[1]
    gain = dense.post_attention_layernorm.weight
    assert not torch.all(gain == 1)  # (or the fold below is not tested)
    # the norm's gain multiplied into gate/up's columns, then each row quantized by its own largest magnitude
    q, scale = quantize_rows(dense.mlp.gate_up_proj.weight * gain)
    assert quantized.mlp.gate_up_proj.weight.dtype == FP8 and torch.equal(
        quantized.mlp.gate_up_proj.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(quantized.mlp.gate_up_proj.weight_scale, scale)
    assert torch.all(quantized.post_attention_layernorm.weight == 1)
    q, _ = quantize_rows(dense.self_attn.qkv_proj.weight * dense.input_layernorm.weight)  # (its norm loads first)
    assert torch.equal(quantized.self_attn.qkv_proj.weight.view(torch.uint8), q.view(torch.uint8))
    model = fp8.engine.runner.model
    assert model.embed_tokens.weight.dtype == model.norm.weight.dtype == torch.float32  # not quantized
    assert 0 < rel_err(_logits(fp8, PROMPTS), _logits(full, PROMPTS)) < 0.1


def test_a_prequantized_checkpoint_loads_in_vllms_layout(tiny_checkpoints, tmp_path):
    """Weights in e4m3 with `weight_scale` per tensor (attention) or per output feature [N, 1] (MLP), static
    `input_scale`s (unused), config.json's quantization_config: the weights load as stored, each fused
    projection's scales expanded to its rows."""
    src, _ = tiny_checkpoints["llama3-rope-scaling"]
    shutil.copytree(src, tmp_path / "m")
    tensors = load_file(str(src / "model.safetensors"))
    dequantized = dict(tensors)
    for name, w in list(tensors.items()):
        if ".layers." not in name or not name.endswith("proj.weight"):
            continue
        if ".self_attn." in name:  # one scale for the tensor
            s = w.abs().amax() / FP8_MAX
            q = (w / s).to(FP8)
            tensors[name], tensors[name + "_scale"] = q, s.reshape(1)
            dequantized[name] = q.float() * s
        else:
            q, s = quantize_rows(w)
            tensors[name], tensors[name + "_scale"] = q, s[:, None]
            dequantized[name] = q.float() * s[:, None]
        tensors[name.replace(".weight", ".input_scale")] = torch.tensor([0.02])
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    shutil.copytree(src, tmp_path / "ref")
    save_file(dequantized, str(tmp_path / "ref" / "model.safetensors"))

    llm = LLM(str(tmp_path / "m"), device="cpu")  # FP8 because the checkpoint says so
    attn = llm.engine.runner.model.layers[0].self_attn
    k_name = "model.layers.0.self_attn.k_proj.weight"
    k_rows = attn.qkv_proj.weight[attn.q_size:attn.q_size + attn.kv_size]
    assert torch.equal(k_rows.view(torch.uint8), tensors[k_name].view(torch.uint8))
    k_scales = attn.qkv_proj.weight_scale[attn.q_size:attn.q_size + attn.kv_size]
    assert torch.equal(k_scales, tensors[k_name + "_scale"].expand(attn.kv_size))
    # against the same weights dequantized, in float32: only the activations' rounding differs
    ref = LLM(str(tmp_path / "ref"), device="cpu")
    assert 0 < rel_err(_logits(llm, PROMPTS), _logits(ref, PROMPTS)) < 0.1
    # the same tensors without the config's word for them: quantization="fp8" would fold norms into FP8 weights
    shutil.copytree(tmp_path / "m", tmp_path / "undeclared")
    (tmp_path / "undeclared" / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match="'layers.0.mlp.gate_proj.weight' is stored in FP8 but .*declares no"):
        LLM(str(tmp_path / "undeclared"), device="cpu", quantization="fp8")


def test_bad_quantization_settings_fail_before_loading(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints["llama3-rope-scaling"]
    with pytest.raises(ValueError, match="quantization must be one of fp8, gguf, got 'int4'"):
        LLM(str(path), device="cpu", quantization="int4")
    for qc, what in [({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
                     ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size")]:
        shutil.copytree(path, tmp_path / what[:5], dirs_exist_ok=True)
        cfg = json.loads((path / "config.json").read_text())
        (tmp_path / what[:5] / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
        with pytest.raises(ValueError, match=f"quantization_config .*{what}.* is not supported"):
            LLM(str(tmp_path / what[:5]), device="cpu")


def test_fp8_quality_on_real_text(smollm_llm, smollm_gguf):
    """SmolLM2 on CPython's documentation (pydoc_data.topics): perplexity over 2,048 tokens, float32 against FP8
    weights with FP8 activations (the GPU's prefill arithmetic; its decode keeps 16-bit activations)."""
    from pydoc_data.topics import topics

    ids = smollm_llm.tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics))[:30000])[:2048]
    fp8 = LLM(str(smollm_gguf), dtype="float32", device="cpu", quantization="fp8")
    dense_ppl, fp8_ppl = perplexity(smollm_llm, ids, 1024), perplexity(fp8, ids, 1024)
    print(f"perplexity float32 {dense_ppl:.3f}, fp8 {fp8_ppl:.3f} ({fp8_ppl / dense_ppl - 1:+.2%})")
    assert 1.0 < fp8_ppl / dense_ppl < 1.05


@pytest.mark.parametrize("norm", [False, True])
def test_activation_quantization_kernel(norm):
    """The Triton per-row quantizer (interpreter on CPU) against `quantize_rows`: the same scales, and values
    within one e4m3 step. The interpreter's float32 -> e4m3 conversion rounds otherwise than the GPU's instruction
    and fails where rounding carries into the next power of two (125.4 -> 64 instead of 128): those may differ
    here, and only that way. (On an H100 the scales are bitwise equal and the values not all: Triton's float32
    division is not IEEE-exact, docs/kernel-notes.md.)"""
    from flashpage.kernels.norm import rms_norm
    from flashpage.kernels.quantize import quantize_rows as kernel

    x = torch.randn(6, 3000, dtype=torch.bfloat16) * torch.logspace(-2, 2, 6, dtype=torch.bfloat16)[:, None]
    x[4] = 0
    x = x.to(DEVICE)
    norm_weight = torch.rand(3000, dtype=torch.bfloat16, device=DEVICE) + 0.5 if norm else None  # (in the kernel)
    q, scale = (t.cpu() for t in kernel(x, norm_weight, 1e-6))
    # with the norm: of the norm kernel's rows (which the interpreter rounds otherwise than PyTorch)
    q_ref, scale_ref = (t.cpu() for t in quantize_rows(rms_norm(x, norm_weight, 1e-6) if norm else x))
    assert torch.equal(scale, scale_ref)
    a, b = q.float(), q_ref.float()
    assert interpreter_e4m3_agrees(a, b).all() and (a == b).float().mean() > 0.8


def test_activation_quantization_kernel_with_silu_and_mul():
    """The quantizer taking SiLU-and-mul's place in front of down_proj (interpreter on CPU): the rows it quantizes
    are the SiLU-and-mul kernel's (the same roundings), so its scales equal that kernel's rows quantized."""
    from flashpage.kernels.activation import silu_and_mul
    from flashpage.kernels.quantize import quantize_rows as kernel

    # (rows up to 10 in scale: gates far below -40 give SiLU outputs that become float32 denormals once scaled,
    # which the interpreter converts to e4m3 wrongly, as 2**-7 instead of 0)
    x = torch.randn(5, 2 * 700, dtype=torch.bfloat16) * torch.logspace(-2, 1, 5, dtype=torch.bfloat16)[:, None]
    x[3] = 0
    x = x.to(DEVICE)
    q, scale = (t.cpu() for t in kernel(x, silu_mul=True))
    q_ref, scale_ref = (t.cpu() for t in quantize_rows(silu_and_mul(x)))
    assert q.shape == (5, 700) and torch.equal(scale, scale_ref)
    a, b = q.float(), q_ref.float()
    assert interpreter_e4m3_agrees(a, b).all() and (a == b).float().mean() > 0.8


def test_fp8_mlp_hands_quantized_rows_to_down_proj():
    """Past FP8_KERNEL_ROWS rows, gate/up with `quantized_output` returns its SiLU-and-mul already quantized per
    row (QuantizedRows) and down_proj's `linear` takes it: the MLP's output equals the unfused path's (gate/up's
    16-bit SiLU-and-mul, quantized by down_proj) to float32 rounding, and the float64 product of the same
    quantized operands to bf16 rounding. (Interpreter on CPU, odd sizes.)"""
    from flashpage.kernels import triton_ops
    from flashpage.kernels.fp8 import QuantizedRows

    m, inter, hidden = triton_ops.FP8_KERNEL_ROWS + 7, 80, 48  # (cuBLASLt multiplies multiples of 16)
    x = torch.randn(m, hidden, dtype=torch.bfloat16, device=DEVICE)
    norm_weight = torch.rand(hidden, dtype=torch.bfloat16, device=DEVICE) + 0.5
    gate_up, gate_up_scale = quantize_rows(torch.randn(2 * inter, hidden, device=DEVICE))
    down, down_scale = quantize_rows(torch.randn(hidden, inter, device=DEVICE))
    residual = torch.randn(m, hidden, dtype=torch.bfloat16, device=DEVICE)
    kw = dict(norm_weight=norm_weight, eps=1e-5, silu_mul=True, weight_scale=gate_up_scale)
    act = triton_ops.linear(x, gate_up, **kw, quantized_output=True)
    assert isinstance(act, QuantizedRows) and act.shape == (m, inter) and act.dtype == torch.bfloat16
    out = triton_ops.linear(act, down, residual=residual, weight_scale=down_scale)
    unfused = triton_ops.linear(triton_ops.linear(x, gate_up, **kw), down, residual=residual, weight_scale=down_scale)
    assert out.shape == (m, hidden) and out.dtype == torch.bfloat16
    assert rel_err(out, unfused) < 1e-2  # (an activation's e4m3 value may differ by a step where rounding ties)
    exact = (act.values.double() @ down.double().t()) * act.scales.double()[:, None] * down_scale.double() \
        + residual.double()
    assert rel_err(out, exact) < 1e-2


def interpreter_e4m3_agrees(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where the interpreter's e4m3 values `a` may stand for the reference's `b`: within one e4m3 step, or halved
    where the reference's rounding carried into the next power of two."""
    one_step = (a - b).abs() <= 2**-3 * torch.maximum(a.abs(), b.abs()) + 2**-9
    carried = (b.abs().log2() % 1 == 0) & (a * 2 == b)
    return one_step | carried
