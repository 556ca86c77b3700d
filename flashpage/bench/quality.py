"""`flashpage bench quality`: what each lossy mode costs on the default model, on this CPU (the README's quality
tables).

SmolLM2 from the default GGUF in float32 against each mode (FP8 KV cache, INT8 KV cache, FP8 weights, the GGUF's
4-bit weights kept as stored with bfloat16 activations at their products, the whole model in bfloat16, and what
dtype "auto" picks on this CPU): perplexity
over --tokens tokens of CPython's own documentation (`pydoc_data.topics`, in --window-token windows, every token
scored through the cache as decode reads it) and, with --code-tokens, over that many tokens of the standard
library's own source (`CODE_MODULES`), and how many of the first 32 greedy tokens of 8 prompts (64-token
pieces of the same text) equal float32's.

`--sparse`: sparse attention instead (`sparse_attention`): block-sparse prefill at about 25% and 10% of the causal
keys (`bench.sparse.pattern_for`), the same with key blocks chosen per KV head (`CHOSEN_BLOCKS`, density 25% and
10%, each sampled query in all its group's heads or in one), and SparQ at 1/8 and 1/4 of a 16-bit cache's dense
decode bytes (r = 1/4 or 1/2 of the head dimension, one byte each in SparQ's e4m3 copy, k = 1/16 or 1/8 of the
context, every token attended with SparQ as if decoded in turn: `"prompt": true`): perplexity of the second half
of a window of each of --contexts tokens (with --windows N, of N consecutive windows from the text's start, their
halves' tokens pooled); and a retrieval check: a pass key stated a quarter of the way into about
--retrieval-tokens tokens of filler, asked for at the end, answered greedily (`passkey_prompt`; SparQ decodes the
answer over a densely prefilled prompt, as served; block-sparse prefills the prompt, the answer decoded densely),
hits out of 10.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

MODES = {"fp8 KV cache": {"kv_cache_dtype": "fp8"}, "int8 KV cache": {"kv_cache_dtype": "int8"},
         "fp8 weights": {"quantization": "fp8"}, "gguf 4-bit kept": {"quantization": "gguf"},
         "bfloat16": {"dtype": "bfloat16"}, "auto": {"dtype": "auto"}}


# Standard-library modules whose source is the code text (any CPython 3.11+ has them).
CODE_MODULES = ("argparse", "typing", "dataclasses", "inspect", "collections", "functools", "pathlib", "subprocess",
                "threading")


def code_text() -> str:
    import importlib

    return "".join(Path(importlib.import_module(m).__file__).read_text() for m in CODE_MODULES)


def perplexity(llm, ids: list[int], window: int) -> float:
    from flashpage import SamplingParams

    windows = [{"prompt_token_ids": ids[i:i + window]} for i in range(0, len(ids) - window + 1, window)]
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    lps = [next(iter(pos.values())).logprob for o in outs for pos in o.prompt_logprobs[1:]]
    return math.exp(-sum(lps) / len(lps))


# (r and value axes per 64 of the head dimension, context / k, recent keys always chosen, bits of the key copy);
# "1/8 v": 1/8 of the bytes, a quarter of the r components' bytes spent on the values' coordinates instead
# (`"value_axes"`); "1/8 v2": an eighth of them; "1/8 v2 r8": that, the last 8 keys among the k chosen
# (`"recent"`); "1/8 v2 r8 4-bit": that with the key copy in 4 bits (`"key_bits"`), 26 components in the bytes of 14
# and the key's scale
SPARQ_BUDGETS = {"1/8": (16, 0, 16, 0, 8), "1/4": (32, 0, 8, 0, 8), "1/8 v": (12, 4, 16, 0, 8),
                 "1/8 v2": (14, 2, 16, 0, 8), "1/8 v2 r8": (14, 2, 16, 8, 8), "1/8 v2 r8 4-bit": (26, 2, 16, 8, 4)}


PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompt(tokenizer, key: str, tokens: int, depth: float = 0.25) -> str:
    """Passkey retrieval (Mohtashami and Jaggi, 2023): a pass key stated `depth` of the way into about `tokens`
    tokens of filler, asked for at the end. The filler is trivially predictable, so a model that attends densely
    finds the key, and a sparse mode that loses it shows; stated past the first 64-token block, it is no sink."""
    repeats = max(1, round(tokens / len(tokenizer.encode(PASSKEY_FILLER))))
    before = round(repeats * depth)
    return ("There is important information hidden inside a lot of irrelevant text. Find it and memorize it. I will "
            f"quiz you about it.\n{PASSKEY_FILLER * before}The pass key is {key}. Remember it. {key} is the pass key. "
            f"{PASSKEY_FILLER * (repeats - before)}\nWhat is the pass key? The pass key is")


# Blocks chosen per KV head (`--methods chosen`): one sink block, a window of the query's block and the one before,
# and the blocks of most attention up to the density (docs/sparse-attention.md has how these were chosen)
CHOSEN_BLOCKS = {"method": "block", "block": 64, "sink": 1, "local": 2}


def fixed_pattern(pattern) -> dict:
    """The `sparse_attention` setting of a fixed BlockSparsePattern."""
    return {"method": "block", "block": pattern.block, "sink": pattern.sink, "local": pattern.local,
            "stride": pattern.stride}


def sparse_quality(path: str, text: str, contexts: list[int], retrieval_tokens: int,
                   methods: tuple[str, ...] = ("sparq", "block", "chosen"),
                   budgets: tuple[str, ...] = tuple(SPARQ_BUDGETS), windows: int = 1) -> dict:
    import torch

    from flashpage import LLM, SamplingParams

    base = LLM(path, dtype="float32", device="cpu")
    dim = base.config.head_dim
    ids = base.tokenizer.encode(text[:8 * max(contexts) * windows])

    def tail_perplexity(llm, n):
        """Over the second halves of `windows` consecutive windows of n tokens from the text's start, pooled."""
        n = min(n, llm.config.max_position_embeddings - 1)  # (and one token to generate)
        if len(ids) < n * windows:
            raise ValueError(f"the text holds {len(ids)} tokens, fewer than {windows} windows of {n}")
        outs = llm.generate([{"prompt_token_ids": ids[i * n:(i + 1) * n]} for i in range(windows)],
                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        lps = [next(iter(pos.values())).logprob for o in outs for pos in o.prompt_logprobs[1:][n // 2:]]
        return math.exp(-sum(lps) / len(lps))

    keys = [str(random.Random(i).randrange(10_000, 100_000)) for i in range(10)]
    prompts = [passkey_prompt(base.tokenizer, key, retrieval_tokens) for key in keys]
    greedy = SamplingParams(max_tokens=8, temperature=0)

    def hits(llm):
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        return sum(key in o.outputs[0].text for key, o in zip(keys, outs))

    dense = {n: tail_perplexity(base, n) for n in contexts}
    result = {"contexts": contexts, "windows": windows, "dense_perplexity": dense, "dense_retrieval_hits": hits(base),
              "rows": []}
    print(f"{'mode':24s} " + " ".join(f"{f'ppl @{n}':>14s}" for n in contexts) + "  retrieval (of 10)")
    print(f"{'dense':24s} " + " ".join(f"{dense[n]:14.3f}" for n in contexts) + f"  {result['dense_retrieval_hits']}")
    for density in (0.25, 0.10) if "block" in methods else ():
        from flashpage.bench.sparse import pattern_for

        ppl = {}
        for n in contexts:
            pattern = pattern_for(min(n, base.config.max_position_embeddings - 1), density)
            llm = LLM(path, dtype="float32", device="cpu", sparse_attention=fixed_pattern(pattern))
            ppl[n] = tail_perplexity(llm, n)
        pattern = pattern_for(retrieval_tokens, density)
        llm = LLM(path, dtype="float32", device="cpu", sparse_attention=fixed_pattern(pattern))
        row = {"method": "block", "density": density, "perplexity": ppl, "ratio": {n: ppl[n] / dense[n] for n in
               contexts}, "retrieval_hits": hits(llm)}
        result["rows"].append(row)
        print(f"{f'block-sparse {density:.0%}':24s} " +
              " ".join(f"{ppl[n]:8.3f} {ppl[n] / dense[n] - 1:+5.1%}" for n in contexts) +
              f"  {row['retrieval_hits']}", flush=True)
    for heads, density in (("all", 0.25), ("all", 0.10), ("one", 0.25), ("one", 0.10)) if "chosen" in methods else ():
        setting = {**CHOSEN_BLOCKS, "density": density, "sample_heads": heads}
        llm = LLM(path, dtype="float32", device="cpu", sparse_attention=setting)
        ppl = {n: tail_perplexity(llm, n) for n in contexts}
        pattern = llm.engine.runner.sparse.pattern
        kept = {}
        for n in contexts:
            pos = torch.arange(min(n, base.config.max_position_embeddings - 1))
            kept[n] = float(pattern.keys_seen(pos).sum()) / float((pos + 1).sum())
        row = {"method": "block", "setting": setting, "perplexity": ppl, "keys_fraction": kept,
               "ratio": {n: ppl[n] / dense[n] for n in contexts}, "retrieval_hits": hits(llm)}
        result["rows"].append(row)
        label = f"blocks chosen {density:.0%}, {'all heads' if heads == 'all' else 'one head'}"
        print(f"{label:24s} " +
              " ".join(f"{ppl[n]:8.3f} {ppl[n] / dense[n] - 1:+5.1%}" for n in contexts) +
              f"  {row['retrieval_hits']}  (keys kept: " + ", ".join(f"{kept[n]:.1%}" for n in contexts) + ")",
              flush=True)
    for budget in budgets if "sparq" in methods else ():
        per_r, per_axes, per_k, recent, key_bits = SPARQ_BUDGETS[budget]
        r, axes = dim * per_r // 64, dim * per_axes // 64
        sparq = {"method": "sparq", "r": r, "value_axes": axes, "recent": recent, "key_bits": key_bits}
        ppl = {}
        for n in contexts:
            llm = LLM(path, dtype="float32", device="cpu", sparse_attention={**sparq, "k": n // per_k, "prompt": True})
            ppl[n] = tail_perplexity(llm, n)
        llm = LLM(path, dtype="float32", device="cpu", sparse_attention={**sparq, "k": retrieval_tokens // per_k})
        row = {"method": "sparq", "budget": budget, "r": r, "value_axes": axes, "recent": recent, "key_bits": key_bits,
               "k_per_context": f"context / {per_k}", "perplexity": ppl,
               "ratio": {n: ppl[n] / dense[n] for n in contexts}, "retrieval_hits": hits(llm),
               "retrieval_k": retrieval_tokens // per_k}
        result["rows"].append(row)
        label = f"SparQ {budget} (r={r}{f', m={axes}' if axes else ''}, k=S/{per_k}" + \
            (f", recent {recent})" if recent else ")")
        print(f"{label:24s} " +
              " ".join(f"{ppl[n]:8.3f} {ppl[n] / dense[n] - 1:+5.1%}" for n in contexts) +
              f"  {row['retrieval_hits']}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashpage bench quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--code-tokens", type=int, default=0, help="also perplexity over this many tokens of source code")
    p.add_argument("--sparse", action="store_true", help="SparQ attention's cost instead of the quantized modes'")
    p.add_argument("--contexts", default="1024,2048,4096,8192", help="--sparse: window sizes, comma-separated")
    p.add_argument("--windows", type=int, default=1,
                   help="--sparse: perplexity over this many consecutive windows of each context, pooled")
    p.add_argument("--retrieval-tokens", type=int, default=2000, help="--sparse: the retrieval prompts' length")
    p.add_argument("--methods", default="block,chosen,sparq", help="--sparse: which methods, comma-separated")
    p.add_argument("--budgets", default=",".join(SPARQ_BUDGETS), help="--sparse: SparQ's budgets, comma-separated")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if set(args.budgets.split(",")) - set(SPARQ_BUDGETS):
        p.error(f"--budgets: each one of {', '.join(SPARQ_BUDGETS)}")
    if args.windows < 1:
        p.error("--windows: at least 1")
    from pydoc_data.topics import topics

    from flashpage import LLM, SamplingParams
    from flashpage.loader.default_model import DEFAULT_MODEL, resolve_known_model

    path = str(resolve_known_model(DEFAULT_MODEL))
    text = "\n\n".join(topics[k] for k in sorted(topics))
    if args.sparse:
        result = sparse_quality(path, text, [int(n) for n in args.contexts.split(",")], args.retrieval_tokens,
                                tuple(args.methods.split(",")), tuple(args.budgets.split(",")), args.windows)
        if args.out:
            args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), **result}, indent=2))
        return 0
    base = LLM(path, dtype="float32", device="cpu")
    ids = base.tokenizer.encode(text[:40 * args.tokens])[:args.tokens]
    code = base.tokenizer.encode(code_text()[:40 * args.code_tokens])[:args.code_tokens]
    prompts = [{"prompt_token_ids": ids[i * 240:i * 240 + 64]} for i in range(8)]
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    def continuations(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    def code_perplexity(llm):
        return perplexity(llm, code, args.window) if code else math.nan

    dense_ppl, dense_code, dense = perplexity(base, ids, args.window), code_perplexity(base), continuations(base)
    rows = []
    print(f"{'mode':16s} {'perplexity':>10s} {'vs float32':>10s} {'code':>8s} {'vs float32':>10s}  "
          f"first 32 greedy tokens equal (8 prompts)")
    print(f"{'float32':16s} {dense_ppl:10.3f} {'':>10s} {dense_code:8.3f}")
    for name, setting in MODES.items():
        llm = LLM(path, device="cpu", **{"dtype": "float32", **setting})
        ppl, code_ppl, got = perplexity(llm, ids, args.window), code_perplexity(llm), continuations(llm)
        equal = [next((i for i, (a, b) in enumerate(zip(g, d)) if a != b), 32) for g, d in zip(got, dense)]
        rows.append({"mode": name, "setting": setting, "perplexity": ppl, "ratio": ppl / dense_ppl,
                     **({"code_perplexity": code_ppl, "code_ratio": code_ppl / dense_code} if code else {}),
                     "greedy_tokens_equal": equal})
        print(f"{name:16s} {ppl:10.3f} {ppl / dense_ppl - 1:+10.2%} {code_ppl:8.3f} {code_ppl / dense_code - 1:+10.2%}"
              f"  {equal}", flush=True)
        del llm
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "tokens": len(ids), "window": args.window,
                                        "float32_perplexity": dense_ppl, **({"code_tokens": len(code),
                                        "float32_code_perplexity": dense_code} if code else {}), "rows": rows},
                                       indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
