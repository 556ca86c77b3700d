"""Linear layers at decode batch sizes (and at every size, batch-invariant): one kernel streams the weight and
fuses what follows the matmul.

A decode step multiplies a handful of rows by each weight matrix, so it is bound by reading the weights, and in a
CUDA graph every small kernel between two matmuls costs a few microseconds. This kernel takes in the neighbours
that come after each projection of a decoder layer, without adding work to the loop that streams the weight:
- SiLU-and-mul of the output of a fused [gate | up] projection: a program owns gate columns j and their up
  columns I + j, and writes silu(gate) * up, so the [M, 2I] intermediate never exists;
- bias, the residual add (one rounding, as torch.addmm), and the output dtype (float32 logits from the LM head);
- FP8 (e4m3) weights with one scale per output feature: a tile is converted to the activations' dtype in
  registers (by way of float32, which an H100 does faster than e4m3 -> bf16 directly) and the scales multiply the
  float32 sums, so the loop streams half the bytes of a 16-bit weight;
- FP8 activations too (`fp8_linear`, for FP8 layers past the decode rows, up to a couple of hundred rows): e4m3
  rows quantized beforehand with one scale each (`flashpage.kernels.quantize`, the RMSNorm in the same pass),
  multiplied by the e4m3 weight on the FP8 tensor cores, both scales applied to the float32 sums.
The RMSNorm before a projection stays a kernel of its own: each program would have to read the whole input rows
before its first product, and that costs more than the launch it saves (measured: docs/kernel-notes.md).
A program owns BLOCK_N output features of BLOCK_M rows and walks all of K (no split-K, no atomics). At decode
sizes the rows are padded to one tensor-core tile (16) and one program column covers them; larger batches are
compute-shaped and go to cuBLAS, FP8 ones first to `fp8_linear` (`flashpage.kernels.triton_ops.linear` chooses). `invariant_linear` runs the
kernel at every size: the deterministic mode's linear layers (cuBLAS picks its algorithm, and split-K, by the
shape, so a row's sums depend on how many rows came with it). With 16-bit inputs the tensor cores sum each output
over K in the same order for every tile shape, 16 at a time from k = 0, so the kernel may pick its tiles by the
number of rows: on an H100 nine shapes, from 16 x 32 x 256 (mma.sync) to 128 x 256 x 64 (wgmma), gave
bit-identical products (docs/kernel-notes.md), and `flashpage bench deterministic` checks the whole model.
Float32 products (FMA loops) and Triton's CPU interpreter sum a BLOCK_K at a time in an order of their own: there
one shape serves every size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels import pdl
from flashpage.kernels.activation import silu_mul
from flashpage.kernels.attention import exact_cast, tile_dot
from flashpage.kernels.device import interpreting
from flashpage.kernels.fp8 import FP8
from flashpage.kernels.pdl import prefetch_l2, release_next, wait_for_previous
from flashpage.kernels.quantize import quantize_rows

MAX_ROWS = 16  # the kernel's row tile (the smallest tensor-core tile)


@triton.jit
def _linear_kernel(
    X, XScale, W, WScale, Bias, Residual, Out,
    M, N, K, stride_xm, stride_wn, stride_rm, stride_om,
    SILU_MUL: tl.constexpr, FP8_WEIGHT: tl.constexpr, FP8_INPUT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    # Row tiles are the grid's first axis, so the programs that run together take all row tiles of the same output
    # features: a weight tile is read from memory once and from L2 by the rest.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N  # N counts output features: with SILU_MUL, the weight has 2N rows
    kk = tl.arange(0, BLOCK_K)
    x_rows = X + rows[:, None].to(tl.int64) * stride_xm
    w_rows = W + cols[:, None].to(tl.int64) * stride_wn
    if PREFETCH > 0:  # launched early: ask L2 for the weight's first columns while the kernel before runs
        bits: tl.constexpr = W.dtype.element_ty.primitive_bitwidth
        lines = tl.arange(0, PREFETCH * bits // 1024) * (1024 // bits)
        first = W + tl.minimum(cols, N - 1)[:, None].to(tl.int64) * stride_wn + lines[None, :]
        prefetch_l2(first)
        if SILU_MUL:
            prefetch_l2(first + N * stride_wn)
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = col_ok[:, None] & k_ok[None, :]
        acc += tile_dot(x, tl.trans(exact_cast(tl.load(w_rows + k[None, :], mask=w_ok, other=0.0), x.dtype)), UPCAST)
        if SILU_MUL:
            up = exact_cast(tl.load(w_rows + N * stride_wn + k[None, :], mask=w_ok, other=0.0), x.dtype)
            acc_up += tile_dot(x, tl.trans(up), UPCAST)
    release_next(PDL)
    if FP8_INPUT:  # e4m3 rows with one scale each (and e4m3 weights): FP8 tensor-core products
        x_scale = tl.load(XScale + rows, mask=row_ok, other=0.0)[:, None]
        acc *= x_scale
        acc_up *= x_scale
    if FP8_WEIGHT:
        acc *= tl.load(WScale + cols, mask=col_ok, other=0.0)[None, :]
        if SILU_MUL:
            acc_up *= tl.load(WScale + N + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(Bias + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:  # rounded like the unfused path: gate and up in the model dtype, then silu(gate), then the product
        acc = silu_mul(acc.to(Out.dtype.element_ty).to(tl.float32), acc_up.to(Out.dtype.element_ty).to(tl.float32),
                       Out.dtype.element_ty)
    out_ok = row_ok[:, None] & col_ok[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(Residual + rows[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=out_ok,
                       other=0.0).to(tl.float32)
    tl.store(Out + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(Out.dtype.element_ty), mask=out_ok)


def _tiles(silu_mul: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), from sweeps over llama-3-8b's projections on an H100
    (docs/kernel-notes.md). With silu_mul a stage holds two weight tiles."""
    return (32, 256, 4, 3) if silu_mul else (32, 512, 4, 4)


def skinny_linear(x, weight, bias=None, *, silu_mul=False, residual=None, out_dtype=None, weight_scale=None,
                  tiles=None, out=None):
    """x [M <= 16, K], weight [N, K] -> [M, N] (or [M, N / 2] with silu_mul); an FP8 weight comes with its
    `weight_scale` [N]. See the module docstring. `tiles` overrides (BLOCK_N, BLOCK_K, num_warps, num_stages);
    `out` (of out_dtype) receives the result, else a new tensor."""
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    return _linear(x, weight, bias, silu_mul, residual, out_dtype, weight_scale,
                   (MAX_ROWS, *(tiles or _tiles(silu_mul))), out=out)


def invariant_linear(x, weight, bias=None, *, silu_mul=False, residual=None, out_dtype=None, weight_scale=None,
                     out=None):
    """As skinny_linear, for any number of rows, each row's result independent of the others (module docstring)."""
    m = x.shape[0]
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the fastest of the sweep's shapes at each size on an H100
    if x.dtype == torch.float32 or interpreting():
        tiles = (64, 64, 64, 4, 3)
    elif m <= MAX_ROWS:
        tiles = (MAX_ROWS, *_tiles(silu_mul))
    else:
        tiles = (64, 64, 128, 4, 3) if m <= 128 else (128, 128, 64, 8, 3)
    return _linear(x, weight, bias, silu_mul, residual, out_dtype, weight_scale, tiles, out=out)


def fp8_linear(x, weight, weight_scale, bias=None, *, norm_weight=None, eps=0.0, silu_mul=False, residual=None,
               out_dtype=None, tiles=None, out=None):
    """x [M, K] (16-bit) @ (e4m3 weight [N, K] * weight_scale [N]).T on FP8 tensor cores: x (or rms_norm(x,
    norm_weight, eps)) quantized per row by `quantize_rows`, then this module's kernel with skinny_linear's
    epilogues. [M, N] (or [M, N / 2]) in x's dtype or `out_dtype`. `tiles` overrides (BLOCK_M, BLOCK_N, BLOCK_K,
    num_warps, num_stages)."""
    xq, x_scale = quantize_rows(x, norm_weight, eps)
    return _linear(xq, weight, bias, silu_mul, residual, out_dtype or x.dtype, weight_scale,
                   tiles or _fp8_tiles(x.shape[0], silu_mul), x_scale, out)


def _fp8_tiles(m: int, silu_mul: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for FP8 products of m rows: the fastest of a sweep over
    llama-3-8b's projections on an H100 (docs/kernel-notes.md)."""
    if interpreting():
        return (32, 32, 64, 4, 2)
    if silu_mul:
        return (64, 64, 128, 4, 4) if m <= 64 else (128, 128, 128, 8, 4)
    return (64, 64, 256, 4, 3) if m <= 128 else (64, 64, 128, 4, 4)


def _prefetch_columns(k: int, element_size: int) -> int:
    """Columns of its weight rows a program prefetches when launched early: 512 (an H200: 1% faster at batch 1
    than none, 2,048 slower), fewer for narrower rows, none under a 128-byte line."""
    columns = min(512, 1 << (k.bit_length() - 1))
    return columns if columns * element_size >= 128 else 0


def _linear(x, weight, bias, silu_mul, residual, out_dtype, weight_scale, tiles, x_scale=None, out=None):
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if weight.shape[1] != k or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"linear needs x [M, K] and weight [N, K] with unit inner strides, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != (out_dtype or x.dtype) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{m}, {n}] {out_dtype or x.dtype} with a unit inner stride, got "
                         f"{list(out.shape)} {out.dtype}")
    if residual is not None and residual.shape != out.shape:
        raise ValueError(f"residual must be {tuple(out.shape)}, got {tuple(residual.shape)}")
    if m == 0:
        return out
    block_m, block_n, block_k, warps, stages = tiles
    res = residual if residual is not None else out
    unused = weight  # stands in for the optional pointers the variant does not read
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    # early launches at decode sizes only: FP8 products of 64 and 128 rows (with their quantizers) measured 0.5-1%
    # slower with them on an H200
    launch_pdl = m <= MAX_ROWS and pdl.enabled(x.device)
    _linear_kernel[grid](
        x, unused if x_scale is None else x_scale, weight, unused if weight_scale is None else weight_scale,
        unused if bias is None else bias, res, out, m, n, k, x.stride(0), weight.stride(0), res.stride(0),
        out.stride(0), SILU_MUL=silu_mul, FP8_WEIGHT=weight_scale is not None, FP8_INPUT=x_scale is not None,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=x.dtype in (torch.bfloat16, FP8) and interpreting(),
        PDL=launch_pdl, PREFETCH=_prefetch_columns(k, weight.element_size()) if launch_pdl else 0,
        launch_pdl=launch_pdl, num_warps=warps, num_stages=stages)
    return out
