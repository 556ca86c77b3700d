"""The paged engine: continuous batching, chunked prefill, preemption, prefix caching, sampling, beam search."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import chi2_limit, engine_from
from flashpage import BeamSearchParams, SamplingParams
from flashpage.config import ModelConfig
from flashpage.engine.config import EngineConfig
from flashpage.engine.llm_engine import LLMEngine
from flashpage.kernels import reference as ref
from flashpage.loader import LoadedModel, build_empty, init_dummy_weights


def tiny_engine(max_model_len: int = 4096, seed: int = 0, device: str = "cpu", vocab_size: int = 512,
                **cfg) -> LLMEngine:
    """A small random model with a long context and no EOS: fast, and lengths are exactly as asked."""
    config = ModelConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=max_model_len)
    model = build_empty(config, torch.float32, torch.device(device))
    init_dummy_weights(model, seed)
    return LLMEngine(EngineConfig(max_model_len=max_model_len, device=device, **cfg), LoadedModel(config, model, None))


def run(engine: LLMEngine, prompts: list[list[int]], params, on_step=None):
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params):
        engine.add_request(rid, p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if on_step:
            on_step(engine)
    return [done[r] for r in ids]


def mixed_workload():
    """Requests that exercise every path of a step: chunked prompts, n > 1, seeds, stops, logprobs, penalties."""
    rng = random.Random(int(torch.randint(1 << 30, ())))
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 7, 40, 90, 16, 33, 5, 64)]
    params = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0.8, seed=3, max_tokens=20),
              SamplingParams(temperature=1.0, top_k=20, seed=7, n=3, max_tokens=9),
              SamplingParams(temperature=0, max_tokens=30, logprobs=3, stop_token_ids=[prompts[0][0]]),
              SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=17, min_tokens=5),
              SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.2, frequency_penalty=0.3, max_tokens=14),
              SamplingParams(temperature=0, max_tokens=1), SamplingParams(temperature=0.5, min_p=0.1, seed=2, max_tokens=25)]
    return prompts, params


def summary(outs):
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]


def test_overlapped_steps_give_the_outputs_of_steps_read_back_at_once():
    """With overlap the host schedules step N+1 before step N's tokens are back (they are PENDING, read on the
    device); every output, finish reason and logprob must equal the one-step-at-a-time engine's."""
    prompts, params = mixed_workload()
    want = run(tiny_engine(overlap=False, max_num_batched_tokens=48, num_gpu_blocks=40, block_size=8), prompts, params)
    engine = tiny_engine(overlap=True, max_num_batched_tokens=48, num_gpu_blocks=40, block_size=8)
    got = run(engine, prompts, params)
    assert summary(got) == summary(want)
    assert engine.bm.num_free_blocks == engine.bm.num_blocks and engine.in_flight is None


def test_final_only_steps_give_the_same_finished_outputs_and_nothing_else():
    """`step(final_only=True)` (what `LLM.generate` reads) skips the outputs of unfinished requests; the finished
    ones equal those of plain steps, each once, and the engine ends as clean."""
    prompts, params = mixed_workload()
    want = run(tiny_engine(max_num_batched_tokens=48, num_gpu_blocks=40, block_size=8), prompts, params)
    engine = tiny_engine(max_num_batched_tokens=48, num_gpu_blocks=40, block_size=8)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    got = []
    while engine.has_unfinished_requests():
        got += engine.step(final_only=True)
    assert all(o.finished for o in got) and len(got) == len(prompts)
    assert summary(sorted(got, key=lambda o: int(o.request_id[1:]))) == summary(want)
    assert engine.bm.num_free_blocks == engine.bm.num_blocks and not engine.requests and not engine.seqs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decode_equals_eager():
    """Graphs split long key ranges by the captured table width, eager steps by the batch's: rounding differs, so
    the weights are scaled up until greedy margins dwarf it; tokens must then agree exactly, logprobs closely."""
    prompts, params = mixed_workload()
    prompts += [[i % 500 for i in range(n)] for n in range(3, 40)]  # enough sequences for several graph sizes
    params += [SamplingParams(temperature=0, max_tokens=10 + n % 7) for n in range(3, 40)]
    engines = []
    for eager in (True, False):
        engine = tiny_engine(device="cuda", enforce_eager=eager)
        with torch.no_grad():
            for p in engine.runner.model.parameters():
                p.mul_(6)
        engines.append(engine)
    assert engines[1].runner.graphs and not engines[0].runner.graphs
    want, got = (run(e, prompts, params) for e in engines)
    strip = lambda outs: [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]  # noqa: E731
    assert strip(got) == strip(want)
    for a, b in zip(got, want):  # the chosen tokens' logprobs (top-k lists may swap near-ties)
        for ca, cb in zip(a.outputs, b.outputs):
            assert (ca.logprobs is None) == (cb.logprobs is None)
            for t, da, db in zip(ca.token_ids, ca.logprobs or [], cb.logprobs or []):
                assert da[t].logprob == pytest.approx(db[t].logprob, rel=1e-2, abs=1e-2)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures GPU memory")
def test_cache_leaves_room_for_the_largest_steps():
    """The runner measures a full step's memory before it sizes the cache: a cache that fills the device to
    gpu_memory_utilization must leave room for a step of max_num_batched_tokens tokens over max_num_seqs sampled
    sequences (here 1,024 rows of a 128k vocabulary drawn with top-p), and for the CUDA graphs."""
    util = 0.995
    engine = tiny_engine(max_model_len=1 << 19, device="cuda", gpu_memory_utilization=util, max_num_seqs=1024,
                         max_num_batched_tokens=16384, vocab_size=128256)
    assert engine.runner.num_blocks < 1024 * (1 << 19) // 16  # the device's memory, not the sequences, bounds it
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    other = total - free - torch.cuda.memory_reserved()  # the CUDA context, libraries' workspaces
    torch.cuda.reset_peak_memory_stats()
    outs = run(engine, [[i % 500] * 16 for i in range(1024)], SamplingParams(temperature=1.0, top_p=0.9,
                                                                            max_tokens=3, seed=1))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3] * 1024
    used = other + torch.cuda.max_memory_allocated()
    assert used <= util * total, f"{used / 2**30:.2f} GiB used at the peak, {util * total / 2**30:.2f} allowed"

TEXTS = [
    "Hi", "The capital of France is", "1 2 3 4 5 6", "Once upon a time, in a land far away, there lived a wise old owl who",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot =",
    "The mitochondria is", "Translate to French: good morning ->", "A", "List three colours: red,",
    "In 1969, the first humans landed on the Moon. The mission was called", "Q: What is 7 times 8?\nA:",
    " ".join(["The quick brown fox jumps over the lazy dog."] * 12), "Water boils at",
    "Dear hiring manager, I am writing to apply for the position of", "import numpy as np\nx = np.",
    "Roses are red, violets are blue,",
]


def test_batched_chunked_preempted_greedy_equals_alone_and_transformers(smollm_llm, smollm_hf):
    tok = smollm_llm.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    assert len(prompts) >= 16 and min(map(len, prompts)) == 1 and max(map(len, prompts)) > 100
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    engine = engine_from(smollm_llm, max_num_batched_tokens=32, num_gpu_blocks=12)  # the longest request needs 9
    outs = run(engine, prompts, params)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["kv_slots_allocated"] == 0
    alone = smollm_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out, single in zip(prompts, outs, alone):
        with torch.no_grad():
            ref = smollm_hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16,
                                     do_sample=False)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref, tok.decode(p)
        assert single.outputs[0].token_ids == ref


def test_prefix_caching_hits_and_identical_outputs(smollm_llm):
    system = "You are a meticulous assistant. " * 12
    prompts = [system + q for q in ["What is 2+2?", "Name a fruit.", "Say hello.", "Count to three."]]
    params = SamplingParams(temperature=0, max_tokens=8)
    engine = engine_from(smollm_llm, enable_prefix_caching=True)
    first = run(engine, [smollm_llm.tokenizer.encode(p) for p in prompts], params)
    before = engine.stats()
    second = run(engine, [smollm_llm.tokenizer.encode(p) for p in prompts], params)
    after = engine.stats()
    prefix_tokens = len(smollm_llm.tokenizer.encode(system)) // 16 * 16
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= len(prompts) * (prefix_tokens - 16)
    assert after["prefix_cache_hits"] <= after["prefix_cache_queries"]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    uncached = run(engine_from(smollm_llm, enable_prefix_caching=False), [smollm_llm.tokenizer.encode(p) for p in prompts], params)
    assert [o.outputs[0].token_ids for o in uncached] == [o.outputs[0].token_ids for o in first]


def test_parallel_sampling_shares_prompt_blocks():
    engine = tiny_engine()
    prompt = random.Random(0).choices(range(512), k=300)
    ratios = []

    def measure(eng):
        seqs = eng.requests["r0"].seqs if "r0" in eng.requests else []
        if len(seqs) == 8 and all(not s.finished for s in seqs):
            unshared = sum(-(-len(s.token_ids) // 16) * 16 for s in seqs)
            ratios.append(eng.stats()["kv_slots_allocated"] / unshared)

    out = run(engine, [prompt], SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=24), on_step=measure)[0]
    assert len(out.outputs) == 8 and [o.index for o in out.outputs] == list(range(8))
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # the samples differ
    assert ratios and max(ratios) <= 0.45, max(ratios)
    assert engine.stats()["kv_slots_allocated"] == 0


def test_samples_forked_off_a_chunked_prompt_start_on_the_next_step():
    """n > 1 on a prompt longer than a step's budget: the samples forked off at the prompt's last chunk start
    decoding on the next step, from their own first token (they once decoded in the same step, from whatever row
    of the previous step their token's row number named). Same seeds, same outputs as an unchunked run."""
    prompts = [list(range(3, 13)), random.Random(0).choices(range(512), k=70)]
    params = [SamplingParams(temperature=1.0, seed=4, max_tokens=8), SamplingParams(n=3, temperature=1.0, seed=9,
                                                                                     max_tokens=8)]
    whole = run(tiny_engine(), prompts, params)
    chunked = run(tiny_engine(max_num_batched_tokens=32), prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in chunked] == [[c.token_ids for c in o.outputs] for o in whole]


def test_internal_waste_under_4_percent_on_mixed_workload():
    rng = random.Random(1)
    engine = tiny_engine(max_num_seqs=16)
    prompts = [rng.choices(range(512), k=rng.randint(100, 1200)) for _ in range(20)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(10, 60)) for _ in prompts]
    waste = []

    def measure(eng):
        s = eng.stats()
        if s["num_running"] >= 4:
            waste.append((s["kv_slots_allocated"] - s["kv_tokens_stored"]) / s["kv_slots_allocated"])

    run(engine, prompts, params, on_step=measure)
    assert waste and sum(waste) / len(waste) < 0.04 and max(waste) < 0.06, (sum(waste) / len(waste), max(waste))


def test_seeded_requests_do_not_depend_on_the_batch():
    target = [5, 17, 300, 42, 9]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20)
    alone = run(tiny_engine(), [target], params)[0].outputs[0].token_ids
    crowd = [[1, 2, 3], target, list(range(40)), [7] * 9]
    crowd_params = [SamplingParams(temperature=1.0, max_tokens=30), params,
                    SamplingParams(temperature=1.0, seed=5, max_tokens=12), SamplingParams(temperature=0, max_tokens=7)]
    together = run(tiny_engine(max_num_batched_tokens=16), crowd, crowd_params)[1].outputs[0].token_ids
    other_seed = run(tiny_engine(), [target], SamplingParams(**{**params.__dict__, "seed": 99}))[0].outputs[0].token_ids
    assert alone == together and alone != other_seed


def expected_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """The filtered softmax, written out the slow way (float64)."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = sorted(range(len(p)), key=lambda i: -p[i].item())
    keep, mass = [], 0.0
    for rank, i in enumerate(order):
        if (top_k > 0 and rank >= top_k) or (rank > 0 and mass >= top_p) or (rank > 0 and p[i] < min_p * p[order[0]]):
            continue
        keep.append(i)
        mass += p[i].item()
    q = torch.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0),
                                                           (1.0, 0, 1.0, 0.1), (0.8, 8, 0.9, 0.05)])
def test_reference_sampler_matches_filtered_softmax_chi_square(temperature, top_k, top_p, min_p):
    """The PyTorch reference sampler (the CPU path; the Triton one is checked against it in test_fused_kernels)."""
    logits = torch.randn(12) * 1.5
    n = 20000
    full = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    seeds = torch.randint(2**62, (n,))
    tokens, _ = ref.sample(logits.expand(n, -1).contiguous(), full(temperature, torch.float32),
                           full(top_k or 12, torch.int32), full(top_p, torch.float32), full(min_p, torch.float32), seeds)
    counts = torch.bincount(tokens, minlength=12).double()
    expected = expected_distribution(logits, temperature, top_k, top_p, min_p) * n
    assert counts[expected == 0].sum() == 0  # never a filtered-out token
    live = expected > 0
    chi2 = (((counts - expected)[live]) ** 2 / expected[live]).sum().item()
    assert chi2 <= chi2_limit(int(live.sum()) - 1)


def test_filter_probs_keeps_top_token():
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    assert ref.filter_probs(probs, torch.tensor([1]), torch.tensor([0.1]), torch.tensor([0.0]))[0].tolist() == [0.5, 0, 0]


def test_stop_strings_across_token_boundaries_and_streaming_holdback(smollm_llm):
    prompt = "Once upon a time, in a land far away,"
    base = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    ids, tok = base.token_ids, smollm_llm.tokenizer
    # a stop string that starts inside one token and ends inside a later one
    cut = len(tok.decode(ids[:4]))
    stop = base.text[cut - 2:cut + 3]
    assert len(stop) == 5
    first = base.text.find(stop)
    out = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop, "zzzz"]), use_tqdm=False)
    assert out[0].outputs[0].text == base.text[:first]
    assert (out[0].outputs[0].finish_reason, out[0].outputs[0].stop_reason) == ("stop", stop)
    pieces = list(smollm_llm.stream(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop])))
    assert "".join(pieces) == base.text[:first]
    assert smollm_llm.stats()["num_running"] == 0


def assert_logprob_entries_match(entries, chosen, ref, k, tokenizer):
    """Each entry holds the chosen token first, then the true top-k under `ref` (rows of log-probabilities), every
    value, rank and decoded token as ref and the tokenizer have them."""
    assert len(entries) == len(chosen) == len(ref)
    for entry, token, row in zip(entries, chosen, ref):
        top = row.topk(k).indices.tolist()
        assert next(iter(entry)) == token and set(entry) == set(top) | {token}
        for t, lp in entry.items():
            assert isinstance(t, int) and abs(lp.logprob - row[t].item()) < 1e-4
            assert lp.rank == int((row > row[t]).sum()) + 1 and lp.decoded_token == tokenizer.decode([t], skip_special_tokens=False)


def test_logprobs_and_prompt_logprobs_match_transformers(smollm_llm, smollm_hf):
    ids = smollm_llm.tokenizer.encode("The largest planet in the solar system is Jupiter, and the smallest one is "
                                      "Mercury. The planet closest to the Sun is also Mercury, while the one "
                                      "farthest from it is Neptune. The hottest planet in the solar system is")
    assert len(ids) > 2 * 16  # two full blocks: the second run's prompt is in the prefix cache
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out, again = (smollm_llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0] for _ in range(2))
    gen = out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(smollm_hf(torch.tensor([ids + gen])).logits[0].double(), -1)
    tok = smollm_llm.tokenizer
    assert_logprob_entries_match(out.outputs[0].logprobs, gen, ref[len(ids) - 1:-1], 3, tok)
    assert abs(out.outputs[0].cumulative_logprob - sum(e[t].logprob for e, t in zip(out.outputs[0].logprobs, gen))) < 1e-6
    assert out.prompt_logprobs[0] is None
    assert_logprob_entries_match(out.prompt_logprobs[1:], ids[1:], ref[:len(ids) - 1], 2, tok)
    assert again.prompt_logprobs == out.prompt_logprobs and again.outputs[0].token_ids == gen


def reference_beam_search(model, prompt: list[int], width: int, steps: int) -> list[list[int]]:
    beams = [(prompt, 0.0)]
    with torch.no_grad():
        for _ in range(steps):
            cands = []
            for tokens, cum in beams:
                lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].double(), -1)
                top = lp.topk(2 * width)
                cands += [(tokens + [t], cum + v) for t, v in zip(top.indices.tolist(), top.values.tolist())]
            beams = sorted(cands, key=lambda c: c[1], reverse=True)[:width]
    return [b[0] for b in beams]


def test_beam_search_matches_reference_and_shares_blocks(tiny_checkpoints):
    from flashpage import LLM

    path, ref_model = tiny_checkpoints["llama-tied"]
    llm = LLM(str(path), dtype="float32", device="cpu")
    prompt = list(range(10, 50))  # 40 tokens: two full blocks to share between beams
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    want = reference_beam_search(ref_model, prompt, 3, 6)
    assert [s.tokens for s in out.sequences] == want
    # steps 2..6 each run 3 beams, and every one reuses the prompt's two full blocks (step 1 has one beam, cold)
    assert llm.stats()["prefix_cache_hits"] == 5 * 3 * 32


def test_abort_frees_blocks_and_never_fitting_requests_are_rejected():
    engine = tiny_engine(num_gpu_blocks=8)
    with pytest.raises(ValueError, match="needs up to 9 KV blocks"):
        engine.add_request("big", list(range(100)), SamplingParams(max_tokens=40))
    engine.add_request("a", list(range(50)), SamplingParams(max_tokens=50, temperature=0))
    engine.add_request("b", list(range(30)), SamplingParams(max_tokens=10, n=2, seed=1))
    for _ in range(5):
        engine.step()
    engine.abort_request("a")
    engine.abort_request("b")
    stats = engine.stats()
    assert stats["kv_slots_allocated"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    assert not engine.has_unfinished_requests()


def test_prompt_logprobs_of_a_prompt_prefilled_in_chunks(smollm_llm):
    """Every prompt token gets its log-prob once when the prompt is prefilled in chunks: the next chunk is planned
    while the last is still in flight (overlap), before its log-probs are read back (it once lost all but the
    first chunk's), and a prompt preempted mid-way is recomputed in chunks cut elsewhere (it once lost the rest)."""
    prompt = list(range(500, 800))
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, ignore_eos=True)
    whole = run(engine_from(smollm_llm), [prompt], params)[0].prompt_logprobs
    for settings in ({}, {"overlap": False}, {"num_gpu_blocks": 20}):
        engine = engine_from(smollm_llm, enable_prefix_caching=False, max_num_batched_tokens=64, **settings)
        outs = run(engine, [list(range(900, 916)), prompt], [SamplingParams(max_tokens=150, ignore_eos=True), params])
        chunked = outs[1].prompt_logprobs
        assert engine.stats()["num_preemptions"] > 0 or "num_gpu_blocks" not in settings
        assert len(chunked) == len(prompt) and chunked[0] is None
        assert [e[t].logprob for e, t in zip(chunked[1:], prompt[1:])] == \
            pytest.approx([e[t].logprob for e, t in zip(whole[1:], prompt[1:])], abs=1e-4)
