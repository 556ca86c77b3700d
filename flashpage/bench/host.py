"""`flashpage bench host`: the engine's own host work per decode step, the model left out.

The forward pass is replaced by zeros (hidden states, and logits over the first 1,024 tokens of the vocabulary), on
this machine's CPU, so what is timed is what the host does around every step whatever the GPU: scheduling,
building and uploading the step's inputs, sampling's bookkeeping, reading the tokens back and advancing the
requests. `--num-seqs` requests of `--input-len` random tokens are prefilled, then `--steps` decode steps of all of
them are timed, each part separately (medians). On a GPU a decode step that takes less time than this leaves the
device idle between steps (docs/kernel-notes.md, "Garbage collection in the offline run"). `--profile` adds the
functions that take the most time (cProfile); `--out` writes JSON (the medians, and each step's parts).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

LOGITS = 1024  # vocabulary columns the stand-in forward pass gives: sampling's device work is not the host's


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashpage bench host", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a preset for dummy weights (the host's work hardly depends "
                   "on it)")
    p.add_argument("--num-seqs", type=int, default=512)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="also print the 15 functions with the most own time")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from flashpage import LLM, SamplingParams
    from flashpage.loader.presets import preset_config

    config = preset_config(args.model)
    # room for the tokens decoded while the other prompts are prefilled, then for the timed steps
    max_len = args.input_len + args.num_seqs * args.input_len // 2048 + args.steps + 16
    # a cache just large enough, in the smallest dtype the CPU path takes (its contents are never read)
    token_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device="cpu", max_model_len=max_len,
              max_num_seqs=args.num_seqs, cpu_kv_cache_gb=1.1 * args.num_seqs * max_len * token_bytes / 2**30)
    engine = llm.engine
    runner = engine.runner
    runner._model = lambda ids, meta: (torch.zeros(ids.shape[0], config.hidden_size), None)
    runner.model.compute_logits = lambda hidden, out=None: torch.zeros(hidden.shape[0], LOGITS)

    params = SamplingParams(temperature=0, max_tokens=max_len - args.input_len, ignore_eos=True)
    prompts = torch.randint(LOGITS, (args.num_seqs, args.input_len)).tolist()
    for i, ids in enumerate(prompts):
        engine.add_request(f"host-{i}", ids, params)
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step(final_only=True)  # the prompts

    parts: dict[str, list[float]] = {"schedule": [], "launch": [], "read_back": [], "step": []}
    clock: dict[str, float] = {}
    for obj, name, part in ((engine.scheduler, "schedule", "schedule"), (runner, "step", "launch"),
                            (engine, "_read_back", "read_back")):
        setattr(obj, name, _timed(getattr(obj, name), part, clock))
    profiler = cProfile.Profile() if args.profile else None
    for _ in range(args.steps):
        clock.clear()
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        engine.step(final_only=True)
        if profiler:
            profiler.disable()
        clock["step"] = time.perf_counter() - start
        for part in parts:
            parts[part].append(clock.get(part, 0.0) * 1e3)
    decoding = len(engine.scheduler.running)
    result = {"model": args.model, "num_seqs": args.num_seqs, "decoding": decoding, "input_len": args.input_len,
              "steps": args.steps, "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
              **{f"{part}_ms": statistics.median(v) for part, v in parts.items()}, "per_step_ms": parts}
    print(f"host work per decode step of {decoding} sequences ({args.model}, {args.input_len}-token "
          f"prompts{', profiled' if profiler else ''}), median of {args.steps}: {result['step_ms']:.2f} ms "
          f"(schedule {result['schedule_ms']:.2f}, launch {result['launch_ms']:.2f}, read-back "
          f"{result['read_back_ms']:.2f})")
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    for i in range(args.num_seqs):
        engine.abort_request(f"host-{i}")
    return 0


def _timed(fn, part: str, clock: dict[str, float]):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[part] = clock.get(part, 0.0) + time.perf_counter() - start
    return timed


if __name__ == "__main__":
    raise SystemExit(main())
