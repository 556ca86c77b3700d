"""`flashpage bench structured`: what structured outputs cost.

`cost` (CUDA GPU, or CPU): decoding under a JSON schema against free decoding, ms per output token, at
--batch-sizes requests at once, on dummy weights of a preset shape (--shape) given the tokenizer of --tokenizer (a
directory with tokenizer.json; default: the default model's, from its GGUF) and its vocabulary. Random weights
mostly write long JSON strings, the grammar's commonest state. Also reported: the host's time filling the masks
per step, most of which runs while the device computes the step.

`libraries` (CPU): the grammar libraries on the same tokenizer, the host work that differs between them: building
the tokenizer's index, compiling a JSON schema, and one token mask per step (one request and 32), for llguidance
and, where installed, xgrammar and outlines-core. `--out` writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from flashpage.bench.common import free_memory, sync, write_json
from flashpage.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "required": ["name", "age", "address", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "address": {"type": "object", "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string"},
                                                    "zip": {"type": "string", "pattern": "[0-9]{5}"}}},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
ANSWER = {"name": "Ada Lovelace", "age": 36, "address": {"city": "London", "zip": "12345"},
          "tags": ["math", "engines", "poetry"]}


def load_tokenizer(path: Path | None):
    from flashpage.loader import open_source
    from flashpage.loader.default_model import DEFAULT_MODEL
    from flashpage.tokenizer import Tokenizer

    return Tokenizer.from_hf_dir(path) if path else open_source(DEFAULT_MODEL).tokenizer()


def cost(args) -> dict:
    from flashpage.engine.config import EngineConfig
    from flashpage.engine.llm_engine import LLMEngine
    from flashpage.loader import LoadedModel, build_empty, init_dummy_weights, resolve_dtype
    from flashpage.loader.presets import preset_config

    tok = load_tokenizer(args.tokenizer)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = dataclasses.replace(preset_config(args.shape), vocab_size=tok.vocab_size,
                                 eos_token_ids=list(tok.eos_token_ids))
    model = build_empty(config, resolve_dtype("auto", torch.device(device)), torch.device(device))
    init_dummy_weights(model)
    engine = LLMEngine(EngineConfig(device=device, max_model_len=1024, max_num_seqs=max(args.batch_sizes)),
                       LoadedModel(config, model, tok))
    filling = []
    fill = engine.structured.bitmask

    def timed_fill(*a):
        start = time.perf_counter()
        mask = fill(*a)
        filling.append(time.perf_counter() - start)
        return mask

    engine.structured.bitmask = timed_fill
    prompt = tok.encode("Describe a person as JSON with name, age, address and tags.")
    rows = []
    for batch in args.batch_sizes:
        row = {"batch": batch}
        for kind in ("free", "json"):
            so = StructuredOutputsParams(json=SCHEMA) if kind == "json" else None
            params = SamplingParams(temperature=1.0, seed=0, max_tokens=args.max_tokens, ignore_eos=True,
                                    structured_outputs=so)
            for rep in range(2):  # the first is warm-up
                filling.clear()
                for i in range(batch):
                    engine.add_request(f"{kind}{i}", prompt, dataclasses.replace(params, seed=i))
                sync()
                start, tokens = time.perf_counter(), 0
                while engine.has_unfinished_requests():
                    tokens += sum(len(c.token_ids) for o in engine.step() if o.finished for c in o.outputs)
                sync()
            row[f"{kind}_ms_per_token"] = (time.perf_counter() - start) / tokens * batch * 1e3
            row[f"{kind}_tokens"] = tokens
            if kind == "json":
                row["mask_ms_per_step"] = statistics.median(filling) * 1e3
        row["ratio"] = row["json_ms_per_token"] / row["free_ms_per_token"]
        rows.append(row)
        print(f"batch {batch:4d}: free {row['free_ms_per_token']:.2f} ms/token, JSON schema "
              f"{row['json_ms_per_token']:.2f} ms/token ({row['ratio']:.2f}x; {row['json_tokens'] / batch:.0f} tokens "
              f"per request), host mask fill {row['mask_ms_per_step']:.3f} ms per step", flush=True)
    del engine
    free_memory()
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shape": args.shape,
            "vocab": tok.vocab_size, "max_tokens": args.max_tokens, "rows": rows}


def libraries(args) -> dict:
    tok = load_tokenizer(args.tokenizer)
    vocab, eos = tok.vocab_size, tok.eos_token_ids[0]
    answer = tok.encode(json.dumps(ANSWER), add_special_tokens=False)
    out = {}

    def record(name, index_s, compile_s, new, fill, advance):
        """new(batch) -> (matchers, mask); fill(matchers, mask) fills one mask per matcher (timed); advance(matcher,
        token). The matchers walk `answer` together."""
        def walk(batch):
            (matchers, mask), times = new(batch), []
            for t in answer:
                start = time.perf_counter()
                fill(matchers, mask)
                times.append(time.perf_counter() - start)
                for m in matchers:
                    advance(m, t)
            return times

        per = {b: statistics.median(walk(b)) * 1e3 for b in (1, 32)}
        out[name] = {"index_ms": index_s * 1e3, "compile_ms": compile_s * 1e3, "mask_ms_batch1": per[1],
                     "mask_ms_batch32": per[32]}
        print(f"{name:12s} tokenizer index {index_s * 1e3:7.0f} ms, schema compile {compile_s * 1e3:6.1f} ms, mask per "
              f"step {per[1] * 1e3:6.0f} us (1 request), {per[32] * 1e3:6.0f} us (32)", flush=True)

    import llguidance
    import llguidance.torch

    start = time.perf_counter()
    lt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=eos)
    index_s = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    llguidance.LLMatcher(lt, grammar)
    compile_s = time.perf_counter() - start
    executor = llguidance.LLExecutor()
    record("llguidance", index_s, compile_s,
           lambda b: ([llguidance.LLMatcher(lt, grammar) for _ in range(b)], llguidance.torch.allocate_token_bitmask(b, vocab)),
           lambda ms, mask: llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ms)], mask),
           lambda m, t: m.consume_token(t))
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        print("xgrammar: not installed")
    else:
        start = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok.backend),
                                                  vocab_size=vocab, stop_token_ids=[eos])
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        index_s = time.perf_counter() - start
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
        compile_s = time.perf_counter() - start

        batched = xgr.BatchGrammarMatcher()
        record("xgrammar", index_s, compile_s,
               lambda b: ([xgr.GrammarMatcher(compiled) for _ in range(b)], xgr.allocate_token_bitmask(b, vocab)),
               batched.batch_fill_next_token_bitmask, lambda m, t: m.accept_token(t))
    try:
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        print("outlines-core: not installed")
    else:
        start = time.perf_counter()
        tokens: dict[str, list[int]] = {}
        for i in range(vocab):
            text = tok.backend.decode([i], skip_special_tokens=False)
            if i != eos and text and "\ufffd" not in text:  # (partial UTF-8 sequences have no string form)
                tokens.setdefault(text, []).append(i)
        vocabulary = oc.Vocabulary(eos, tokens)
        index_s = time.perf_counter() - start
        start = time.perf_counter()
        index = oc.Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
        compile_s = time.perf_counter() - start

        def oc_fill(guides, mask):
            for i, g in enumerate(guides):
                mask[i, g.get_tokens()] = True

        record("outlines-core", index_s, compile_s,
               lambda b: ([oc.Guide(index) for _ in range(b)], torch.zeros(b, vocab, dtype=torch.bool)), oc_fill,
               lambda g, t: g.advance(t))
    return {"vocab": vocab, "answer_tokens": len(answer), "threads": torch.get_num_threads(), "libraries": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashpage bench structured", description=__doc__.split("\n\n")[0])
    p.add_argument("part", nargs="?", default="cost", choices=["cost", "libraries"])
    p.add_argument("--shape", default="llama-3-8b", help="a preset shape for the dummy weights (cost)")
    p.add_argument("--tokenizer", type=Path, default=None, help="a directory with tokenizer.json")
    p.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 32, 128])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    r = cost(args) if args.part == "cost" else libraries(args)
    r["date"] = time.strftime("%Y-%m-%d")
    write_json(args.out, r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
