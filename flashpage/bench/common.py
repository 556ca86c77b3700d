"""Helpers shared by the benchmarks: CUDA-event medians after warm-up, the device's ceilings, engines over one
loaded model."""

from __future__ import annotations

import functools
import gc
import json
import math
import statistics
import time
from pathlib import Path

import torch

from flashpage.engine.config import EngineConfig
from flashpage.engine.llm_engine import LLMEngine
from flashpage.loader import LoadedModel
from flashpage.sampling_params import SamplingParams


def layer_matrix_params(config) -> int:
    """Parameters of the whole model's layer matrices (the projections), whatever share of it this process holds."""
    from flashpage.loader import checkpoint_shapes

    return sum(math.prod(shape) for name, shape in checkpoint_shapes(config).items()
               if ".layers." in name and len(shape) == 2)


def median_ms(fn, warmup_ms: int = 25, rep_ms: int = 200, graph: bool = True) -> float:
    """Median GPU time of fn() in ms: CUDA events around replays of a CUDA graph of fn, after warm-up, with L2
    emptied before each run. The graph keeps Python launch overhead out of a 50-microsecond kernel's time, as the
    engine's decode graphs will; fn is timed eagerly if it cannot be captured or graph=False.

    L2 is emptied by *reading* a buffer four times its size. triton's do_bench zeroes one instead, which leaves L2
    full of dirty lines whose write-back then lands inside the timed kernel: on an H100 that added 9 us to a
    54-us attention decode (cuDNN's as much as ours), traffic that no real decode step has in front of it."""
    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    run = fn
    if graph:
        try:
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                fn()
            run = captured.replay
        except RuntimeError:
            torch.cuda.synchronize()
    flush = _l2_flush()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        run()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        flush()
        run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(min(max(5, int(rep_ms / estimate_ms)), 2000))]
    for begin, finish in events:
        flush()
        begin.record()
        run()
        finish.record()
    torch.cuda.synchronize()
    return statistics.median(begin.elapsed_time(finish) for begin, finish in events)


@functools.cache
def _l2_flush():
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    buffer = torch.ones(props.L2_cache_size, dtype=torch.int32, device="cuda")  # 4 bytes each: 4x L2
    return lambda: buffer.max()


def copy_bandwidth_tbs(gib: float = 2.0) -> float:
    """Device-to-device copy rate in TB/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), graph=False)  # captured, a copy becomes a slower DMA memcpy node
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e12


def matmul_tflops(n: int = 8192, fp8: bool = False) -> float:
    """bf16 (or e4m3, cuBLASLt's scaled product) n x n x n matrix product rate in TFLOP/s, on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if fp8:
        a, b, one = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t(), torch.ones((), device="cuda")
        ms = median_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), graph=False)
    else:
        ms = median_ms(lambda: a @ b, graph=False)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def engine_over(llm, **settings) -> LLMEngine:
    """Another engine over `llm`'s loaded model (no reload)."""
    loaded = LoadedModel(llm.config, llm.engine.runner.model, llm.tokenizer)
    cfg = EngineConfig(**{**{k: getattr(llm.engine.cfg, k) for k in ("device", "dtype", "max_model_len",
                                                                   "num_gpu_blocks")}, **settings})
    return LLMEngine(cfg, loaded)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    """Free what deleted engines held (engines freeze what start-up built, so a full collection must unfreeze)."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    sync()
    start = time.perf_counter()
    engine.add_request("r", prompt, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    return time.perf_counter() - start, out.outputs[0].token_ids


def write_json(path: Path | None, results: dict) -> None:
    """A benchmark's results as JSON at `path` (its --out), if given."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))
