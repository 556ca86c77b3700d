"""Benchmark the attention kernels against torch's SDPA backends and the device's measured ceilings.

    python -m flashpage.bench.kernels [--out DIR] [--sweep] [--kv-cache-dtype fp8|int8] [--fp8]
                                      [--sparse | --only-sparse]

Prefill: causal, head dim 128, 32 query / 8 KV heads, 16k tokens per launch split into sequences of S tokens;
and paged prefill, a chunk of queries at the end of a sequence in a paged cache (block size 16, shuffled blocks),
as the engine computes every prompt. flashpage's own rows are the kernel the engine dispatches to (on Hopper the
Gluon kernel, `flashpage.kernels.hopper_prefill`) and, beside it, the portable Triton kernel.
Decode: paged cache (block size 16, shuffled blocks; also timed with each sequence's blocks in order) for
B x context; SDPA reads a contiguous cache of the same size. Prints ms, TFLOP/s or TB/s, the ratio to the best
peer and the fraction of the measured ceiling; for decode also how long merely reading the same pages
takes (the copy engine fetching each page's tile for one KV head, as the decode does, with no attention).
Peers: torch SDPA's backends and, when importable, FlashInfer (`flashpage.bench.flashinfer_peer`: prefill with
its FA3 and FA2 backends, decode with tensor cores), its outputs compared with ours.
`--kv-cache-dtype` also times decode and paged prefill over an FP8 or INT8 cache (the engine's scales) against
the bf16 one, decode's rate counted on the bytes it reads; over FP8, FlashInfer's decode of the same e4m3 cache
is its peer, beside FlashInfer's own speedup over its bf16 decode. `--fp8` also times the FP8 varlen prefill (inputs
quantized per head) against the bf16 one, with its output's difference from the bf16 output and the e4m3 matmul
rate. `--sparse` also times
SparQ decode against the dense decode (`flashpage.bench.sparse`).
"""

from __future__ import annotations

import argparse
import json
import platform
import warnings
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashpage.bench import flashinfer_peer
from flashpage.bench.common import copy_bandwidth_tbs, matmul_tflops, median_ms
from flashpage.kernels import attention as attn
from flashpage.kernels import hopper_prefill
from flashpage.kernels.triton_ops import flash_attn_varlen, paged_attention
from flashpage.kernels import reference
from flashpage.kv import KV_CACHE_DTYPES, KVCache

HQ, HKV, D = 32, 8, 128
PREFILL_TOKENS = 16384
PREFILL_S = [1024, 2048, 4096, 8192, 16384]
# (queries, keys, sequences): a chunk at the end of each sequence; the last three are short prompts, as a batch of
# them reaches the paged prefill
PAGED_PREFILL = [(8192, 32768, 1), (8192, 8192, 1), (2048, 4096, 1), (1024, 1024, 16), (512, 512, 32), (512, 1024, 16)]
DECODE = [(1, 32768), (8, 8192), (64, 4096), (256, 1024)]
BLOCK = 16
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa_times(q, k, v, causal: bool) -> dict[str, float]:
    """q [B, Hq, S, D], k/v [B, Hkv, Sk, D]. GQA through enable_gqa, else K/V expanded (noted in the name); and the
    backend torch dispatches to by itself, as "default"."""
    times = {}
    for name, backend in SDPA_BACKENDS.items():
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1))
            fn = lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=gqa)  # noqa: E731
            try:
                with sdpa_kernel(backend), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # probing a backend that refuses a shape warns at length
                    fn()
                    torch.cuda.synchronize()
                    times[name if gqa else f"{name}(expanded kv)"] = median_ms(fn)
                break
            except RuntimeError:
                continue
    # what a plain call gets: torch picks the backend
    times["default"] = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
    return times


@triton.jit
def _read_pages(K, V, Pages, Out, PAGES: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr):
    """Fetch PAGES pages' [PAGE, D] tiles of one KV head from K and V (attention.cache_descriptor) and sum them,
    so that nothing is optimised away."""
    kv_head = tl.program_id(1)
    acc = tl.zeros([PAGE, D], tl.float32)
    for i in tl.range(0, PAGES, num_stages=3):
        row = tl.load(Pages + tl.program_id(0) * PAGES + i) * PAGE
        acc += K.load([row, kv_head * D]).to(tl.float32) + V.load([row, kv_head * D]).to(tl.float32)
    tl.store(Out + tl.program_id(0) * tl.num_programs(1) + kv_head, tl.sum(tl.sum(acc, 1), 0))


def page_read_ms(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor) -> float:
    """The fastest of a few grids reading every page in the table once: a floor for any decode of these pages."""
    page, hkv, dim = k_cache.shape[1:]
    pages = table.flatten()
    k, v = (attn.cache_descriptor(c, page) for c in (k_cache, v_cache))  # the decode's own view of the cache
    out = torch.empty(pages.numel() * hkv, device=pages.device)
    return min(median_ms(lambda n=n: _read_pages[(pages.numel() // n, hkv)](k, v, pages, out, PAGES=n, PAGE=page, D=dim,
                                                                            num_warps=2))
               for n in (16, 64, 256) if pages.numel() % n == 0)


def flashinfer_times(fns: dict, ours: torch.Tensor) -> tuple[dict[str, float], dict[str, float]]:
    """Time each FlashInfer call in `fns` (name -> a function that plans and returns the call); and how far its
    output lies from ours, ‖theirs - ours‖ / ‖ours‖. Empty when FlashInfer is not importable."""
    times, diffs = {}, {}
    if not flashinfer_peer.available():
        return times, diffs
    for name, plan in fns.items():
        try:
            run = plan()
            theirs = run()
        except Exception as e:  # noqa: BLE001 - a backend that refuses this GPU or shape is left out, and said so
            print(f"  {name}: not run ({type(e).__name__}: {str(e)[:120]})", flush=True)
            continue
        times[name] = median_ms(run)
        diffs[name] = ((theirs.float() - ours.float()).norm() / ours.float().norm()).item()
    return times, diffs


def peer_speedup(quantized: dict, bf16: dict) -> str:
    """FlashInfer's best decode over the quantized cache, and its speedup over its own bf16 decode of the row's
    shape (its answer to the same question), where it served both."""
    theirs = {n: ms for n, ms in quantized.get("peers_ms", {}).items() if n.startswith("flashinfer")}
    if not theirs or "flashinfer" not in bf16["peers_ms"]:
        return ""
    name, ms = min(theirs.items(), key=lambda kv: kv[1])
    quantized["flashinfer_speedup_vs_bf16"] = bf16["peers_ms"]["flashinfer"] / ms
    return f"   {name} {ms:.4f} ({bf16['peers_ms']['flashinfer']:.4f}): {quantized['flashinfer_speedup_vs_bf16']:.2f}x"


def causal_flops(q_len: int, k_len: int) -> float:
    """Q Kᵀ and P V of q_len queries at the end of k_len keys, each seeing the keys up to its own position."""
    pairs = q_len * (k_len - q_len) + q_len * (q_len + 1) / 2
    return 4 * HQ * D * pairs


def varlen_case(seq_len: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PREFILL_TOKENS tokens as sequences of seq_len: (sequences, q, k, v, cu_seqlens), random bf16."""
    q = torch.randn(PREFILL_TOKENS, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(PREFILL_TOKENS, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.arange(0, PREFILL_TOKENS + 1, seq_len, device="cuda", dtype=torch.int32)
    return PREFILL_TOKENS // seq_len, q, k, v, cu


def bench_prefill(seq_len: int, tiles=None) -> dict:
    batch, q, k, v, cu = varlen_case(seq_len)
    out = torch.empty_like(q)
    ours = median_ms(lambda: flash_attn_varlen(q, k, v, cu, cu, seq_len, seq_len, causal=True, tiles=tiles, out=out))
    portable = median_ms(lambda: flash_attn_varlen(q, k, v, cu, cu, seq_len, seq_len, causal=True,
                                                   tiles=tiles or attn._tiles(D, seq_len, HQ // HKV, False, 1)))
    to_bhsd = lambda x: x.view(batch, seq_len, -1, D).transpose(1, 2)  # noqa: E731
    peers = sdpa_times(to_bhsd(q), to_bhsd(k), to_bhsd(v), causal=True)
    fi, diffs = flashinfer_times({f"flashinfer-{b}": lambda b=b: flashinfer_peer.ragged_prefill(q, k, v, cu, b)
                                  for b in ("fa3", "fa2")}, out)
    flops = batch * causal_flops(seq_len, seq_len)
    return {"kind": "prefill", "shape": f"S={seq_len} (B={batch})", "ms": ours, "rate": flops / ours / 1e9,
            "unit": "TFLOP/s", "peers_ms": peers | fi, "portable_ms": portable, "peer_output_diff": diffs}


def bench_fp8_prefill(seq_len: int) -> dict:
    """The varlen prefill of `bench_prefill` with fp8=True (Hopper: `hopper_prefill.prefill_fp8`): the kernel alone on
    inputs already quantized, and with the quantization; its output's difference from the bf16 kernel's."""
    batch, q, k, v, cu = varlen_case(seq_len)
    out, out8 = torch.empty_like(q), torch.empty_like(q)
    bf16 = median_ms(lambda: flash_attn_varlen(q, k, v, cu, cu, seq_len, seq_len, causal=True, out=out))
    with_quantization = median_ms(lambda: flash_attn_varlen(q, k, v, cu, cu, seq_len, seq_len, causal=True, out=out8,
                                                            fp8=True))
    quantized = hopper_prefill.quantize_inputs(q, k, v, cu)
    kernel = median_ms(lambda: hopper_prefill.prefill_fp8(quantized, out8, cu, seq_len, seq_len, causal=True,
                                                          sm_scale_log2=attn._sm_scale_log2(None, D),
                                                          window_size=(-1, -1)))
    fi, _ = flashinfer_times({"flashinfer-fa3": lambda: flashinfer_peer.ragged_prefill(q, k, v, cu, "fa3")}, out)
    flops = batch * causal_flops(seq_len, seq_len)
    return {"kind": "fp8 prefill", "shape": f"S={seq_len} (B={batch})", "ms": kernel, "rate": flops / kernel / 1e9,
            "unit": "TFLOP/s", "ms_with_quantization": with_quantization, "bf16_ms": bf16, "peers_ms": fi,
            "diff_from_bf16": ((out8.float() - out.float()).norm() / out.float().norm()).item()}


def bench_paged_prefill(q_len: int, k_len: int, batch: int = 1, kv_cache_dtype: str = "auto") -> dict:
    """q_len queries at the end of each of `batch` k_len-token sequences in a paged cache, its blocks shuffled
    (an 8-bit cache's rows: no peers, compared with the bf16 cache's row of the same run)."""
    blocks = k_len // BLOCK
    k_cache = torch.randn(batch * blocks + 7, BLOCK, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(batch * blocks + 7, device="cuda")[:batch * blocks].to(torch.int32).view(batch, blocks)
    q = torch.randn(batch * q_len, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, batch * q_len + 1, q_len, device="cuda", dtype=torch.int32)
    lens = torch.full((batch, ), k_len, device="cuda", dtype=torch.int32)
    cache, out = quantized_cache(k_cache, v_cache, kv_cache_dtype), torch.empty_like(q)
    ours = median_ms(lambda: paged_attention(q, cache, table, cu, lens, q_len, out=out))
    portable = median_ms(lambda: paged_attention(q, cache, table, cu, lens, q_len,
                                                 tiles=attn._tiles(D, q_len, HQ // HKV, False, BLOCK)))
    flops = batch * causal_flops(q_len, k_len)
    shape = f"{q_len // 1024}k of {k_len // 1024}k" if q_len >= 1024 else f"{q_len} of {k_len}"
    r = {"kind": "paged prefill", "shape": shape + (f" x{batch}" if batch > 1 else ""), "ms": ours,
         "rate": flops / ours / 1e9, "unit": "TFLOP/s", "portable_ms": portable, "kv_cache_dtype": kv_cache_dtype}
    if kv_cache_dtype != "auto":
        return r
    fi, diffs = flashinfer_times({f"flashinfer-{b}": lambda b=b: flashinfer_peer.paged_prefill(
        q, k_cache, v_cache, table, cu, lens, b) for b in ("fa3", "fa2")}, out)
    return r | {"peers_ms": fi, "peer_output_diff": diffs}


def quantized_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_cache_dtype: str) -> KVCache:
    """A bf16 cache as the engine would store it with `kv_cache_dtype` (written by the reference writer)."""
    if kv_cache_dtype == "auto":
        return KVCache(k_cache, v_cache)
    blocks, page, hkv, dim = k_cache.shape
    dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    scales = [torch.ones(hkv, device="cuda") if dtype != torch.int8 else
              torch.empty(blocks, hkv, page, device="cuda") for _ in range(2)]
    cache = KVCache(torch.empty_like(k_cache, dtype=dtype), torch.empty_like(v_cache, dtype=dtype), *scales)
    reference.reshape_and_cache(k_cache.flatten(0, 1), v_cache.flatten(0, 1), cache,
                                torch.arange(blocks * page, device="cuda"))
    return cache


def per_layer_ms(q, table, cu, lens, splits, kv_cache_dtype: str, layers: int = 8) -> float:
    """ms per call of `layers` decodes over as many caches (a step's layers) replayed as one CUDA graph: each call
    launches while the one before it runs (PDL), as in a decode step, where no graph launch precedes each call."""
    shape = (table.numel(), BLOCK, HKV, D)
    caches = [quantized_cache(torch.randn(shape, device="cuda", dtype=torch.bfloat16),
                              torch.randn(shape, device="cuda", dtype=torch.bfloat16), kv_cache_dtype)
              for _ in range(layers)]
    out = torch.empty_like(q)

    def step():
        for cache in caches:
            paged_attention(q, cache, table, cu, lens, 1, num_splits=splits, out=out)
    return median_ms(step) / layers


def bench_decode(batch: int, context: int, tiles=None, num_splits=None, kv_cache_dtype: str = "auto") -> dict:
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    cache = quantized_cache(k_cache, v_cache, kv_cache_dtype)
    splits = num_splits or attn.choose_num_splits(batch, HKV, 1, context, q.device, cache.k.element_size())
    ours = median_ms(lambda: paged_attention(q, cache, table, cu, lens, 1, num_splits=splits, tiles=tiles))
    # the bytes a decode reads: K and V, and an INT8 cache's per-token scales
    nbytes = sum(x.numel() * x.element_size() for x in (cache.k, cache.v)) + \
        (2 * cache.k_scale.numel() * 4 if cache.scaled_per_token else 0)
    r = {"kind": "decode", "shape": f"{batch}x{context}", "kv_cache_dtype": kv_cache_dtype, "ms": ours,
         "rate": nbytes / ours / 1e9, "unit": "TB/s", "num_splits": splits}
    if tiles is not None or num_splits is not None:
        return r  # (a sweep times ours alone)
    r["ms_per_layer"] = per_layer_ms(q, table, cu, lens, splits, kv_cache_dtype)
    if kv_cache_dtype == "int8":  # compared with the bf16 row of the same run (FlashInfer reads no INT8 cache)
        return r
    out = paged_attention(q, cache, table, cu, lens, 1, num_splits=splits)
    if kv_cache_dtype == "fp8":  # compared with the bf16 row of the same run, and with FlashInfer over e4m3
        fi, diffs = flashinfer_times({f"flashinfer{name}": lambda tc=tc: flashinfer_peer.decode(
            q, cache.k, cache.v, table, lens, tensor_cores=tc) for name, tc in (("", True), ("-cuda-cores", False))},
            out)
        return r | {"peers_ms": fi, "peer_output_diff": diffs}
    # each sequence's blocks next to each other in memory, as a fresh cache hands out a prompt's: what scattering costs
    in_order = torch.arange(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    ours_in_order = median_ms(lambda: paged_attention(q, cache, in_order, cu, lens, 1, num_splits=splits, tiles=tiles))
    kc = torch.randn(batch, HKV, context, D, device="cuda", dtype=torch.bfloat16)
    peers = sdpa_times(q[:, :, None, :], kc, torch.randn_like(kc), causal=False)
    fi, diffs = flashinfer_times({"flashinfer": lambda: flashinfer_peer.decode(q, k_cache, v_cache, table, lens)}, out)
    return r | {"peers_ms": peers | fi, "peer_output_diff": diffs, "ms_blocks_in_order": ours_in_order,
                "ms_page_read": page_read_ms(k_cache, v_cache, table),
                "ms_page_read_in_order": page_read_ms(k_cache, v_cache, in_order)}


def sweep(kv_cache_dtype: str = "auto") -> None:
    """Time a few tile shapes for each regime, then split counts for 1x32k; prints each (the best is written into
    attention._tiles and attention.choose_num_splits). Paged decode reads through the copy engine, whose tiles are
    one page (16 keys) at most. With a quantized cache, its decode only, also over split counts."""
    copy_engine = [(16, 16, 1, 4), (16, 16, 1, 5), (16, 16, 1, 6), (16, 16, 2, 5)]
    decodes = [(256, 1024), (64, 4096), (8, 8192), (1, 32768)]
    if kv_cache_dtype != "auto":
        for batch, context in decodes:
            for cfg in copy_engine + [(16, 16, 1, 8), (16, 16, 2, 8)]:
                r = bench_decode(batch, context, cfg, kv_cache_dtype=kv_cache_dtype)
                print(f"sweep {kv_cache_dtype} decode {batch}x{context} tiles={cfg}: {r['ms']:.4f} ms "
                      f"{r['rate']:.2f} TB/s", flush=True)
            base = attn.choose_num_splits(batch, HKV, 1, context, torch.device("cuda"))
            for splits in sorted({base, 2 * base, 3 * base}):
                r = bench_decode(batch, context, num_splits=splits, kv_cache_dtype=kv_cache_dtype)
                print(f"sweep {kv_cache_dtype} decode {batch}x{context} splits={splits}: {r['ms']:.4f} ms "
                      f"{r['rate']:.2f} TB/s", flush=True)
        return
    for label, run, cfgs in [("prefill S=4096", lambda t: bench_prefill(4096, t), [(128, 64, 8, 3), (128, 32, 4, 3)])] + \
            [(f"decode {b}x{c}", lambda t, b=b, c=c: bench_decode(b, c, t), copy_engine) for b, c in decodes]:
        for cfg in cfgs:
            try:
                r = run(cfg)
                print(f"sweep {label:16s} tiles={cfg}: {r['ms']:.3f} ms {r['rate']:.2f} {r['unit']}", flush=True)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is just skipped
                print(f"sweep {label:16s} tiles={cfg}: failed ({type(e).__name__})", flush=True)
    for splits in (32, 64, 66, 128, 132):  # 66 x 8 KV heads = 4 programs on each of an H100's 132 SMs
        r = bench_decode(1, 32768, num_splits=splits)
        print(f"sweep decode 1x32768   splits={splits}: {r['ms']:.4f} ms {r['rate']:.2f} TB/s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashpage bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results", help="directory for kernels.json and kernels.png")
    parser.add_argument("--sweep", action="store_true", help="also time alternative tile shapes")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"],
                        help="also time decode over a quantized cache, against the bf16 one (ratios)")
    parser.add_argument("--sparse", action="store_true", help="also time SparQ decode and block-sparse prefill "
                        "against dense (flashpage.bench.sparse)")
    parser.add_argument("--only-sparse", action="store_true", help="time the sparse kernels and nothing else")
    parser.add_argument("--fp8", action="store_true", help="also time the FP8 (e4m3) varlen prefill (Hopper) "
                        "against the bf16 one, with its difference from it")
    parser.add_argument("--no-sparq", action="store_true", help="with --sparse: block-sparse prefill only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("flashpage bench kernels needs a CUDA GPU")
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    bw, mm = copy_bandwidth_tbs(), matmul_tflops()
    print(f"{gpu}: copy {bw:.2f} TB/s (read+write), bf16 matmul {mm:.0f} TFLOP/s", flush=True)
    if args.sweep:
        sweep(args.kv_cache_dtype)
    rows = [] if args.only_sparse else ([bench_prefill(s) for s in PREFILL_S] +
                                        [bench_paged_prefill(*shape) for shape in PAGED_PREFILL] +
                                        [bench_decode(b, c) for b, c in DECODE])
    print(f"\n{'kernel':13s} {'shape':14s} {'ms':>8s} {'rate':>14s} {'of ceiling':>10s} {'best peer':>22s} {'speedup':>8s}")
    for r in rows:
        ceiling = bw if r["kind"] == "decode" else mm
        best_name, best_ms = min(r["peers_ms"].items(), key=lambda kv: kv[1]) if r["peers_ms"] else ("none", float("nan"))
        r["fraction_of_ceiling"] = r["rate"] / ceiling
        r["best_peer"] = best_name
        r["speedup_vs_best_peer"] = best_ms / r["ms"]
        print(f"{r['kind']:13s} {r['shape']:14s} {r['ms']:8.3f} {r['rate']:8.2f} {r['unit']:7s} {r['fraction_of_ceiling']:9.0%}"
              f" {best_name:>13s} {best_ms:7.3f} {r['speedup_vs_best_peer']:7.2f}x")
    names = ["cudnn", "flashinfer-fa3", "flashinfer-fa2"]
    print(f"\n{'prefill':13s} {'shape':14s} {'TFLOP/s':>8s}   peer ms / flashpage ms (above 1: flashpage is faster)")
    print(f"{'':13s} {'':14s} {'':8s} {'portable':>10s}" + "".join(f"{n:>16s}" for n in names))
    for r in (r for r in rows if r["kind"] != "decode"):
        ratios = "".join(f"{r['peers_ms'][n] / r['ms']:15.2f}x" if n in r["peers_ms"] else f"{'-':>16s}" for n in names)
        print(f"{r['kind']:13s} {r['shape']:14s} {r['rate']:8.0f} {r['portable_ms'] / r['ms']:9.2f}x{ratios}")
    for r in (r for r in rows if r.get("peer_output_diff")):
        print(f"{r['kind']} {r['shape']}: " + ", ".join(f"{n} output differs from ours by {d:.1e} (relative)"
                                                      for n, d in r["peer_output_diff"].items()))
    print(f"\n{'decode':14s} {'blocks':9s} {'read pages':>10s} {'flashpage':>10s} {'of read':>8s} {'best peer':>10s}"
          f" {'vs flashpage':>12s}")
    for r in (r for r in rows if r["kind"] == "decode"):
        best_ms = min(r["peers_ms"].values())
        for blocks, read, ours in (("shuffled", r["ms_page_read"], r["ms"]),
                                   ("in order", r["ms_page_read_in_order"], r["ms_blocks_in_order"])):
            print(f"{r['shape']:14s} {blocks:9s} {read:10.4f} {ours:10.4f} {read / ours:8.1%} {best_ms:10.4f}"
                  f" {best_ms / ours:11.2f}x")
    if args.kv_cache_dtype != "auto":
        print(f"\n{'decode':14s} {args.kv_cache_dtype + ' ms':>10s} {'bf16 ms':>9s} {'speedup':>8s} {'TB/s read':>10s}"
              f" {'of copy':>8s}   in a chain of 8 layers: {args.kv_cache_dtype + ' ms':>8s} {'bf16 ms':>8s} "
              f"{'speedup':>8s} {'of copy':>8s}" +
              ("   FlashInfer over e4m3 ms (its bf16 ms): its speedup" if args.kv_cache_dtype == "fp8" else ""))
        for bf16 in [r for r in rows if r["kind"] == "decode"]:
            b, c = map(int, bf16["shape"].split("x"))
            r = bench_decode(b, c, kv_cache_dtype=args.kv_cache_dtype)
            r["speedup_vs_bf16"], r["fraction_of_ceiling"] = bf16["ms"] / r["ms"], r["rate"] / bw
            rows.append(r)
            layer_rate = r["rate"] * r["ms"] / r["ms_per_layer"]
            print(f"{r['shape']:14s} {r['ms']:10.4f} {bf16['ms']:9.4f} {r['speedup_vs_bf16']:7.2f}x {r['rate']:10.2f}"
                  f" {r['fraction_of_ceiling']:8.0%}   {'':23s} {r['ms_per_layer']:8.4f} {bf16['ms_per_layer']:8.4f} "
                  f"{bf16['ms_per_layer'] / r['ms_per_layer']:7.2f}x {layer_rate / bw:8.0%}" + peer_speedup(r, bf16))
        print(f"\n{'paged prefill':14s} {args.kv_cache_dtype + ' ms':>10s} {'bf16 ms':>9s} {'vs bf16':>8s}"
              f" {'TFLOP/s':>8s} {'portable ms':>12s}")
        for bf16, shape in zip([r for r in rows if r["kind"] == "paged prefill"], PAGED_PREFILL):
            r = bench_paged_prefill(*shape, kv_cache_dtype=args.kv_cache_dtype)
            r["speedup_vs_bf16"] = bf16["ms"] / r["ms"]
            rows.append(r)
            print(f"{r['shape']:14s} {r['ms']:10.4f} {bf16['ms']:9.4f} {r['speedup_vs_bf16']:7.2f}x {r['rate']:8.0f}"
                  f" {r['portable_ms']:12.4f}")
    if args.fp8 and not args.only_sparse:
        mm8 = matmul_tflops(fp8=True)
        print(f"\n{'fp8 prefill':16s} {'ms':>7s} {'TFLOP/s':>8s} {'of e4m3 matmul':>14s} {'+quantize ms':>12s}"
              f" {'bf16 ms':>8s} {'vs bf16':>8s} {'vs FA3 bf16':>11s} {'diff from bf16':>14s}  (e4m3 matmul "
              f"{mm8:.0f} TFLOP/s)")
        for s in PREFILL_S:
            r = bench_fp8_prefill(s)
            r["fraction_of_ceiling"] = r["rate"] / mm8
            rows.append(r)
            fa3 = r["peers_ms"].get("flashinfer-fa3", float("nan"))
            print(f"{r['shape']:16s} {r['ms']:7.3f} {r['rate']:8.0f} {r['fraction_of_ceiling']:14.0%} "
                  f"{r['ms_with_quantization']:12.3f} {r['bf16_ms']:8.3f} {r['bf16_ms'] / r['ms']:7.2f}x"
                  f" {fa3 / r['ms']:10.2f}x {r['diff_from_bf16']:14.1e}")
    if args.sparse or args.only_sparse:
        from flashpage.bench import sparse

        rows += sparse.run(bw, mm, sparq_decode=not args.no_sparq)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"date": date.today().isoformat(), "gpu": gpu, "torch": torch.__version__, "host": platform.node(),
              "copy_tbs": bw, "matmul_tflops": mm, "rows": rows}
    (out / "kernels.json").write_text(json.dumps(result, indent=2))
    if not args.only_sparse:
        plot(rows, gpu, out / "kernels.png")
    print(f"\nwrote {out / 'kernels.json'} and {out / 'kernels.png'}")
    return 0


def plot(rows: list[dict], gpu: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind in zip(axes, ("prefill", "decode")):
        sel = [r for r in rows if r["kind"].endswith(kind) and r.get("kv_cache_dtype", "auto") == "auto"
               and r["kind"] != "fp8 prefill"]
        names = ["flashpage"] + sorted({n for r in sel for n in r["peers_ms"]})
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ms = [r["ms"] if name == "flashpage" else r["peers_ms"].get(name, float("nan")) for r in sel]
            ax.bar([x + i * width for x in range(len(sel))], ms, width, label=name)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(sel))], [r["shape"] for r in sel], rotation=20)
        ax.set_ylabel("ms (lower is better)")
        ax.set_title(f"{kind} attention, bf16, {HQ}/{HKV} heads, d={D}")
        ax.legend(fontsize=8)
    fig.suptitle(gpu)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
