"""Open-loop load against a running OpenAI-compatible server (in the spirit of `vllm bench serve`).

    flashpage bench serve --url http://127.0.0.1:8000 --model smollm2-135m --num-prompts 200 --request-rate 8

Requests arrive as a Poisson process at --request-rate per second (inf: all at once), whatever the server's
pace. Each prompt is --input-len random token ids; each asks for exactly --output-len tokens (ignore_eos),
streamed with a token count in every chunk (continuous usage), so token arrival times are measured even where
the text is empty (a dummy model has no tokenizer). Reports throughput and percentiles of time to first token
(TTFT), inter-token latency (ITL, one per token after the first) and end-to-end latency. --compare-offline then
runs the same requests through `LLM.generate` in this process (give the server's model options; on one GPU, start
the server with --gpu-memory-utilization 0.45: this side's 0.9 then leaves the engine what the server left) and
reports the server's rate as a fraction of it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import multiprocessing
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0  # perf_counter (system-wide on Linux: comparable between the client's processes)
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def one_request(http: httpx.AsyncClient, body: dict, headers: dict) -> RequestResult:
    start = time.perf_counter()
    last, res = None, RequestResult(ok=False, start=start)
    try:
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                now = time.perf_counter()
                tokens = (chunk.get("usage") or {}).get("completion_tokens", res.output_tokens)
                if tokens > res.output_tokens:
                    new = tokens - res.output_tokens
                    if last is None:  # tokens that came with the first arrive with no gap
                        res.ttft = now - start
                        res.itls += [0.0] * (new - 1)
                    else:
                        res.itls += [(now - last) / new] * new
                    last, res.output_tokens = now, tokens
        res.ok = True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.latency = time.perf_counter() - start
    return res


def spec_counters(args) -> dict[str, float]:
    """The server's speculative-decoding counters (vLLM's names in /metrics); empty where it does not speculate."""
    try:
        text = httpx.get(f"{args.url}/metrics").text
    except httpx.HTTPError:
        return {}
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                    "vllm:spec_decode_num_accepted_tokens_total"):
            counters[name.split(":spec_decode_")[1].removesuffix("_total")] = float(value)
    return counters


def make_prompts(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(100, args.vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]


def offline_rate(args, prompts: list[list[int]]) -> float:
    """Output tok/s of LLM.generate on the same requests, in this process."""
    from flashpage import LLM, SamplingParams

    llm = LLM(args.offline_model or args.model, load_format=args.load_format, dtype=args.dtype,
              gpu_memory_utilization=args.gpu_memory_utilization)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def arrival_offsets(args) -> list[float]:
    """When each request is sent, in seconds after the start: a Poisson process at --request-rate (inf: all at 0)."""
    rng = random.Random(args.seed)
    if not math.isfinite(args.request_rate):
        return [0.0] * args.num_prompts
    gaps = (rng.expovariate(args.request_rate) for _ in range(args.num_prompts - 1))
    return list(itertools.accumulate(gaps, initial=0.0))


async def send(args, bodies: list[dict], offsets: list[float], start: float) -> list[RequestResult]:
    """Send each body at start + its offset; the results, in order."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # httpx holds at most 100 connections unless told: more requests than that would queue in the client, in
    # waves of 100, and the benchmark would measure the client
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.url, timeout=httpx.Timeout(600.0), limits=limits) as http:
        tasks = []
        for body, offset in zip(bodies, offsets):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(http, body, headers)))
        return await asyncio.gather(*tasks)


def _client_process(args, bodies, offsets, barrier, results) -> None:
    barrier.wait()
    results.put(asyncio.run(send(args, bodies, offsets, time.perf_counter())))


def run(args, prompts: list[list[int]]) -> dict:
    bodies = [{"model": args.model, "prompt": prompt,
               "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
              for prompt in prompts]
    offsets = arrival_offsets(args)
    n = args.client_processes
    if n == 1:
        results = asyncio.run(send(args, bodies, offsets, time.perf_counter()))
    else:  # request i from process i % n, at its own time: one Python process parses at most ~10k events/s
        ctx = multiprocessing.get_context("spawn")
        barrier, queue = ctx.Barrier(n), ctx.Queue()
        procs = [ctx.Process(target=_client_process, args=(args, bodies[i::n], offsets[i::n], barrier, queue))
                 for i in range(n)]
        for proc in procs:
            proc.start()
        results = [r for _ in procs for r in queue.get()]
        for proc in procs:
            proc.join()
    duration = max(r.start + r.latency for r in results) - min(r.start for r in results)
    ok = [r for r in results if r.ok]
    itls = [x for r in ok for x in r.itls]

    def pct(xs, p):
        return statistics.quantiles(xs, n=100, method="inclusive")[p - 1] * 1e3 if len(xs) > 1 else (xs[0] * 1e3 if xs else float("nan"))

    def summary(xs):
        return {"mean_ms": statistics.fmean(xs) * 1e3 if xs else float("nan"), "median_ms": pct(xs, 50),
                "p99_ms": pct(xs, 99)}

    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "request_rate": args.request_rate,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": sum(r.output_tokens for r in ok) / duration,
        "total_token_throughput": sum(r.output_tokens + args.input_len for r in ok) / duration,
        "ttft": summary([r.ttft for r in ok]), "itl": summary(itls), "e2e_latency": summary([r.latency for r in ok]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashpage bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the served model name (default: the server's only model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf: all at once)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn from [100, vocab)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 4)),
                   help="spread the requests over this many client processes (default: a quarter of the cores, at "
                        "most 8; one Python process parses some 5,000 streamed events a second, less than a GPU "
                        "server sends)")
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--compare-offline", action="store_true",
                   help="then run the same requests through LLM.generate here and report the server's fraction of it")
    p.add_argument("--offline-model", default=None, help="the model for --compare-offline (default: --model)")
    p.add_argument("--load-format", default="auto", help="for --compare-offline, as the server's")
    p.add_argument("--dtype", default="auto", help="for --compare-offline, as the server's")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="for --compare-offline")
    args = p.parse_args(argv)
    if args.client_processes < 1 or args.num_prompts < 1:
        p.error("--client-processes and --num-prompts must be at least 1")
    if args.model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        args.model = httpx.get(f"{args.url}/v1/models", headers=headers).json()["data"][0]["id"]
    prompts = make_prompts(args)
    before = spec_counters(args)
    result = run(args, prompts)
    after = spec_counters(args)
    drafts, proposed, accepted = (after.get(k, 0) - before.get(k, 0) for k in ("num_drafts", "num_draft_tokens",
                                                                             "num_accepted_tokens"))
    if drafts:  # (the server exports the counters, at zero, without speculation too)
        result["spec_acceptance_rate"] = accepted / max(1, proposed)
        result["spec_mean_accepted_length"] = 1 + accepted / max(1, drafts)
    if args.compare_offline:
        result["offline_output_token_throughput"] = offline_rate(args, prompts)
        result["server_over_offline"] = result["output_token_throughput"] / result["offline_output_token_throughput"]
    print(f"completed {result['completed']} / failed {result['failed']} in {result['duration_s']:.2f} s "
          f"(rate {args.request_rate}/s, {args.input_len} in / {args.output_len} out tokens)")
    print(f"throughput: {result['request_throughput']:.2f} req/s, {result['output_token_throughput']:.1f} output tok/s, "
          f"{result['total_token_throughput']:.1f} total tok/s")
    for name in ("ttft", "itl", "e2e_latency"):
        s = result[name]
        print(f"{name:12s} mean {s['mean_ms']:9.2f} ms   median {s['median_ms']:9.2f} ms   p99 {s['p99_ms']:9.2f} ms")
    if "spec_acceptance_rate" in result:
        print(f"speculative decoding: acceptance {result['spec_acceptance_rate']:.2f}, "
              f"{result['spec_mean_accepted_length']:.2f} tokens per verification")
    if args.compare_offline:
        print(f"offline LLM.generate, same requests: {result['offline_output_token_throughput']:.1f} output tok/s; "
              f"the server delivers {result['server_over_offline']:.2f}x of it")
    for e in result["errors"]:
        print("error:", e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "args": {k: v for k, v in vars(args).items() if k != "api_key"}}, f, indent=2)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
