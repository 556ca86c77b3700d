"""`flashpage bench deterministic`: the deterministic (batch-invariant) mode on a CUDA GPU: does it hold, and what
does it cost, against the default mode in the same run, on the same dummy weights.

1. Invariance: two target requests (greedy, and seeded at temperature 0.8; top-5 log-probs each) run alone, then
   last behind --batch-sizes other requests of random lengths (prompts 16..2048 tokens, outputs 8..128), with a
   2048-token step budget: alone a target's prompt is one chunk, in a batch it is cut into chunks next to other
   requests' prompts and decodes (prefix caching off, so every batch computes it again; then once more in the
   deterministic mode with it on, where the batches reuse the prompt's cached blocks). Reported per batch size and
   mode: whether the targets' tokens and log-probs are bit-identical to alone, else the first position that differs.
2. Cost: batch-1 decode (ms per output token after the first, --input-len prompt) against the weight-streaming floor
   (weight bytes / measured copy rate), and offline throughput (--num-prompts requests) against the compute floor.
3. The linear layer alone, the batch-invariant kernel against cuBLAS (torch), on the model's projections.
`--out` writes JSON.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from flashpage.bench.common import (copy_bandwidth_tbs, engine_over, free_memory, matmul_tflops, median_ms, sync,
                                    write_json)
from flashpage.bench.throughput import matmul_flops
from flashpage.sampling_params import SamplingParams


def outputs(engine, requests) -> dict:
    """Run (id, prompt, params) requests to the end; id -> [(token ids, log-probs)] per sample."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = [(c.token_ids, [[(t, lp.logprob) for t, lp in e.items()]
                                                    for e in c.logprobs or []]) for c in o.outputs]
    return out


def first_difference(a, b) -> int | None:
    """The first output position where tokens or log-probs differ (None: identical)."""
    (tokens_a, lps_a), (tokens_b, lps_b) = a[0], b[0]
    for i, (ta, tb, la, lb) in enumerate(zip(tokens_a, tokens_b, lps_a, lps_b)):
        if ta != tb or la != lb:
            return i
    return None if len(tokens_a) == len(tokens_b) else min(len(tokens_a), len(tokens_b))


def invariance(llm, deterministic: bool, batch_sizes: list[int], vocab: int, prefix_caching: bool = False) -> dict:
    engine = engine_over(llm, deterministic=deterministic, max_num_batched_tokens=2048,
                         enable_prefix_caching=prefix_caching)
    rng = random.Random(0)
    target_prompt = [rng.randrange(vocab) for _ in range(1500)]
    targets = [("greedy", target_prompt, SamplingParams(temperature=0, max_tokens=64, logprobs=5, ignore_eos=True)),
               ("seeded", target_prompt, SamplingParams(temperature=0.8, seed=7, max_tokens=64, logprobs=5,
                                                        ignore_eos=True))]
    alone = {rid: outputs(engine, [(rid, p, sp)])[rid] for rid, p, sp in targets}
    result = {}
    for size in batch_sizes:
        others = [(f"o{i}", [rng.randrange(vocab) for _ in range(rng.randint(16, 2048))],
                   SamplingParams(temperature=rng.choice([0, 1.0]), max_tokens=rng.randint(8, 128), ignore_eos=True))
                  for i in range(size)]
        start = time.perf_counter()
        got = outputs(engine, others + targets)
        result[size] = {rid: first_difference(alone[rid], got[rid]) for rid, _, _ in targets}
        print(f"  {'deterministic' if deterministic else 'default'} mode{' + prefix cache' if prefix_caching else ''}, "
              f"{size:4d} others: "
              + ", ".join(f"{rid} {'identical' if d is None else f'differs from token {d}'}"
                          for rid, d in result[size].items()) + f" ({time.perf_counter() - start:.1f} s)", flush=True)
    del engine
    free_memory()
    return result


def cost(llm, deterministic: bool, args, vocab: int) -> dict:
    engine = engine_over(llm, deterministic=deterministic, max_num_seqs=256)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(vocab, (args.input_len,), generator=gen).tolist()
    one = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    outputs(engine, [("warm", prompt[:64], SamplingParams(temperature=0, max_tokens=8))])
    times = []
    for i in range(3):
        engine.add_request(f"b{i}", prompt, one)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    m = o.metrics
                    times.append((m.last_token_time - m.first_token_time) / (len(o.outputs[0].token_ids) - 1))
    prompts = torch.randint(vocab, (args.num_prompts, args.tput_input_len), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.tput_output_len, ignore_eos=True)
    for run in range(2):  # a fresh engine's first run of a workload is slower (docs/cpu.md); the second is timed
        sync()
        start = time.perf_counter()
        outputs(engine, [(f"t{run}-{i}", p, params) for i, p in enumerate(prompts)])
        sync()
        elapsed = time.perf_counter() - start
    del engine
    free_memory()
    return {"decode_ms_per_token": sorted(times)[1] * 1e3, "throughput_s": elapsed,
            "output_tok_s": args.num_prompts * args.tput_output_len / elapsed}


def linear_times(model) -> list[dict]:
    from flashpage.kernels.linear import invariant_linear

    layer = model.layers[0]
    rows = []
    for name, w in (("qkv", layer.self_attn.qkv_proj.weight), ("o", layer.self_attn.o_proj.weight),
                    ("gate_up", layer.mlp.gate_up_proj.weight), ("down", layer.mlp.down_proj.weight)):
        for m in (1, 16, 64, 256, 1024, 8192):
            x = torch.randn(m, w.shape[1], device=w.device, dtype=w.dtype)
            ours = median_ms(lambda: invariant_linear(x, w))
            cublas = median_ms(lambda: torch.nn.functional.linear(x, w))
            rows.append({"proj": name, "m": m, "n": w.shape[0], "k": w.shape[1], "invariant_ms": ours,
                         "cublas_ms": cublas})
            print(f"  {name:8s} M={m:5d} [{w.shape[0]}x{w.shape[1]}]: batch-invariant {ours * 1e3:8.1f} us, cuBLAS "
                  f"{cublas * 1e3:8.1f} us ({ours / cublas:.2f}x)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashpage bench deterministic", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3-8b", help="a preset for dummy weights (or a model path)")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--batch-sizes", default="1,3,15,63,255", help="other requests next to the targets")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=400)
    p.add_argument("--tput-input-len", type=int, default=256)
    p.add_argument("--tput-output-len", type=int, default=128)
    p.add_argument("--skip", default="", help="comma list of parts to skip: invariance, cost, linear")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    from flashpage import LLM

    skip = set(args.skip.split(","))
    llm = LLM(args.model, load_format=args.load_format, dtype="bfloat16", max_model_len=4096, num_gpu_blocks=8192,
              enforce_eager=True)  # (the engines below capture their own graphs)
    vocab = llm.config.vocab_size
    r = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "model": args.model}
    if "invariance" not in skip:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        r["invariance"] = {mode: invariance(llm, mode == "deterministic", sizes, vocab)
                           for mode in ("default", "deterministic")}
        # with the prefix cache, the targets' prompts are cache hits after their first run
        r["invariance"]["deterministic_prefix_cache"] = invariance(llm, True, sizes, vocab, prefix_caching=True)
    if "cost" not in skip:
        r["cost"] = {mode: cost(llm, mode == "deterministic", args, vocab) for mode in ("default", "deterministic")}
        model = llm.engine.runner.model
        r["copy_tbs"], r["matmul_tflops"] = copy_bandwidth_tbs(), matmul_tflops()
        weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) - \
            model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size() * (model.lm_head is not None)
        r["decode_floor_ms"] = weight_bytes / (r["copy_tbs"] * 1e12) * 1e3
        tokens = args.num_prompts * (args.tput_input_len + args.tput_output_len)
        r["compute_floor_s"] = matmul_flops(llm.config, tokens, args.num_prompts * args.tput_output_len) / (
            r["matmul_tflops"] * 1e12)
        for mode, c in r["cost"].items():
            ms = c["decode_ms_per_token"]
            print(f"{mode:13s}: batch 1 {ms:.2f} ms/token ({r['decode_floor_ms'] / ms:.0%} of the weight-streaming "
                  f"floor {r['decode_floor_ms']:.2f} ms); {args.num_prompts} x "
                  f"({args.tput_input_len} in, {args.tput_output_len} out): {c['output_tok_s']:,.0f} output tok/s "
                  f"({r['compute_floor_s'] / c['throughput_s']:.0%} of the compute floor)")
        d, base = r["cost"]["deterministic"], r["cost"]["default"]
        print(f"deterministic / default: batch-1 latency "
              f"{d['decode_ms_per_token'] / base['decode_ms_per_token']:.2f}x, "
              f"throughput {d['output_tok_s'] / base['output_tok_s']:.2f}x")
    if "linear" not in skip:
        r["linear"] = linear_times(llm.engine.runner.model)
    write_json(args.out, r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
