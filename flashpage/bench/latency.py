"""`flashpage bench latency`: single-batch decode latency on a CUDA GPU, with its peers measured in the same run.

On random ("dummy") weights of a real shape (llama-3-8b bf16 by default), in one process:
1. engine start to first token (load, KV cache, CUDA graph capture, one request);
   and the first-token time of the timed prompts beside its floor: their prefill's FLOP over the measured bf16
   matmul rate (e.g. `--model llama-3.1-8b --input-len 32768 --output-len 2 --skip gpt-fast,transformers,check`);
2. the device's copy bandwidth, hence the weight-streaming floor: weight bytes / copy rate per decode step, and
   the time of the step's matrix products alone (cuBLAS, one CUDA graph): what the rest of the step adds;
3. flashpage: per-token decode time of `--batch-size` prompts of `--input-len` random tokens;
4. a gpt-fast-style compiled PyTorch loop (static cache, torch.compile reduce-overhead) on the same weights;
5. transformers' `generate` (eager, SDPA) on the same weights;
6. greedy agreement: the first 16 tokens of a few prompts against transformers, with where they first diverge
   and the reference's logit margin there.
Prints a table and writes JSON with `--out`. With `--tensor-parallel-size N` the model is split over N GPUs and
the floor is the weights over N copy engines; the peers, which hold the whole model on one GPU, are left out. With
`--quantization fp8` the floor counts the FP8 weights' bytes, and the peers (16-bit systems) are left out too;
with `--sparse-attention` (the engine setting, JSON) the peers, which attend densely, are left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from flashpage.bench.common import copy_bandwidth_tbs, layer_matrix_params, matmul_tflops, median_ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashpage bench latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", help="a preset for dummy weights (or a model path)")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each system (median reported)")
    p.add_argument("--speculative-config", type=json.loads, default=None,
                   help="flashpage speculates (JSON, as the engine setting); acceptance is reported")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 weights (the engine setting)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"], help="the engine setting")
    p.add_argument("--sparse-attention", type=json.loads, default=None,
                   help='the engine setting, JSON: \'{"method": "sparq", "r": 32, "k": 8192}\'')
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV-cache block, the engine setting (default: the engine's, 16; 64 with SparQ)")
    p.add_argument("--skip", default="", help="comma list of peers to leave out: gpt-fast, transformers, check")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    skip = set(filter(None, args.skip.split(",")))
    tp = args.tensor_parallel_size
    if tp > 1 or args.quantization or args.sparse_attention:
        skip |= {"gpt-fast", "transformers", "check"}
    from flashpage import LLM, SamplingParams

    results = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "model": args.model,
               "dtype": args.dtype, "batch_size": args.batch_size, "input_len": args.input_len,
               "output_len": args.output_len, "tensor_parallel_size": tp, "quantization": args.quantization,
               "kv_cache_dtype": args.kv_cache_dtype, "sparse_attention": args.sparse_attention}
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=args.input_len + args.output_len + 16,
              speculative_config=args.speculative_config, tensor_parallel_size=tp, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, sparse_attention=args.sparse_attention, block_size=args.block_size,
              # (SparQ's scratch grows with batch x context: graphs for the batch sizes this run uses only)
              **({"max_num_seqs": max(args.batch_size, 8)} if args.sparse_attention else {}))
    vocab = llm.config.vocab_size
    results["block_size"] = llm.engine.cfg.block_size
    first = llm.generate([torch.randint(vocab, (args.input_len,), generator=gen).tolist()],
                         SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    results["start_to_first_token_s"] = time.perf_counter() - t0
    assert len(first[0].outputs[0].token_ids) == 1
    model = llm.engine.runner.model  # (rank 0's shard; the ranks' shards are the same size)
    weight_bytes = tp * sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth_tbs()
    results.update(weight_bytes=weight_bytes, copy_tbs=bw, floor_ms=weight_bytes / (tp * bw * 1e12) * 1e3)
    if tp == 1 and not args.quantization:
        results["matmuls_only_ms"] = matmuls_ms(model, args.batch_size)

    prompts = torch.randint(vocab, (args.batch_size, args.input_len), generator=gen)

    def timed_generate(max_tokens, batch=prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r} for r in batch.tolist()], params, use_tqdm=False)
        return time.perf_counter() - start, outs

    timed_generate(args.output_len)  # warm-up
    # per token: a run of output_len tokens less a run of one, both over the same (by now cached) prompts
    prefill_s = statistics.median(timed_generate(1)[0] for _ in range(args.repeats))
    total_s = statistics.median(timed_generate(args.output_len)[0] for _ in range(args.repeats))
    results["flashpage_ms_per_token"] = (total_s - prefill_s) / (args.output_len - 1) * 1e3
    if total_s <= prefill_s:  # (seen with --repeats 2 at a 130k-token prompt: one slow run is half the median)
        print(f"warning: the {args.output_len}-token runs took no longer than the one-token runs ({total_s:.3f} s "
              f"against {prefill_s:.3f}): ms/token is unusable; rerun with more --repeats", flush=True)
        results["flashpage_ms_per_token"] = float("nan")
    # first token: prompts no earlier run has seen (a repeated prompt is a prefix-cache hit)
    results["flashpage_ttft_ms"] = 1e3 * statistics.median(
        timed_generate(1, torch.randint(vocab, prompts.shape, generator=gen))[0] for _ in range(args.repeats))
    results["prefill_tflop"] = prefill_flops(llm.config, args.batch_size, args.input_len) / 1e12
    results["matmul_tflops"] = matmul_tflops()
    results["prefill_floor_ms"] = results["prefill_tflop"] / results["matmul_tflops"] * 1e3 / tp
    if args.speculative_config:
        results["speculative_config"] = args.speculative_config
        results["spec"] = {k: v for k, v in llm.stats().items() if k.startswith("spec_")}
    if llm.engine.runner.graphs:
        results["decode_step"] = decode_breakdown(llm.engine.runner, args.batch_size, args.input_len + args.output_len)

    cuda_prompts = prompts.cuda()
    if "gpt-fast" not in skip:
        from flashpage.bench.peers import StaticLlama, compiled_greedy_step, gpt_fast_generate

        net = StaticLlama(model, args.batch_size, args.input_len + args.output_len)
        decode = compiled_greedy_step()
        t = time.perf_counter()
        gpt_fast_generate(net, decode, cuda_prompts, args.output_len)  # compiles
        results["gpt_fast_compile_s"] = time.perf_counter() - t
        results["gpt_fast_ms_per_token"] = statistics.median(
            gpt_fast_generate(net, decode, cuda_prompts, args.output_len)[1] for _ in range(args.repeats))
        del net, decode
        torch.cuda.empty_cache()
    hf = None
    if "transformers" not in skip or "check" not in skip:
        from flashpage.bench.peers import to_transformers

        hf = to_transformers(model)
    if "transformers" not in skip:
        def hf_generate(n):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.inference_mode():
                hf.generate(cuda_prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        hf_generate(8)
        hf_prefill = statistics.median(hf_generate(1) for _ in range(args.repeats))
        hf_total = statistics.median(hf_generate(args.output_len) for _ in range(args.repeats))
        results["transformers_ms_per_token"] = (hf_total - hf_prefill) / (args.output_len - 1) * 1e3
    if "check" not in skip:
        results["greedy_check"] = greedy_check(llm, hf, vocab, gen)
    report(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


def prefill_flops(config, batch: int, prompt_len: int) -> float:
    """The arithmetic of `batch` prompts' prefill: every layer matrix once per token (2 FLOP per parameter), the
    LM head for each prompt's last token, and causal attention (Q Kᵀ and P V over the prompt's half square)."""
    matrices = 2 * layer_matrix_params(config) * prompt_len + 2 * config.vocab_size * config.hidden_size
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * prompt_len * (prompt_len + 1) / 2
    return batch * (matrices + attention)


def matmuls_ms(model, batch: int) -> float:
    """One decode step's matrix products and nothing else: every projection and the LM head at `batch` rows."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights.append(model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight)
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], device=w.device, dtype=w.dtype) for w in weights}
    return median_ms(lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights])


KERNEL_KINDS = [("matmul (cuBLAS)", ("gemm", "gemv", "nvjet", "cutlass", "xmma")), ("linear (Triton)", ("_linear_kernel",)),
                ("attention", ("_attention_kernel",)), ("split merge", ("_merge_splits",)), ("rms_norm", ("rms_norm",)),
                ("rope+cache", ("rope",)), ("silu_and_mul", ("silu",)), ("all-reduce / all-gather (NCCL)", ("nccl",))]


def decode_breakdown(runner, batch: int, context: int) -> dict:
    """Where one decode step's GPU time goes: the time of the step's CUDA graph and, from the profiler, the
    durations of its kernels by kind and the time at least one kernel runs (kernels overlap: on Hopper each is
    launched early and waits on the GPU for the one before, `flashpage.kernels.pdl`). The time less that is the time
    the GPU spends between kernels (under the profiler, about zero or a little below once kernels launch early). On one GPU the graph is replayed as the last decode left its inputs. Under tensor parallelism
    every rank must replay its graph (their collectives meet), so whole steps run instead, `batch` sequences at
    `context` tokens: the plan's broadcast and the sampling are in the time, and the kernels are rank 0's."""
    size = next(b for b, q in runner.graphs if q == 1 and b >= batch)
    if runner.tp.size == 1:
        step = runner.graphs[(size, 1)][0].replay
    else:
        from flashpage.engine.step import SampleRow, SampleSpec, SeqStep, StepPlan
        from flashpage.sampling_params import SamplingParams

        plan, blocks = StepPlan(), list(range(-(-context // runner.block_size)))  # (the sequences share them)
        for i in range(batch):
            plan.add(SeqStep(i, [0], [context - 1], blocks, num_logits=1))
        plan.samples = [SampleSpec(i, i, SampleRow(SamplingParams(temperature=0), (), 0, i)) for i in range(batch)]

        def step():
            runner.step(plan)
    step_ms = median_ms(step, graph=False)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    count = 0
    busy_us, end = 0.0, float("-inf")  # the union of the kernels' intervals
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                              if e.device_type == DeviceType.CUDA):
        busy_us += max(stop - max(start, end), 0.0)
        end = max(end, stop)
    for e in prof.key_averages():
        us = e.self_device_time_total / 10
        if us <= 0:
            continue
        kind = next((k for k, keys in KERNEL_KINDS if any(key in e.key for key in keys)), "other: " + e.key[:40])
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e3
        count += e.count // 10
    return {"graph_batch": size, "whole_steps": runner.tp.size > 1, "replay_ms": step_ms, "kernels": count,
            "kernel_ms": kinds, "busy_ms": busy_us / 10 / 1e3}


def greedy_check(llm, hf, vocab: int, gen: torch.Generator, lengths=(5, 37, 128, 511), n: int = 16) -> list[dict]:
    """flashpage's greedy tokens against transformers'; where they differ, the reference's top-2 logit margin
    at the first differing step (a small margin means bf16 rounding chose, not a bug). Over the steps where they
    agree, the largest difference between the two log-probabilities of the chosen token."""
    from flashpage import SamplingParams

    out = []
    for length in lengths:
        prompt = torch.randint(vocab, (length,), generator=gen)
        completion = llm.generate([prompt.tolist()], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                                    logprobs=0), use_tqdm=False)[0].outputs[0]
        ours = completion.token_ids
        with torch.inference_mode():
            ref = hf.generate(prompt[None].cuda(), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)
        theirs = ref.sequences[0, length:].tolist()
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        entry = {"prompt_len": length, "equal_tokens": n if first is None else first}
        diffs = [abs(completion.logprobs[i][t].logprob - float(torch.log_softmax(ref.scores[i][0].float(), -1)[t]))
                 for i, t in enumerate(ours[:entry["equal_tokens"]])]
        entry["max_logprob_diff"] = max(diffs, default=0.0)
        if first is not None:
            top2 = ref.scores[first][0].float().topk(2).values
            entry["margin_at_divergence"] = float(top2[0] - top2[1])
        out.append(entry)
    return out


def report(r: dict) -> None:
    floor = r["floor_ms"]
    print(f"{r['gpu']}, {r['date']}: {r['model']} {r['dtype']}{' FP8 weights' if r.get('quantization') else ''}, "
          f"batch {r['batch_size']}, {r['input_len']} prompt "
          f"tokens, {r['output_len']} generated, KV blocks of {r['block_size']}"
          f"{', sparse attention ' + json.dumps(r['sparse_attention']) if r.get('sparse_attention') else ''}")
    print(f"engine start to first token: {r['start_to_first_token_s']:.1f} s")
    tp = r.get("tensor_parallel_size", 1)
    print(f"copy bandwidth {r['copy_tbs']:.2f} TB/s; weights {r['weight_bytes'] / 1e9:.2f} GB"
          f"{f' over {tp} GPUs' if tp > 1 else ''} -> floor {floor:.2f} ms/token")
    if "matmuls_only_ms" in r:
        print(f"the step's matrix products alone (cuBLAS, one graph): {r['matmuls_only_ms']:.2f} ms = "
              f"{floor / r['matmuls_only_ms']:.1%} of floor")
    if "prefill_floor_ms" in r:
        print(f"first token: {r['flashpage_ttft_ms']:.1f} ms for {r['batch_size']} x {r['input_len']} prompt tokens "
              f"({r['prefill_tflop']:.1f} TFLOP); floor at the measured bf16 matmul rate ({r['matmul_tflops']:.0f} "
              f"TFLOP/s) {r['prefill_floor_ms']:.1f} ms = {r['prefill_floor_ms'] / r['flashpage_ttft_ms']:.1%} of it"
              f"{' (dense attention counted: sparse attention does less)' if r.get('sparse_attention') else ''}")
    print(f"{'system':<28}{'ms/token':>10}{'tok/s':>10}{'floor/ms':>10}{'flashpage x':>13}")
    ours = r["flashpage_ms_per_token"]
    for name, key in [("flashpage", "flashpage_ms_per_token"), ("gpt-fast style (compiled)", "gpt_fast_ms_per_token"),
                      ("transformers generate", "transformers_ms_per_token")]:
        if key in r:
            ms = r[key]
            print(f"{name:<28}{ms:>10.2f}{r['batch_size'] * 1e3 / ms:>10.1f}{floor / ms:>10.1%}{ms / ours:>13.2f}")
    if "decode_step" in r:
        d = r["decode_step"]
        how = "a whole step on every rank (plan broadcast and sampling included)" if d.get("whole_steps") else \
            "replayed"
        print(f"one decode step (graph of batch {d['graph_batch']}): {d['replay_ms']:.3f} ms {how}, {d['kernels']} "
              f"kernels running {d['busy_ms']:.3f} ms, {d['replay_ms'] - d['busy_ms']:.3f} ms between kernels "
              f"(kernel durations sum to {sum(d['kernel_ms'].values()):.3f} ms: kernels launched early wait on "
              f"the GPU for the one before)")
        for kind, ms in sorted(d["kernel_ms"].items(), key=lambda kv: -kv[1]):
            print(f"  {kind:<48}{ms:>8.3f} ms")
    if "spec" in r:
        print(f"speculative decoding {json.dumps(r['speculative_config'])}: acceptance "
              f"{r['spec']['spec_acceptance_rate']:.2f}, {r['spec']['spec_mean_accepted_length']:.2f} tokens per "
              f"verification")
    for c in r.get("greedy_check", []):
        extra = f", margin {c['margin_at_divergence']:.3f} there" if "margin_at_divergence" in c else ""
        print(f"greedy vs transformers, prompt {c['prompt_len']}: first {c['equal_tokens']} tokens equal{extra}; "
              f"chosen-token logprobs differ by <= {c['max_logprob_diff']:.3f} over those")


if __name__ == "__main__":
    raise SystemExit(main())
