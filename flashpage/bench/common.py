"""Timing helpers shared by the benchmarks: CUDA-event medians after warm-up, and the device's ceilings."""

from __future__ import annotations

import torch


def median_ms(fn, warmup_ms: int = 25, rep_ms: int = 200, graph: bool = True) -> float:
    """Median GPU time of fn() in ms: CUDA events around replays of a CUDA graph of fn (triton's do_bench,
    L2 flushed between runs). The graph keeps Python launch overhead out of a 50-microsecond kernel's time,
    as the engine's decode graphs will; fn is timed eagerly if it cannot be captured or graph=False."""
    from triton.testing import do_bench

    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    if not graph:
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except RuntimeError:
        torch.cuda.synchronize()
        run = fn
    return float(do_bench(run, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def copy_bandwidth_tbs(gib: float = 2.0) -> float:
    """Device-to-device copy rate in TB/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), graph=False)  # captured, a copy becomes a slower DMA memcpy node
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e12


def matmul_tflops(n: int = 8192) -> float:
    """bf16 n x n x n matrix product rate in TFLOP/s, on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, graph=False)
    return 2 * n**3 / (ms * 1e-3) / 1e12
