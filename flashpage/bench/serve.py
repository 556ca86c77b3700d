"""Open-loop load against a running OpenAI-compatible server (in the spirit of `vllm bench serve`).

    flashpage bench serve --url http://127.0.0.1:8000 --model smollm2-135m --num-prompts 200 --request-rate 8

Requests arrive as a Poisson process at --request-rate per second (inf: all at once), whatever the server's
pace. Each prompt is --input-len random token ids; each asks for exactly --output-len tokens (ignore_eos).
Reports throughput and percentiles of time to first token (TTFT), inter-token latency (ITL) and end-to-end latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def one_request(http: httpx.AsyncClient, body: dict, headers: dict) -> RequestResult:
    start = time.perf_counter()
    last, res = None, RequestResult(ok=False)
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
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
        res.latency, res.ok = time.perf_counter() - start, True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(args) -> dict:
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    bodies = [{"model": args.model, "prompt": [rng.randrange(100, args.vocab) for _ in range(args.input_len)],
               "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}} for _ in range(args.num_prompts)]
    async with httpx.AsyncClient(base_url=args.url, timeout=httpx.Timeout(600.0)) as http:
        start = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(one_request(http, body, headers)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
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
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    if args.model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        args.model = httpx.get(f"{args.url}/v1/models", headers=headers).json()["data"][0]["id"]
    result = asyncio.run(run(args))
    print(f"completed {result['completed']} / failed {result['failed']} in {result['duration_s']:.2f} s "
          f"(rate {args.request_rate}/s, {args.input_len} in / {args.output_len} out tokens)")
    print(f"throughput: {result['request_throughput']:.2f} req/s, {result['output_token_throughput']:.1f} output tok/s, "
          f"{result['total_token_throughput']:.1f} total tok/s")
    for name in ("ttft", "itl", "e2e_latency"):
        s = result[name]
        print(f"{name:12s} mean {s['mean_ms']:9.2f} ms   median {s['median_ms']:9.2f} ms   p99 {s['p99_ms']:9.2f} ms")
    for e in result["errors"]:
        print("error:", e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "args": {k: v for k, v in vars(args).items() if k != "api_key"}}, f, indent=2)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
