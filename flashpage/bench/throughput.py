"""`flashpage bench throughput`: offline throughput on a CUDA GPU against transformers' `generate` in the same run.

`--num-prompts` requests of `--input-len` random prompt tokens, each generating exactly `--output-len` tokens
(EOS ignored), all handed to `LLM.generate` at once, on random ("dummy") weights of a real shape (llama-3-8b
bf16 by default). The peer is transformers' `generate` (eager, SDPA, greedy) on the same weights, at each of
`--hf-batch-sizes` (one batch each); its best rate is the one compared. The ceiling is the compute floor: the
run's matrix-product FLOPs (every token through every projection, the LM head for each sampled token; attention
left out, so the floor is low) over the bf16 matmul rate measured in the same run (times N GPUs with
`--tensor-parallel-size N`, where transformers, which holds the whole model on one GPU, is left out). Prints a
table; `--out` writes JSON. The workload is timed `--repeat` times after a warm-up of the same shape, and the
median run is the one reported (single runs varied by up to 20% before the engine's host work was cut,
docs/kernel-notes.md). Every run draws its own prompts, so none finds another's in the prefix cache (the
prefix-cache hits of the timed runs are reported, and are 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from flashpage.bench.common import layer_matrix_params, matmul_tflops
from flashpage.engine.config import EngineConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashpage bench throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", help="a preset for dummy weights (or a model path)")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs, help="the engine setting")
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                   help="the engine setting")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 weights (the engine setting); the "
                   "compute floor stays the bf16 one")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"], help="the engine setting")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of the whole workload; the median is reported")
    p.add_argument("--hf-batch-sizes", default="32,128,256", help="comma list; empty to skip transformers")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    from flashpage import LLM, SamplingParams

    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=args.input_len + args.output_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    gen = torch.Generator().manual_seed(0)
    # One set of prompts per run: a run given another's prompts would find them in the prefix cache and skip their
    # prefill (random tokens from a large vocabulary share no first block by chance).
    prompt_sets = torch.randint(llm.config.vocab_size, (max(args.repeat, 1) + 1, args.num_prompts, args.input_len),
                                generator=gen)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    # Warm-up on a workload of the same shape: a fresh engine's first run of it is slower than later ones (3 s of a
    # 5 s run of 256 requests after a warm-up of 8; not Triton's compiler, docs/cpu.md).
    warm = min(args.num_prompts, 2 * args.max_num_seqs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": r} for r in prompt_sets[0, :warm].tolist()], params, use_tqdm=False)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    hits_before = llm.stats()["prefix_cache_hits"]
    runs = []
    for prompts in prompt_sets[1:]:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r} for r in prompts.tolist()], params)
        runs.append(time.perf_counter() - start)
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        assert generated == args.num_prompts * args.output_len
        del outs
    elapsed = statistics.median(runs)
    r = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "model": args.model,
         "dtype": args.dtype, "num_prompts": args.num_prompts, "input_len": args.input_len,
         "output_len": args.output_len, "flashpage_s": elapsed, "flashpage_runs_s": runs,
         "flashpage_output_tok_s": generated / elapsed,
         "flashpage_total_tok_s": (generated + prompts.numel()) / elapsed, "stats": llm.stats(), "transformers": {},
         "tensor_parallel_size": args.tensor_parallel_size, "quantization": args.quantization,
         "kv_cache_dtype": args.kv_cache_dtype,
         "warmup_prompts": warm, "warmup_s": warmup_s,
         "prefix_cache_hits_timed": llm.stats()["prefix_cache_hits"] - hits_before}
    r["matmul_tflops"] = matmul_tflops()
    r["compute_floor_s"] = matmul_flops(llm.config, prompts.numel() + generated, generated) / (
        args.tensor_parallel_size * r["matmul_tflops"] * 1e12)

    whole_16_bit = args.tensor_parallel_size == 1 and not args.quantization  # what transformers can be given
    sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b] if whole_16_bit else []
    if sizes:
        from flashpage.bench.peers import to_transformers

        hf = to_transformers(llm.engine.runner.model)
        del llm.engine.runner.kv_caches  # give transformers the memory (the flashpage engine is done)
        torch.cuda.empty_cache()
        for bs in sizes:
            batch = prompts[:bs].cuda()
            try:
                torch.cuda.synchronize()
                t = time.perf_counter()
                with torch.inference_mode():
                    hf.generate(batch, max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False)
                torch.cuda.synchronize()
                r["transformers"][bs] = bs * args.output_len / (time.perf_counter() - t)
            except torch.OutOfMemoryError:
                r["transformers"][bs] = None
            torch.cuda.empty_cache()
    report(r)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=2))
    return 0


def matmul_flops(config, tokens: int, sampled: int) -> float:
    """2 FLOPs per weight per token for the decoder's projections, and for the LM head per sampled token."""
    head = config.vocab_size * config.hidden_size
    body = layer_matrix_params(config)
    return 2.0 * (body * tokens + head * sampled)


def report(r: dict) -> None:
    print(f"{r['gpu']}, {r['date']}: {r['model']} {r['dtype']}, {r['num_prompts']} requests x ({r['input_len']} in, "
          f"{r['output_len']} out)")
    ours = r["flashpage_output_tok_s"]
    if "warmup_s" in r:
        print(f"warm-up ({r['warmup_prompts']} other requests, first-use costs included): {r['warmup_s']:.1f} s")
    if "prefix_cache_hits_timed" in r:
        print(f"prefix-cache hits in the timed runs: {r['prefix_cache_hits_timed']} blocks")
    runs = r.get("flashpage_runs_s", [r["flashpage_s"]])
    spread = f" (median of {len(runs)} runs: {', '.join(f'{t:.1f}' for t in runs)} s)" if len(runs) > 1 else ""
    print(f"flashpage: {r['flashpage_s']:.1f} s, {ours:,.0f} output tok/s, {r['flashpage_total_tok_s']:,.0f} total "
          f"tok/s{spread}")
    floor = r["compute_floor_s"]
    gpus = f" x {r['tensor_parallel_size']} GPUs" if r.get("tensor_parallel_size", 1) > 1 else ""
    print(f"compute floor (matmul FLOPs at the measured {r['matmul_tflops']:.0f} TFLOP/s{gpus}): {floor:.1f} s, at most "
          f"{ours * r['flashpage_s'] / floor:,.0f} output tok/s; flashpage reaches {floor / r['flashpage_s']:.0%} of it")
    for bs, rate in r["transformers"].items():
        shown = "out of memory" if rate is None else f"{rate:,.0f} output tok/s -> flashpage is {ours / rate:.1f}x"
        print(f"transformers generate, batch {bs}: {shown}")
    best = max((v for v in r["transformers"].values() if v), default=None)
    if best:
        print(f"flashpage / best transformers batch: {ours / best:.1f}x (the compute floor allows at most "
              f"{ours * r['flashpage_s'] / floor / best:.1f}x)")


if __name__ == "__main__":
    raise SystemExit(main())
