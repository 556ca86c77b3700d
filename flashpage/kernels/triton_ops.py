"""The Triton kernels under the names the model and sampler call (same signatures as `reference`). Greedy rows are
torch's argmax and logsumexp, which spread a row over many blocks: the sampling kernel gives a row one program,
which only pays when there is something to draw (docs/kernel-notes.md)."""

import functools

import torch

from flashpage.kernels.activation import silu_and_mul
from flashpage.kernels.attention import flash_attn_varlen, paged_attention
from flashpage.kernels.block_mass import block_mass
from flashpage.kernels.cache import reshape_and_cache
from flashpage.kernels.fp8 import FP8, QuantizedRows
from flashpage.kernels.linear import MAX_ROWS, fp8_linear, skinny_linear
from flashpage.kernels.norm import rms_norm
from flashpage.kernels.quantize import quantize_rows
from flashpage.kernels.reference import composed_linear
from flashpage.kernels.rotary import rope_and_cache
from flashpage.kernels.sampling import apply_penalties, apply_token_bitmask, greedy, sample
from flashpage.kernels.sparq import sparq_attention, write_sparq_copies
from flashpage.kernels.topk import top_k_positions

__all__ = ["apply_penalties", "apply_token_bitmask", "block_mass", "flash_attn_varlen", "greedy", "linear",
           "paged_attention", "reshape_and_cache", "rms_norm", "rope_and_cache", "sample", "silu_and_mul",
           "sparq_attention", "top_k_positions", "write_sparq_copies"]

# Up to this many rows the Triton kernel with its epilogues is faster than cuBLASLt's FP8 matmul between separate
# kernels (an H100, llama-3-8b's projections: faster at 197 rows, slower at 256; docs/kernel-notes.md).
FP8_KERNEL_ROWS = 200


def linear(x, weight, bias=None, *, norm_weight=None, eps=0.0, silu_mul=False, residual=None, out_dtype=None,
           weight_scale=None, out=None, quantized_output=False):
    """Up to 16 rows of 16-bit data (decode): the norm kernel, then one kernel that streams the weight (FP8 ones
    dequantized in registers) with the rest fused. FP8 weights at more rows: the activations quantized per token
    (the norm in the same kernel), then up to FP8_KERNEL_ROWS rows the Triton kernel with the rest fused, beyond
    that cuBLASLt's scaled matmul between the activation kernels; there, with `silu_mul` and `quantized_output`
    (the next projection is FP8 too), the SiLU-and-mul runs in the next projection's quantizer and the result
    comes as QuantizedRows, which `linear` takes as x. Otherwise cuBLAS between the Triton norm and activation
    kernels; float32 too, whose tensor-core products would round to tf32."""
    if isinstance(x, QuantizedRows):
        return composed_linear(rms_norm, silu_and_mul, x, weight, bias, None, 0.0, silu_mul, residual, out_dtype,
                               weight_scale, out=out)
    if x.shape[0] <= MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16):
        if norm_weight is not None:
            x = rms_norm(x, norm_weight, eps)
        return skinny_linear(x, weight, bias, silu_mul=silu_mul, residual=residual, out_dtype=out_dtype,
                             weight_scale=weight_scale, out=out)
    if weight.dtype == FP8 and x.dtype == torch.bfloat16:
        if x.shape[0] <= FP8_KERNEL_ROWS:
            return fp8_linear(x, weight, weight_scale, bias, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul,
                              residual=residual, out_dtype=out_dtype, out=out)
        quantize = functools.partial(quantize_rows, norm_weight=norm_weight, eps=eps)
        if silu_mul and quantized_output and out_dtype in (None, x.dtype) and out is None:
            gate_up = composed_linear(rms_norm, silu_and_mul, x, weight, bias, None, 0.0, False, residual, None,
                                      weight_scale, quantize)
            return QuantizedRows(*quantize_rows(gate_up, silu_mul=True), x.dtype)
        return composed_linear(rms_norm, silu_and_mul, x, weight, bias, None, 0.0, silu_mul, residual, out_dtype,
                               weight_scale, quantize, out=out)
    return composed_linear(rms_norm, silu_and_mul, x, weight, bias, norm_weight, eps, silu_mul, residual, out_dtype,
                           weight_scale, quantize_rows, out=out)
