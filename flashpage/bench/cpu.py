"""`flashpage bench cpu`: the default model on this machine's CPU, flashpage against transformers' `generate` in
the same run, at batch 1 and 32 (the README's CPU table).

Each batch is --prompt-len random prompt tokens per sequence and exactly --max-tokens greedy tokens out (EOS
ignored), after one warm-up each. transformers and flashpage's float32 run multiply the GGUF's weights dequantized
to float32; flashpage's `auto` run is what `LLM(model)` picks on this machine (where the CPU has AMX: bfloat16,
the GGUF's 4-bit blocks kept, `quantization="gguf"`; elsewhere float32), its `bfloat16` run the weights
dequantized to bfloat16. Prints output tok/s
and the ratios, and the ceiling of one prompt: a token reads every weight once, so no engine passes the model's
bytes at this machine's copy rate (measured in the same run); `--out` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import transformers  # the peer: a test dependency of flashpage, not a runtime one


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashpage bench cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from flashpage import LLM, SamplingParams
    from flashpage.loader.default_model import DEFAULT_MODEL, resolve_known_model

    gguf = resolve_known_model(DEFAULT_MODEL)
    engines = {"auto": LLM(str(gguf), device="cpu"), "bfloat16": LLM(str(gguf), dtype="bfloat16", device="cpu"),
               "float32": LLM(str(gguf), dtype="float32", device="cpu")}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                           dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
               "auto": describe(engines["auto"]),
               "threads": torch.get_num_threads(), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
               "batches": []}
    results["copy_gb_s"] = copy_rate = copy_gb_per_s()
    results["weight_bytes"] = {name: sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
                               for name, llm in engines.items()}
    print(f"auto picked {results['auto']}; copy rate {copy_rate:.1f} GB/s; one prompt's ceiling (weights read once a token): " + ", ".join(
        f"{name} {copy_rate * 1e9 / b:.1f} tok/s ({b / 1e6:.0f} MB)" for name, b in results["weight_bytes"].items()))
    for batch in map(int, args.batch_sizes.split(",")):
        prompts = torch.randint(100, engines["auto"].config.vocab_size, (batch, args.prompt_len), generator=gen)
        row = {"batch": batch}
        for name, llm in engines.items():
            llm.generate([{"prompt_token_ids": r} for r in prompts[:2].tolist()], params, use_tqdm=False)
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": r} for r in prompts.tolist()], params, use_tqdm=False)
            row[f"flashpage_{name}_tok_s"] = batch * args.max_tokens / (time.perf_counter() - start)
        with torch.inference_mode():
            hf.generate(prompts[:2], max_new_tokens=4, do_sample=False)
            start = time.perf_counter()
            hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.max_tokens,
                        min_new_tokens=args.max_tokens, do_sample=False, pad_token_id=0)
            row["transformers_tok_s"] = theirs = batch * args.max_tokens / (time.perf_counter() - start)
        results["batches"].append(row)
        print(f"batch {batch:3d}: transformers {theirs:7.1f} tok/s; flashpage " + ", ".join(
            f"{name} {row[f'flashpage_{name}_tok_s']:7.1f} tok/s ({row[f'flashpage_{name}_tok_s'] / theirs:.2f}x)"
            for name in engines), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


def describe(llm) -> str:
    runner = llm.engine.runner
    kept = any(p.dtype == torch.uint8 for p in runner.model.parameters())
    return str(runner.dtype).removeprefix("torch.") + (", the GGUF's 4-bit weights kept" if kept else "")


def copy_gb_per_s(size: int = 1 << 29) -> float:
    """Median rate of copying `size` bytes, read plus written, over five copies (after one)."""
    src, dst = torch.ones(size // 4), torch.empty(size // 4)
    dst.copy_(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * size / sorted(times)[2] / 1e9


if __name__ == "__main__":
    raise SystemExit(main())
