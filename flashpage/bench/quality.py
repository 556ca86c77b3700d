"""`flashpage bench quality`: what each lossy mode costs on the default model, on this CPU (the README's quality
table).

SmolLM2 from the default GGUF in float32 against each mode (FP8 KV cache, INT8 KV cache, FP8 weights): perplexity
over --tokens tokens of CPython's own documentation (`pydoc_data.topics`, in --window-token windows, every token
scored through the cache as decode reads it), and how many of the first 32 greedy tokens of 8 prompts (64-token
pieces of the same text) equal float32's.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

MODES = {"fp8 KV cache": {"kv_cache_dtype": "fp8"}, "int8 KV cache": {"kv_cache_dtype": "int8"},
         "fp8 weights": {"quantization": "fp8"}}


def perplexity(llm, ids: list[int], window: int) -> float:
    from flashpage import SamplingParams

    windows = [{"prompt_token_ids": ids[i:i + window]} for i in range(0, len(ids) - window + 1, window)]
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    lps = [next(iter(pos.values())).logprob for o in outs for pos in o.prompt_logprobs[1:]]
    return math.exp(-sum(lps) / len(lps))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashpage bench quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from pydoc_data.topics import topics

    from flashpage import LLM, SamplingParams
    from flashpage.loader.default_model import DEFAULT_MODEL, resolve_known_model

    path = str(resolve_known_model(DEFAULT_MODEL))
    text = "\n\n".join(topics[k] for k in sorted(topics))
    base = LLM(path, dtype="float32", device="cpu")
    ids = base.tokenizer.encode(text[:40 * args.tokens])[:args.tokens]
    prompts = [{"prompt_token_ids": ids[i * 240:i * 240 + 64]} for i in range(8)]
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    def continuations(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    dense_ppl, dense = perplexity(base, ids, args.window), continuations(base)
    rows = []
    print(f"{'mode':16s} {'perplexity':>10s} {'vs float32':>10s}  first 32 greedy tokens equal (8 prompts)")
    print(f"{'float32':16s} {dense_ppl:10.3f} {'':>10s}")
    for name, setting in MODES.items():
        llm = LLM(path, dtype="float32", device="cpu", **setting)
        ppl, got = perplexity(llm, ids, args.window), continuations(llm)
        equal = [next((i for i, (a, b) in enumerate(zip(g, d)) if a != b), 32) for g, d in zip(got, dense)]
        rows.append({"mode": name, "setting": setting, "perplexity": ppl, "ratio": ppl / dense_ppl,
                     "greedy_tokens_equal": equal})
        print(f"{name:16s} {ppl:10.3f} {ppl / dense_ppl - 1:+10.2%}  {equal}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "tokens": len(ids), "window": args.window,
                                        "float32_perplexity": dense_ppl, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
