"""`flashpage bench spec`: speculative decoding, against no speculation in the same run.

`real` (the default model, CPU or GPU): prompt lookup (or --speculative-config) on prompts whose answers reuse
their input, written from text that CPython ships (the documentation in `pydoc_data/topics.py`, standard-library
source): copy-edit a passage, edit a function, summarise a passage. Each prompt alone, greedy, chat template; wall
time with and without speculation, the speedup as the ratio of output tokens a second (a 16-bit model's verify
and decode steps may round differently and the two answers part: whether they are the same is reported), tokens
per verification, acceptance.

`mechanics` (CUDA GPU, dummy weights; acceptance of random weights means nothing, so the proposals are chosen):
1. one verify step (a sequence's last token + k proposals, k = 1..8) against a plain decode step, batch 1,
   both from their CUDA graphs, timed on the runner with CUDA events (and the verify step run eagerly);
2. end to end, batch 1, seeded sampling: an oracle proposer that knows the answer (from a run without
   speculation) and proposes it, each token corrupted with probability 1 - a, for a in --acceptance (the
   speedup-vs-acceptance curve; a = 1: every proposal right);
3. the same at --batch-sizes concurrent requests, speculation forced on (a = 1 and 0.6), and with the default
   disable_by_batch_size (the load switch), against no speculation;
4. a draft model (--draft, dummy llama-3.2-1b): the time of its k proposals, as target decode steps.

`medusa` (the default model, CPU or GPU): Medusa heads trained here on the model's own answers to other prompts
of the same kinds (self-distillation, `engine/spec/medusa_train.py`), then `real` with a tree of them and with a
chain (blockwise parallel decoding), greedy; and sampled at temperature 0.7, lossless and with typical
acceptance, with the model's mean negative log-likelihood of the outputs (a lossy method's cost).

`heads` (CUDA GPU, dummy weights): random Medusa heads and a random EAGLE draft on `llama-3-8b`, batch 1: the time
of a speculating step (proposing, verifying) against a plain decode step, and the speedup at full acceptance.

`trees` (CUDA GPU, dummy weights): one forward of a token tree of 16 / 32 / 64 nodes (branching 1, 2, 4: a chain
and bushier trees, positions by depth) over a --input-len prompt in the cache, against a plain decode step, batch 1,
both replayed as CUDA graphs; and each node's logits against its root-to-node path's own forward (beside the same
path computed as a causal step over the cache: the dtype's own spread).
`sot` (the default model, CPU or GPU): skeleton-of-thought (`LLM.skeleton_of_thought`) against a plain chat
answer (greedy, up to --max-tokens), four questions of the paper's generic / knowledge / common-sense kinds: wall
time, tokens, and how many points the model expanded.
Prints tables; `--out` writes JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import time
from pathlib import Path

import torch

from flashpage.bench.common import engine_over, free_memory, run_alone, sync
from flashpage.sampling_params import SamplingParams


def real_prompts() -> list[tuple[str, str]]:
    """(task, user message) pairs from text that ships with CPython."""
    import textwrap

    from pydoc_data.topics import topics

    def passage(name, chars=900):
        text = topics[name]
        return text[:text.rfind("\n\n", 0, chars)].strip()

    return [
        ("copy-edit", "Copy the following text exactly, fixing only spelling mistakes if there are any:\n\n"
                      + passage("pass")),
        ("copy-edit", "Copy the following text exactly, fixing only spelling mistakes if there are any:\n\n"
                      + passage("assert")),
        ("edit-code", "Rename the function `dedent` to `remove_common_indent` in this code and show the whole "
                      "code:\n\n```python\n" + inspect.getsource(textwrap.dedent) + "```"),
        ("edit-code", "Add a type hint to every argument of this function and show the whole function:\n\n"
                      "```python\n" + inspect.getsource(textwrap.indent) + "```"),
        ("summarise", "Summarise this passage in two sentences:\n\n" + passage("break")),
        ("summarise", "Summarise this passage in two sentences:\n\n" + passage("continue")),
    ]


def token_rate_ratio(rows: list[dict]) -> float:
    """Output tokens a second with speculation over without, over several prompts: the ratio of their wall times
    where both produced the same tokens, and still fair where a 16-bit model's verify and decode steps rounded
    differently and the two outputs part (then of different lengths)."""
    return (sum(r["output_tokens"] for r in rows) / sum(r["spec_s"] for r in rows)) / \
        (sum(r["plain_tokens"] for r in rows) / sum(r["plain_s"] for r in rows))


def default_llm(args):
    from flashpage import LLM

    return LLM(args.model, **({"dtype": args.cpu_dtype} if args.device == "cpu" else {}), device=args.device,
               max_model_len=4096, num_gpu_blocks=512)


def real(args, llm=None, spec: dict | None = None, temperature: float = 0.0) -> dict:
    """Each real prompt alone, with and without `spec` (default --speculative-config). Sampled (temperature >
    0, one seed a prompt): the model's mean negative log-likelihood of each output is reported too, the check
    of a lossy option's cost (the lossless methods draw the same tokens)."""
    llm = llm or default_llm(args)
    spec = spec or json.loads(args.speculative_config)
    plain, fast = engine_over(llm), engine_over(llm, speculative_config=spec)
    rows = []
    for n, (task, message) in enumerate(real_prompts()):
        params = SamplingParams(temperature=temperature, seed=n, max_tokens=args.max_tokens)
        ids = llm.chat_prompt_ids([{"role": "user", "content": message}])
        run_alone(plain, ids[:32], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        base_s, base = run_alone(plain, ids, params)
        before = dict(fast.spec_stats.as_dict())
        spec_s, out = run_alone(fast, ids, params)
        after = fast.spec_stats.as_dict()
        drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
        accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        proposed = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
        rows.append({"task": task, "prompt_tokens": len(ids), "output_tokens": len(out), "plain_tokens": len(base),
                     "same_tokens": out == base,
                     "plain_s": base_s, "spec_s": spec_s, "speedup": len(out) / spec_s / (len(base) / base_s),
                     "tokens_per_verification": 1 + accepted / max(1, drafts),
                     "acceptance": accepted / max(1, proposed), "verifications": drafts})
        r = rows[-1]
        if temperature:
            r["plain_nll"], r["spec_nll"] = output_nll(llm, ids, base), output_nll(llm, ids, out)
        print(f"{task:10s} prompt {len(ids):4d} out {len(out):4d}  plain {base_s:6.2f} s  spec {spec_s:6.2f} s  "
              f"{r['speedup']:.2f}x  {r['tokens_per_verification']:.2f} tokens/verification  "
              f"acceptance {r['acceptance']:.2f}  same tokens: {r['same_tokens']}" +
              (f"  NLL plain {r['plain_nll']:.3f} spec {r['spec_nll']:.3f}" if temperature else ""), flush=True)
    by_task = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r)
    summary = {t: {"speedup": token_rate_ratio(rs),
                   "tokens_per_verification": statistics.mean(x["tokens_per_verification"] for x in rs)}
               for t, rs in by_task.items()}
    for t, s in summary.items():
        print(f"{t:10s} total speedup {s['speedup']:.2f}x, {s['tokens_per_verification']:.2f} tokens/verification")
    out = {"model": args.model, "device": str(llm.engine.runner.device), "speculative_config": spec,
           "max_tokens": args.max_tokens, "temperature": temperature, "prompts": rows, "by_task": summary,
           "speedup": token_rate_ratio(rows)}
    if temperature:
        out["plain_nll"] = statistics.mean(r["plain_nll"] for r in rows)
        out["spec_nll"] = statistics.mean(r["spec_nll"] for r in rows)
        print(f"mean NLL of the outputs under the model: plain {out['plain_nll']:.3f}, spec {out['spec_nll']:.3f}")
    return out


@torch.inference_mode()
def output_nll(llm, prompt: list[int], output: list[int]) -> float:
    """The model's mean negative log-likelihood (temperature 1) of `output` after `prompt`."""
    from flashpage.model import AttentionMetadata

    model = llm.engine.runner.model
    ids = torch.tensor(prompt + output, device=llm.engine.runner.device)
    hidden = model(ids, AttentionMetadata.prefill([len(ids)]), None)[len(prompt) - 1:-1]
    logprobs = torch.log_softmax(model.compute_logits(hidden), dim=-1)
    return -float(logprobs.gather(1, ids[len(prompt):, None]).mean())


def training_prompts() -> list[str]:
    """User messages whose answers train Medusa heads: the kinds of `real_prompts`, on other passages of the same
    documentation and other functions' source (none of the benchmark's own)."""
    import shlex
    import string
    import textwrap

    from pydoc_data.topics import topics

    held_out = {"pass", "assert", "break", "continue"}
    names = [n for n in sorted(topics) if n not in held_out and len(topics[n]) > 600]
    out = []
    for i, name in enumerate(names[:48]):
        text = topics[name][:topics[name].rfind("\n\n", 0, 900)].strip() or topics[name][:900]
        out.append(["Copy the following text exactly, fixing only spelling mistakes if there are any:\n\n",
                    "Summarise this passage in two sentences:\n\n", "Explain this passage to a beginner:\n\n"][i % 3]
                   + text)
    functions = [textwrap.wrap, textwrap.fill, textwrap.shorten, shlex.split, shlex.quote, shlex.join,
                 string.capwords, inspect.getdoc, inspect.cleandoc, json.dumps]
    for i, f in enumerate(functions):
        code = "```python\n" + inspect.getsource(f) + "```"
        out.append(["Add a type hint to every argument of this function and show the whole function:\n\n",
                    f"Rename the function `{f.__name__}` to `{f.__name__}_v2` in this code and show the whole "
                    "code:\n\n"][i % 2] + code)
    return out


def medusa(args) -> dict:
    """Medusa heads for the default model, trained here on its own greedy answers to `training_prompts`
    (self-distillation; --heads keeps them), then the real prompts with a tree and with a chain (blockwise),
    greedy, and sampled at temperature 0.7 losslessly and with typical acceptance."""
    from flashpage.engine.spec.medusa_train import save_medusa, train_medusa

    llm = default_llm(args)
    heads = args.heads or Path("/tmp/flashpage-medusa-heads")
    trained = {}
    if not (heads / "config.json").exists():
        start = time.perf_counter()
        messages = training_prompts()
        prompts = [llm.chat_prompt_ids([{"role": "user", "content": m}]) for m in messages]
        answers = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=args.max_tokens))
        sequences = [p + a.outputs[0].token_ids for p, a in zip(prompts, answers)]
        generated = time.perf_counter() - start
        model = llm.engine.runner.model
        save_medusa(train_medusa(model, sequences, args.k, steps=args.train_steps, batch=256), heads)
        trained = {"training_sequences": len(sequences), "training_tokens": sum(map(len, sequences)),
                   "generate_s": generated, "train_s": time.perf_counter() - start - generated,
                   "train_steps": args.train_steps}
        print(f"trained {args.k} heads on {trained['training_tokens']} tokens: {generated:.0f} s generating, "
              f"{trained['train_s']:.0f} s training", flush=True)
    runs = {}
    for name, spec, temperature in [
            ("tree", {}, 0.0), ("chain (blockwise)", {"tree_width": 1}, 0.0), ("tree, sampled", {}, 0.7),
            ("tree, sampled, typical", {"acceptance_method": "typical_acceptance_sampler"}, 0.7)]:
        print(f"--- Medusa heads, {name}", flush=True)
        runs[name] = real(args, llm, {"method": "medusa", "model": str(heads), **spec}, temperature)
    return {"model": args.model, "device": str(llm.engine.runner.device), "heads": str(heads), **trained,
            "runs": runs}


class OracleProposer:
    """Proposes each request's known answer, each token replaced by a wrong one with probability 1 - a
    (bench only: acceptance on demand)."""
    probs = None

    def __init__(self, k: int, answers: dict[str, list[int]], acceptance: float, vocab: int):
        self.k, self.answers, self.acceptance, self.vocab = k, answers, acceptance, vocab
        self.rng = random.Random(0)

    def propose(self, running) -> None:
        for seq in running:
            if seq.num_uncomputed == 1 and not seq.num_pending:
                done = len(seq.token_ids) - seq.num_prompt_tokens
                right = self.answers[seq.request_id][done:done + self.k]
                seq.proposal = [t if self.rng.random() < self.acceptance else (t + 1) % self.vocab for t in right]

    def release(self, seq_id: int) -> None:
        pass


def mechanics(args) -> dict:
    from flashpage import LLM
    from flashpage.engine.step import SampleRow, SampleSpec, SeqStep, StepPlan

    cuda = args.device != "cpu"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("flashpage bench spec mechanics: needs a CUDA GPU (--device cpu: a dry run)")
    out = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "model": args.model, "dtype": args.dtype, "k": args.k,
           "input_len": args.input_len, "output_len": args.max_tokens}
    max_len, top = args.input_len + args.max_tokens + 32, max(map(int, args.batch_sizes.split(",")))
    # every engine of this run gets a cache for its largest batch (they live one at a time beside the first)
    llm = LLM(args.model, load_format="dummy", dtype=args.dtype if cuda else "float32", device=args.device,
              max_model_len=max_len, max_num_seqs=top, num_gpu_blocks=top * -(-max_len // 16) + 64)
    runner, vocab = llm.engine.runner, llm.config.vocab_size

    # 1. one verify step against one decode step (batch 1, context input_len), each from its CUDA graph: an engine
    # per k (its verify graph holds k + 1 tokens)
    table = list(range(-(-(args.input_len + 16) // runner.block_size)))
    greedy = SamplingParams(temperature=0)

    def plan_for(k: int) -> StepPlan:
        plan = StepPlan()
        plan.add(SeqStep(0, [7] * (k + 1), list(range(args.input_len, args.input_len + k + 1)), table,
                         num_logits=k + 1))
        plan.samples = [SampleSpec(0, i, SampleRow(greedy, (), 0, i)) for i in range(k + 1)]
        return plan

    def step_ms(runner, k: int) -> float:
        plan = plan_for(k)
        for _ in range(3):
            runner.step(plan).result()
        times = []
        for _ in range(20):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                runner.step(plan).result()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                runner.step(plan).result()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    out["verify_step"] = []
    for k in range(1, 9) if not args.skip_verify_steps else ():
        engine = engine_over(llm, max_num_seqs=1, speculative_config={
            "method": "ngram", "num_speculative_tokens": k, "disable_by_batch_size": 1})
        base, ms = step_ms(engine.runner, 0), step_ms(engine.runner, k)
        out["verify_step"].append({"k": k, "ms": ms, "decode_ms": base, "vs_decode": ms / base,
                                   "eager_ms": step_ms(runner, k)})
        del engine
        free_memory()
    base = out["decode_step_ms"] = step_ms(runner, 0)
    print(f"decode step (batch 1{', CUDA graph' if runner.graphs else ''}): {base:.3f} ms")
    for r in out["verify_step"]:
        print(f"verify k={r['k']}: {r['ms']:.3f} ms = {r['vs_decode']:.2f}x a decode step (eager: {r['eager_ms']:.3f} ms)")

    # 2./3. end to end with the oracle proposer (seeded sampling). A verify step rounds otherwise than a decode
    # step (other matrix-product kernels for other row counts); through 32 random layers in bfloat16 that moved a
    # draw every few dozen tokens (H100: no sequence of 128 tokens kept the oracle's answer), and after a moved
    # draw a sequence leaves the oracle's answer for good. So the layers' output projections are zeroed here: the
    # same work and the same bytes, but each layer adds exactly nothing to the residual stream, the next token
    # depends on the last one alone, and rounding can move a draw only through the final projection.
    with torch.no_grad():
        for layer in llm.engine.runner.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    gen = torch.Generator().manual_seed(0)
    k = args.k
    out["e2e"] = []
    for batch in map(int, args.batch_sizes.split(",")):
        prompts = torch.randint(100, vocab, (batch, args.input_len), generator=gen).tolist()
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
                  for i in range(batch)]

        def timed(engine, proposer=None):
            if proposer is not None:
                engine.proposer = proposer
            ids = [f"b{batch}-{i}" for i in range(batch)]
            sync()
            start = time.perf_counter()
            for rid, p, sp in zip(ids, prompts, params):
                engine.add_request(rid, p, sp)
            done = {}
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        done[o.request_id] = o.outputs[0].token_ids
            return time.perf_counter() - start, done

        plain = llm.engine
        timed(plain)  # warm-up
        plain_s, answers = timed(plain)
        runs = [(a, batch) for a in map(float, args.acceptance.split(","))] if batch == 1 else \
            [(1.0, batch), (0.6, batch), (1.0, None)]
        for acceptance, limit in runs:  # limit: forced on at this batch size, or None: the default load switch
            spec = {"method": "ngram", "num_speculative_tokens": k}
            if limit:
                spec["disable_by_batch_size"] = limit
            engine = engine_over(llm, speculative_config=spec, max_num_seqs=llm.engine.cfg.max_num_seqs)
            proposer = OracleProposer(k, answers, acceptance, vocab)
            timed(engine, proposer)
            spec_s, got = timed(engine, proposer)
            s = engine.stats()
            r = {"batch": batch, "acceptance_asked": acceptance, "disable_by_batch_size": engine.spec.disable_by_batch_size,
                 "plain_s": plain_s, "spec_s": spec_s, "speedup": plain_s / spec_s,
                 "acceptance": s["spec_acceptance_rate"], "tokens_per_verification": s["spec_mean_accepted_length"],
                 "same_tokens": sum(got[i] == answers[i] for i in answers) / len(answers)}
            out["e2e"].append(r)
            print(f"batch {batch:3d} a={acceptance:.2f} disable_by_batch_size={r['disable_by_batch_size']}: "
                  f"plain {plain_s:.3f} s, spec {spec_s:.3f} s, {r['speedup']:.2f}x, acceptance {r['acceptance']:.2f}, "
                  f"{r['tokens_per_verification']:.2f} tokens/verification, same tokens {r['same_tokens']:.0%}",
                  flush=True)
            del engine
            free_memory()
    if args.draft:  # random weights accept nothing: this times the draft's proposals against target steps
        engine = engine_over(llm, speculative_config={"model": args.draft, "num_speculative_tokens": k},
                             load_format="dummy")
        propose, spent = engine.proposer.propose, []

        def timed_propose(running):
            sync()
            t = time.perf_counter()
            propose(running)
            sync()
            spent.append(time.perf_counter() - t)

        engine.proposer.propose = timed_propose
        prompt = torch.randint(100, vocab, (args.input_len,), generator=gen).tolist()
        greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        run_alone(engine, prompt, greedy)
        spent.clear()
        spec_s, _ = run_alone(engine, prompt, greedy)
        s = engine.stats()
        out["draft"] = {"draft": args.draft, "k": k, "propose_ms": statistics.median(spent) * 1e3,
                        "decode_step_ms": base, "spec_ms_per_token": spec_s / args.max_tokens * 1e3,
                        "acceptance": s["spec_acceptance_rate"]}
        d = out["draft"]
        print(f"draft {args.draft}, k={k}: proposing takes {d['propose_ms']:.2f} ms = "
              f"{d['propose_ms'] / base:.2f} target decode steps ({d['propose_ms'] / k / base:.2f} per drafted token); "
              f"at this (random) acceptance {d['acceptance']:.2f}: {d['spec_ms_per_token']:.2f} ms/token")
    return out



def plot(results: dict, path: Path) -> None:
    """Speedup against acceptance at batch 1 (the mechanics' curve), where matplotlib is installed."""
    try:
        import matplotlib
    except ImportError:
        print("(no plot: matplotlib is not installed)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in results["e2e"] if r["batch"] == 1), key=lambda r: r["acceptance"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["acceptance"] for r in rows], [r["speedup"] for r in rows], "o-",
            label=f"k={results.get('k', 4)}, batch 1")
    for b in sorted({r["batch"] for r in results["e2e"]} - {1}):
        forced = {}  # speculation forced on: the first run of each acceptance asked for
        for r in results["e2e"]:
            if r["batch"] == b and r["disable_by_batch_size"] == b:
                forced.setdefault(r["acceptance_asked"], r)
        forced = sorted(forced.values(), key=lambda r: r["acceptance"])
        ax.plot([r["acceptance"] for r in forced], [r["speedup"] for r in forced], ".--", label=f"batch {b}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("acceptance rate (proposed tokens kept)")
    ax.set_ylabel("speedup over no speculation")
    ax.set_title(f"{results['model']} {results.get('dtype', '')}, {results['gpu']}, {results['date']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


SOT_QUESTIONS = ["What are the most effective ways to deal with stress?",
                 "How can I improve my time management skills?",
                 "What are the main differences between Python and JavaScript?",
                 "What should I consider when buying a used car?"]


def sot(args) -> dict:
    from flashpage import LLM

    llm = LLM(args.model, **({"dtype": "float32"} if args.device == "cpu" else {}), device=args.device)
    plain_params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.skeleton_of_thought(SOT_QUESTIONS[0])  # warm-up
    rows = []
    print(f"{'question':62s} {'SoT s':>6s} {'tokens':>6s} {'points':>6s} {'expanded':>8s} {'plain s':>7s} {'tokens':>6s}")
    for q in SOT_QUESTIONS:
        start = time.perf_counter()
        out = llm.skeleton_of_thought(q)
        sot_s = time.perf_counter() - start
        sot_tokens = len(out.skeleton_output.outputs[0].token_ids) + sum(len(o.outputs[0].token_ids)
                                                                        for o in out.point_outputs)
        start = time.perf_counter()
        plain = llm.chat([{"role": "user", "content": q}], plain_params, use_tqdm=False)[0].outputs[0]
        plain_s = time.perf_counter() - start
        row = {"question": q, "sot_s": sot_s, "skeleton_s": out.skeleton_s, "expand_s": out.expand_s,
               "sot_tokens": sot_tokens, "points": len(out.points), "expanded": sum(1 for e in out.expansions if e),
               "plain_s": plain_s, "plain_tokens": len(plain.token_ids), "plain_finish": plain.finish_reason,
               "sot_text": out.text}
        rows.append(row)
        print(f"{q:62s} {sot_s:6.2f} {sot_tokens:6d} {row['points']:6d} {row['expanded']:8d} {plain_s:7.2f} "
              f"{row['plain_tokens']:6d}", flush=True)
    return {"model": args.model, "device": str(llm.engine.runner.device), "max_tokens": args.max_tokens, "rows": rows}


def trees(args) -> dict:
    from flashpage import LLM
    from flashpage.bench.common import median_ms
    from flashpage.kernels.tree import breadth_first_tree, depths, tree_mask
    from flashpage.model.attention import AttentionMetadata

    prompt_len = args.input_len
    llm = LLM(args.model, load_format="dummy", dtype=args.dtype, enforce_eager=True,
              max_model_len=prompt_len + 80, num_gpu_blocks=-(-(prompt_len + 80) // 16))
    runner = llm.engine.runner
    model, caches, dev = runner.model, runner.kv_caches, runner.device
    table = torch.arange(runner.num_blocks, dtype=torch.int32, device=dev)[None, :]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(model.config.vocab_size, (prompt_len,), generator=gen).to(dev)
    keep = []  # the tensors a captured graph reads

    def meta(n, positions, bits, first=prompt_len):
        """n new tokens after `first` cached ones, in slots first.. (a tree's nodes in order)."""
        cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
        lens = torch.tensor([first + n], dtype=torch.int32, device=dev)
        return AttentionMetadata(cu, lens, n, positions, torch.arange(first, first + n, device=dev), table,
                                 query_mask=bits)

    def graphed(tokens, positions, bits):
        m = meta(tokens.numel(), positions, bits)
        keep.append((tokens, m))
        run = lambda: model.compute_logits(model(tokens, m, caches))  # noqa: E731
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = run()
        return graph, logits

    def alone(path):  # a path's own forward, no cache
        return model.compute_logits(model(path, AttentionMetadata.prefill([path.numel()], dev))[-1:]).float()[0]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    out = {"gpu": torch.cuda.get_device_name(), "model": args.model, "dtype": args.dtype, "input_len": prompt_len,
           "trees": []}
    with torch.inference_mode():
        model(prompt, meta(prompt_len, torch.arange(prompt_len, device=dev), None, first=0), caches)
        graph, _ = graphed(prompt[:1], torch.tensor([prompt_len], device=dev), None)
        out["decode_ms"] = plain = median_ms(graph.replay)
        print(f"plain decode step: {plain:.3f} ms")
        print(f"{'nodes':>5s} {'branching':>9s} {'depth':>5s} {'ms':>7s} {'vs decode':>9s} {'node vs path':>12s} "
              f"{'causal vs path':>14s}")
        for nodes in (16, 32, 64):
            for branching in (1, 2, 4):
                parents = breadth_first_tree(nodes, branching)
                depth = depths(parents)
                tokens = torch.randint(model.config.vocab_size, (nodes,), generator=gen).to(dev)
                positions = torch.tensor([prompt_len + d for d in depth], device=dev)
                bits = torch.tensor(tree_mask(parents), dtype=torch.int64, device=dev)
                graph, logits = graphed(tokens, positions, bits)
                ms = median_ms(graph.replay)
                graph.replay()
                logits = logits.float()
                leaf = nodes - 1  # the deepest node's path, checked against its own forward
                path_nodes = [leaf]
                while parents[path_nodes[0]] >= 0:
                    path_nodes.insert(0, parents[path_nodes[0]])
                path = torch.cat([prompt, tokens[path_nodes]])
                expected = alone(path)
                k = len(path_nodes)
                causal = model.compute_logits(model(tokens[path_nodes], meta(k, torch.arange(
                    prompt_len, prompt_len + k, device=dev), None), caches)[-1:]).float()[0]
                row = {"nodes": nodes, "branching": branching, "depth": max(depth), "ms": ms, "vs_decode": ms / plain,
                       "node_vs_path": rel(logits[leaf], expected), "causal_vs_path": rel(causal, expected)}
                out["trees"].append(row)
                print(f"{nodes:5d} {branching:9d} {row['depth']:5d} {ms:7.3f} {ms / plain:8.2f}x "
                      f"{row['node_vs_path']:12.2e} {row['causal_vs_path']:14.2e}", flush=True)
    return out


def heads(args) -> dict:
    """Medusa heads and EAGLE / EAGLE-3 drafts on random `llama-3-8b` weights (bf16, batch 1): random heads accept
    nothing meaningful, so this shows the mechanics: the time of a speculating step (proposing, then verifying
    the tree as a CUDA graph) against a plain decode step, and the speedup it would give were every proposal
    right, (depth + 1) x plain / step."""
    from flashpage import LLM
    from flashpage.engine.spec.medusa import MedusaHeads
    from flashpage.engine.spec.medusa_train import save_medusa
    from safetensors.torch import save_file

    cuda = args.device != "cpu"
    max_len = args.input_len + args.max_tokens + 80
    llm = LLM(args.model, load_format="dummy", dtype=args.dtype if cuda else "float32", device=args.device,
              max_model_len=max_len, max_num_seqs=1, num_gpu_blocks=4 * -(-max_len // 16))
    c, dev = llm.config, llm.engine.runner.device
    dtype = llm.engine.runner.dtype
    gen = torch.Generator(device=dev).manual_seed(0)
    root = Path(args.heads or "/tmp/flashpage-random-heads")
    medusa_dir, eagle_dir, eagle3_dir = root / "medusa", root / "eagle", root / "eagle3"
    with torch.no_grad():
        if not (medusa_dir / "config.json").exists():
            m = MedusaHeads(c.hidden_size, c.vocab_size, args.k, 1, False).to(dev, dtype)
            for p_ in m.parameters():
                p_.normal_(0, 0.02, generator=gen)
            save_medusa(m, medusa_dir, dtype)
            del m
        h, inter = c.hidden_size, c.intermediate_size
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        layer = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
        config = {"architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": inter,
                  "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                  "head_dim": c.head_dim, "vocab_size": c.vocab_size, "num_hidden_layers": 1, "rope_theta": c.rope_theta,
                  "rope_scaling": c.rope_scaling, "rms_norm_eps": c.rms_norm_eps,
                  "max_position_embeddings": c.max_position_embeddings}

        def write_random(path: Path, shapes: dict, ones: tuple[str, ...], extra: dict, config: dict) -> None:
            if (path / "config.json").exists():
                return
            tensors = {n: torch.empty(s_, device=dev, dtype=dtype).normal_(0, 0.02, generator=gen).cpu()
                       for n, s_ in shapes.items()}
            tensors.update({n: torch.ones(h, dtype=dtype) for n in ones}, **extra)
            path.mkdir(parents=True, exist_ok=True)
            save_file(tensors, path / "model.safetensors")
            (path / "config.json").write_text(json.dumps(config))

        write_random(eagle_dir, {"fc.weight": (h, 2 * h), **{f"layers.0.{n}": s_ for n, s_ in layer.items()}},
                     ("layers.0.post_attention_layernorm.weight",), {}, config)
        # EAGLE-3: three target layers fused, a 2 x hidden attention input, its own head over 32k of the tokens
        draft_vocab = min(32000, c.vocab_size)
        write_random(eagle3_dir, {"fc.weight": (h, 3 * h), "lm_head.weight": (draft_vocab, h),
                                  **{f"midlayer.{n}": (s_[0], 2 * h) if n.split(".")[1] in ("q_proj", "k_proj", "v_proj")
                                     else s_ for n, s_ in layer.items()}},
                     ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                      "midlayer.post_attention_layernorm.weight", "norm.weight"),
                     {"d2t": torch.zeros(draft_vocab, dtype=torch.int64)},
                     {**config, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab})
    prompts = torch.Generator().manual_seed(1)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def steps_timed(engine, params=greedy) -> tuple[float, int]:
        """Seconds and steps of one greedy request (a new random prompt: no prefix-cache hit)."""
        prompt = torch.randint(c.vocab_size, (args.input_len,), generator=prompts).tolist()
        sync()
        start, steps = time.perf_counter(), 0
        engine.add_request("r", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return time.perf_counter() - start, steps

    plain = engine_over(llm, max_num_seqs=1)
    steps_timed(plain)
    plain_s, plain_steps = steps_timed(plain)
    first_s, _ = steps_timed(plain, SamplingParams(temperature=0, max_tokens=1))
    plain_ms = (plain_s - first_s) / (plain_steps - 1) * 1e3
    del plain
    free_memory()
    print(f"plain decode: {plain_ms:.2f} ms/token (after the first token)")
    out = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "model": args.model, "dtype": str(dtype),
           "input_len": args.input_len, "output_len": args.max_tokens, "plain_ms_per_token": plain_ms, "runs": []}
    for name, spec in [("medusa, 4 heads, chain", {"method": "medusa", "model": str(medusa_dir), "tree_width": 1}),
                       ("medusa, 4 heads, 16-node tree", {"method": "medusa", "model": str(medusa_dir)}),
                       ("medusa, 4 heads, 63-node tree", {"method": "medusa", "model": str(medusa_dir),
                                                         "tree_width": 16}),
                       ("eagle, depth 4, chain", {"method": "eagle", "model": str(eagle_dir),
                                                  "num_speculative_tokens": args.k, "tree_width": 1}),
                       ("eagle, depth 4, 16-node tree", {"method": "eagle", "model": str(eagle_dir),
                                                         "num_speculative_tokens": args.k}),
                       ("eagle3, depth 4, chain", {"method": "eagle3", "model": str(eagle3_dir),
                                                   "num_speculative_tokens": args.k, "tree_width": 1}),
                       ("eagle3, depth 4, 16-node tree", {"method": "eagle3", "model": str(eagle3_dir),
                                                          "num_speculative_tokens": args.k}),
                       (f"draft {args.draft}, depth 4, 16-node tree", {"model": args.draft, "tree_width": 4,
                                                                      "num_speculative_tokens": args.k})]:
        if spec.get("model") is None:
            continue
        engine = engine_over(llm, max_num_seqs=1, speculative_config=spec, load_format="dummy")
        steps_timed(engine)  # warm-up: the draft's kernels compile for these shapes
        total_s, steps = steps_timed(engine)
        stats = engine.stats()
        step_ms = (total_s - first_s) / (steps - 1) * 1e3
        depth = engine.spec.num_speculative_tokens
        r = {"name": name, "speculative_config": spec, "steps": steps, "step_ms": step_ms,
             "vs_decode": step_ms / plain_ms, "tokens_per_step": stats["spec_mean_accepted_length"],
             "full_acceptance_speedup": (depth + 1) * plain_ms / step_ms, "graphs": len(engine.runner.graphs)}
        out["runs"].append(r)
        print(f"{name:32s} step {step_ms:6.2f} ms = {r['vs_decode']:.2f}x a decode step, "
              f"{r['tokens_per_step']:.2f} tokens/step (random weights); at full acceptance "
              f"{r['full_acceptance_speedup']:.2f}x", flush=True)
        del engine
        free_memory()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashpage bench spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=["real", "medusa", "heads", "mechanics", "trees", "sot", "plot"], nargs="?",
                   default="real",
                   help="plot: the curve of a mechanics JSON (--out) as a PNG beside it")
    p.add_argument("--model", default=None, help="real: the default model; mechanics, trees: llama-3-8b (dummy)")
    p.add_argument("--device", default="auto")
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 8}')
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--k", type=int, default=4, help="mechanics: num_speculative_tokens; medusa: heads trained")
    p.add_argument("--heads", type=Path, default=None, help="medusa: the heads' directory (trained there if empty; "
                   "default /tmp/flashpage-medusa-heads)")
    p.add_argument("--train-steps", type=int, default=400, help="medusa: training steps (batches of 256 positions)")
    p.add_argument("--acceptance", default="1,0.9,0.8,0.7,0.6,0.5,0.4,0.2,0")
    p.add_argument("--batch-sizes", default="1,4,16,32,64")
    p.add_argument("--dtype", default="bfloat16", help="mechanics: the weights' dtype (float32: the oracle's answers "
                   "survive the rounding differences between decode and verify steps, see the suite's notes)")
    p.add_argument("--skip-verify-steps", action="store_true", help="mechanics: leave out part 1")
    p.add_argument("--cpu-dtype", default="float32", help="real, sot, medusa on a CPU: the model's dtype (auto: "
                   "what LLM picks there, e.g. bfloat16 and a GGUF's 4-bit blocks on a CPU with AMX)")
    p.add_argument("--draft", default=None, help="mechanics, heads: a draft model preset (dummy weights), e.g. "
                   "llama-3.2-1b")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.suite == "plot":
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return 0
    if args.suite in ("real", "sot", "medusa"):
        from flashpage.loader.default_model import DEFAULT_MODEL, resolve_known_model

        args.model = args.model or str(resolve_known_model(DEFAULT_MODEL))
        args.device = "cuda" if args.device == "auto" and torch.cuda.is_available() else \
            "cpu" if args.device == "auto" else args.device
        results = {"real": real, "sot": sot, "medusa": medusa}[args.suite](args)
    else:
        args.model = args.model or "llama-3-8b"
        results = {"mechanics": mechanics, "trees": trees, "heads": heads}[args.suite](args)
    results["date"] = time.strftime("%Y-%m-%d")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        if args.suite == "mechanics":
            plot(results, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
