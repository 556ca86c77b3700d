"""`flashpage bench tp`: tensor parallelism's correctness and its collectives, on one multi-GPU machine.

1. Greedy tokens at TP = N against TP = 1 (dummy weights, float32 by default, `--models`): identical, or the first
   divergence and TP = 1's top-2 log-probability margin there (a small margin: rounding chose, not a bug).
2. The logits of one prefill (bf16) at TP = N against TP = 1: relative error ||a - b|| / ||b||, and each one's
   error against TP = 1's float32 logits (bf16's own rounding, which TP = N's is to be read against).
3. NCCL all-reduce of --sizes bytes over the N GPUs, in processes of their own, launched eagerly: time and bus
   bandwidth (2 (N - 1) / N x bytes / time, NCCL's own measure). Small sizes measure the launch (45 us at 8 KB on
   two H200s); inside the decode step's CUDA graph an all-reduce takes 7-11 us (below).
The decode step's time in collectives comes from `flashpage bench latency --tensor-parallel-size N` (its kernel
breakdown names NCCL's kernels). Prints a table; `--out` writes JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from flashpage.bench.common import free_memory, write_json
from flashpage.sampling_params import SamplingParams


def greedy_tokens(model: str, tp: int, dtype: str, prompts: list[list[int]], max_tokens: int):
    """Each prompt's greedy tokens and their top-2 log-probabilities, and one prefill's logits (the first
    prompt's rows)."""
    from flashpage import LLM
    from flashpage.engine.step import SampleRow, SampleSpec, SeqStep, StepPlan

    llm = LLM(model, load_format="dummy", dtype=dtype, tensor_parallel_size=tp, max_model_len=1024,
              num_gpu_blocks=256, max_num_seqs=len(prompts), seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    runner = llm.engine.runner
    prompt = prompts[0]
    plan = StepPlan()
    plan.add(SeqStep(0, prompt, list(range(len(prompt))), list(range(-(-len(prompt) // 16))), num_logits=len(prompt)))
    greedy = SamplingParams(temperature=0)
    plan.samples = [SampleSpec(0, i, SampleRow(greedy, (), 0, i)) for i in range(len(prompt))]
    runner.step(plan).result()
    logits = runner.last_logits.float().cpu()
    tokens = [[(t, c.logprobs[i]) for i, t in enumerate(c.token_ids)] for c in (o.outputs[0] for o in outs)]
    llm.shutdown()
    del llm, runner
    free_memory()
    return tokens, logits


def compare(model: str, tp: int, dtype: str, prompts, max_tokens: int, exact: torch.Tensor | None = None) -> dict:
    """TP = tp against TP = 1 in `dtype`; with `exact` (float32 logits of TP = 1), each one's error against it too:
    the rounding of `dtype` alone, which TP = tp's own error is to be read against."""
    one, logits_one = greedy_tokens(model, 1, dtype, prompts, max_tokens)
    many, logits_many = greedy_tokens(model, tp, dtype, prompts, max_tokens)
    first = None
    for p, (a, b) in enumerate(zip(one, many)):
        step = next((i for i, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), None)
        if step is not None and first is None:
            top = sorted(a[step][1].values(), key=lambda lp: -lp.logprob)
            first = {"prompt": p, "step": step, "margin": top[0].logprob - top[1].logprob}
    same = sum(all(x[0] == y[0] for x, y in zip(a, b)) for a, b in zip(one, many))
    out = {"model": model, "dtype": dtype, "tp": tp, "prompts": len(prompts), "identical": same,
           "first_divergence": first, "logits_rel_err": _rel_err(logits_many, logits_one), "logits": logits_one}
    if exact is not None:
        out.update(tp1_vs_float32=_rel_err(logits_one, exact), tpn_vs_float32=_rel_err(logits_many, exact))
    return out


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _allreduce_worker(rank: int, size: int, port: int, sizes: list[int], results) -> None:
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    out = {}
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 2), dtype=torch.bfloat16, device=dev)
        for _ in range(5):
            dist.all_reduce(x)
        times = []
        for _ in range(20):
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(10):
                dist.all_reduce(x)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / 10)
        out[nbytes] = statistics.median(times)
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def allreduce(size: int, sizes: list[int]) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    from flashpage.parallel.workers import _NCCL_ENV

    os.environ.update(_NCCL_ENV)  # (NVLink multicast off, as the machines set it)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, size, port, sizes, results)) for r in range(size)]
    for p in procs:
        p.start()
    times = results.get(timeout=600)
    for p in procs:
        p.join()
    return [{"bytes": b, "us": t * 1e6, "bus_GBps": 2 * (size - 1) / size * b / t / 1e9} for b, t in times.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashpage bench tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--models", default="llama-3.2-1b,llama-3-8b",
                   help="presets, dummy weights (empty: the all-reduces only)")
    p.add_argument("--dtype", default="float32", help="the greedy check's dtype (the logits check runs in bf16 too)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--sizes", default="8192,65536,1048576,16777216,268435456", help="all-reduce sizes in bytes")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    tp = args.tensor_parallel_size
    gen = torch.Generator().manual_seed(0)
    out = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "gpus": torch.cuda.device_count(), "tensor_parallel_size": tp, "checks": [],
           "date": time.strftime("%Y-%m-%d")}
    for model in filter(None, args.models.split(",")):
        from flashpage.loader.presets import preset_config
        vocab = preset_config(model).vocab_size
        prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (5, 37, 128, 300)]
        exact = None
        for dtype in dict.fromkeys([args.dtype, "bfloat16"]):
            r = compare(model, tp, dtype, prompts, args.max_tokens, exact)
            logits = r.pop("logits")
            exact = logits if dtype == "float32" else exact
            out["checks"].append(r)
            first = r["first_divergence"]
            print(f"{model} {dtype} TP={tp} vs TP=1: {r['identical']}/{r['prompts']} prompts token-identical over "
                  f"{args.max_tokens} greedy tokens" + (f"; first divergence prompt {first['prompt']} step "
                  f"{first['step']}, TP=1 top-2 margin {first['margin']:.3g}" if first else "") +
                  f"; prefill logits rel. error {r['logits_rel_err']:.2e}" +
                  (f" (against float32 TP=1: TP=1 {r['tp1_vs_float32']:.2e}, TP={tp} {r['tpn_vs_float32']:.2e})"
                   if "tp1_vs_float32" in r else ""), flush=True)
    out["allreduce"] = allreduce(tp, [int(s) for s in args.sizes.split(",")])
    for r in out["allreduce"]:
        print(f"all-reduce {r['bytes']:>10d} B over {tp}: {r['us']:8.1f} us, bus {r['bus_GBps']:7.1f} GB/s", flush=True)
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
