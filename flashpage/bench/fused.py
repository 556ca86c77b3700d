"""`flashpage bench fused`: each fused Triton kernel against its PyTorch reference (the unfused ops), on a CUDA GPU.

Shapes of llama-3-8b in bf16 (hidden 4096, intermediate 14336, 32/8 heads of 128, vocab 128256) for a few token
counts. `linear` is the decode projection with its epilogue (Triton up to 16 rows, then cuBLAS between Triton
kernels) against cuBLAS between PyTorch ops; its bytes are the weight's. Both sides are timed as CUDA-graph
replays (median), so launch overhead counts only as it would in the engine's decode graphs. The unfused side is
the reference, except where the reference syncs with the host (so could not be captured): for the cache write
and for sampling it is the same math in capturable PyTorch.
Prints ms, the speed-up, and bytes moved as a fraction of the measured copy rate.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from flashpage.bench.common import copy_bandwidth_tbs, median_ms
from flashpage.kernels import reference as ref
from flashpage.kernels import triton_ops as tri
from flashpage.kv import KVCache

HIDDEN, INTER, HQ, HKV, D, VOCAB = 4096, 14336, 32, 8, 128, 128256


def cases(tokens: int):
    """(label, Triton kernel, unfused PyTorch, bytes moved, make_args); make_args() returns fresh arguments."""
    dev, bf = "cuda", torch.bfloat16
    rnd = lambda *s, dtype=bf: torch.randn(*s, device=dev).to(dtype)  # noqa: E731
    blocks = tokens // 16 + 8
    slots = torch.randperm(blocks * 16, device=dev)[:tokens]
    sample_rows = min(tokens, 512)  # (the engine's default max_num_seqs)
    yield ("rms_norm", tri.rms_norm, ref.rms_norm, 2 * tokens * HIDDEN * 2,
           lambda: (rnd(tokens, HIDDEN), rnd(HIDDEN), 1e-5))
    yield ("linear o_proj + residual", with_residual(tri.linear), with_residual(ref.linear), HIDDEN * HIDDEN * 2,
           lambda: (rnd(tokens, HIDDEN), rnd(HIDDEN, HIDDEN) / 64, rnd(tokens, HIDDEN)))
    yield ("linear gate_up + silu_and_mul", partial(tri.linear, silu_mul=True), partial(ref.linear, silu_mul=True),
           2 * INTER * HIDDEN * 2, lambda: (rnd(tokens, HIDDEN), rnd(2 * INTER, HIDDEN) / 64))
    yield ("silu_and_mul", tri.silu_and_mul, ref.silu_and_mul, 3 * tokens * INTER * 2, lambda: (rnd(tokens, 2 * INTER),))
    yield ("rope_and_cache", tri.rope_and_cache, torch_rope_and_cache, 2 * tokens * (HQ + 2 * HKV) * D * 2 + 2 * tokens * HKV * D * 2,
           lambda: (rnd(tokens, HQ, D), rnd(tokens, HKV, D), rnd(tokens, D), rnd(tokens, D), rnd(tokens, HKV, D),
                    KVCache(rnd(blocks, 16, HKV, D), rnd(blocks, 16, HKV, D)), slots))
    full = lambda v, dt: torch.full((sample_rows,), v, dtype=dt, device=dev)  # noqa: E731
    yield (f"sample x{sample_rows} (top-p 0.9, top-k 50)", tri.sample, torch_sample, sample_rows * VOCAB * 4,
           lambda: (rnd(sample_rows, VOCAB, dtype=torch.float32), full(0.8, torch.float32), full(50, torch.int32),
                    full(0.9, torch.float32), full(0.0, torch.float32), torch.arange(sample_rows, device=dev)))


def with_residual(linear):
    return lambda x, weight, residual: linear(x, weight, residual=residual)


def torch_rope_and_cache(q, k, cos, sin, v, kv_cache, slots):
    q, k = ref.rope_and_cache(q, k, cos, sin)
    kv_cache.k.view(-1, *kv_cache.k.shape[2:]).index_copy_(0, slots, k)
    kv_cache.v.view(-1, *kv_cache.v.shape[2:]).index_copy_(0, slots, v)
    return q, k


def torch_sample(logits, temperature, top_k, top_p, min_p, seeds):
    probs = ref.filter_probs(torch.softmax(logits / temperature[:, None], dim=-1), top_k, top_p, min_p)
    tokens = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
    return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]


def sweep_linear() -> None:
    """The decode linear's tiles (BLOCK_N, BLOCK_K, warps, stages) on llama-3-8b's projections, at 1 and 16 rows,
    against cuBLAS alone: the numbers behind `flashpage.kernels.linear._tiles` (docs/kernel-notes.md)."""
    import itertools

    from triton.runtime.errors import OutOfResources

    from flashpage.kernels.linear import skinny_linear

    shapes = {"qkv": (6144, HIDDEN), "o_proj": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}
    tiles = list(itertools.product([16, 32, 64], [128, 256, 512], [4], [3, 4]))
    for rows, (name, (n, k)) in itertools.product((1, 16), shapes.items()):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        cublas = median_ms(lambda: torch.nn.functional.linear(x, w))
        for silu in (False, True) if name == "gate_up" else (False,):
            timed = []
            for t in tiles:
                try:
                    timed.append((median_ms(lambda: skinny_linear(x, w, silu_mul=silu, tiles=t)), t))
                except OutOfResources:
                    pass  # a stage too large for shared memory
            timed.sort()
            label = name + (" + silu_and_mul" if silu else "")
            print(f"{label:<24} rows {rows:>2}: cuBLAS {cublas * 1e3:7.1f} us; best tiles "
                  + ", ".join(f"{t} {ms * 1e3:.1f} us" for ms, t in timed[:3]), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashpage bench fused", description=__doc__)
    p.add_argument("--tokens", default="1,64,256,4096")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--sweep-linear", action="store_true", help="time the decode linear's tile choices first")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.sweep_linear:
        sweep_linear()
    bw = copy_bandwidth_tbs()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.2f} TB/s")
    print(f"{'kernel':<36}{'tokens':>7}{'triton ms':>11}{'torch ms':>10}{'speed-up':>10}{'of copy':>9}")
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        for name, fused, unfused, nbytes, make in cases(tokens):
            a, b = make(), make()
            t_tri = median_ms(lambda: fused(*a))
            t_ref = median_ms(lambda: unfused(*b))
            frac = nbytes / (t_tri * 1e-3) / (bw * 1e12)
            rows.append(dict(kernel=name, tokens=tokens, triton_ms=t_tri, torch_ms=t_ref, of_copy=frac))
            print(f"{name:<36}{tokens:>7}{t_tri:>11.4f}{t_ref:>10.4f}{t_ref / t_tri:>9.2f}x{frac:>9.0%}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_tbs": bw, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
