"""The engine in a process of its own (what `flashpage serve` runs): its outputs cross the pipe as deltas and come
out equal to the engine's own; load errors reach the caller; a dead engine process fails what was open."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal

import pytest
import torch

from conftest import wait_until
from flashpage import SamplingParams
from flashpage.engine.config import EngineConfig
from flashpage.engine.llm_engine import LLMEngine
from flashpage.kernels.sampling import num_chunks
from flashpage.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from flashpage.server.async_engine import AsyncEngine
from flashpage.server.engine_core import DeltaDecoder, DeltaEncoder, EngineProcess

SETTINGS = {"model": "smollm2-135m", "load_format": "dummy", "dtype": "float32", "device": "cpu", "max_model_len": 128}


def test_deltas_rebuild_every_output_exactly():
    """Random histories of several requests (n samples each), whose texts grow by steps that may end by cutting
    them short (a stop string found in text already sent): the decoder's outputs equal the encoder's inputs."""
    rng = random.Random()
    enc, dec = DeltaEncoder(), DeltaDecoder()
    live = {f"r{i}": [("", [], []) for _ in range(rng.randint(1, 3))] for i in range(5)}
    while live:
        for rid in rng.sample(sorted(live), rng.randint(1, len(live))):
            samples = []
            for text, ids, lps in live[rid]:
                for _ in range(rng.randint(0, 3)):
                    t = rng.randrange(1000)
                    text, ids = text + rng.choice(["a", " b", "ç", "", "\n"]), ids + [t]
                    lps = lps + [{t: Logprob(-rng.random(), 1, str(t))}]
                if rng.random() < 0.15 and text:  # then cut short, perhaps below what was sent
                    text, keep = text[:rng.randrange(len(text))], rng.randrange(len(ids) + 1)
                    ids, lps = ids[:keep], lps[:keep]
                samples.append((text, ids, lps))
            live[rid] = samples
            finished = rng.random() < 0.2
            out = RequestOutput(rid, "p", [1, 2], [CompletionOutput(i, t, list(ids), "stop" if finished else None,
                                                                    None, -1.0, list(lps))
                                                   for i, (t, ids, lps) in enumerate(samples)],
                                finished, [None, {2: Logprob(-0.5)}], RequestMetrics(1.0, 2.0))
            assert dec.apply(rid, enc.encode(out)) == out
            if finished:
                del live[rid]
    assert not enc._sent and not dec._latest  # nothing kept of finished requests


@pytest.fixture(scope="module")
def engine_process():
    core = EngineProcess(SETTINGS)
    engine = AsyncEngine(core, max_waiting=8)
    yield engine
    engine.shutdown()


async def _run(engine: AsyncEngine, requests: dict, stream: bool = True) -> dict[str, RequestOutput]:
    async def one(rid, ids, params):
        async for update in engine.generate(rid, ids, params, stream=stream):
            last = update.output
        return rid, last
    return dict(await asyncio.gather(*(one(rid, ids, p) for rid, (ids, p) in requests.items())))


def wait_idle(engine: AsyncEngine) -> None:
    wait_until(lambda: (s := engine.stats)["num_running"] == s["num_waiting"] == s["kv_slots_allocated"] == 0)


def test_engine_process_outputs_equal_the_engine_in_this_process(engine_process):
    rng = random.Random()
    requests = {f"q{i}": ([rng.randrange(1, 40000) for _ in range(rng.randint(1, 20))],
                          SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, n=1 + i % 3, logprobs=i % 3,
                                         max_tokens=rng.randint(1, 12), ignore_eos=True))
                for i in range(6)}
    here = AsyncEngine(LLMEngine(EngineConfig.from_settings(**SETTINGS)))
    try:
        want = asyncio.run(_run(here, requests))
    finally:
        here.shutdown()
    for stream in (True, False):
        got = asyncio.run(_run(engine_process, requests, stream))
        for rid in requests:
            flat = [[(o.index, t, lp.logprob) for o in out[rid].outputs for e in o.logprobs for t, lp in e.items()]
                    for out in (got, want)]
            assert [x[:2] for x in flat[0]] == [x[:2] for x in flat[1]]
            assert [x[2] for x in flat[0]] == pytest.approx([x[2] for x in flat[1]], abs=1e-4)
            assert [(o.token_ids, o.finish_reason) for o in got[rid].outputs] == \
                [(o.token_ids, o.finish_reason) for o in want[rid].outputs]
            assert got[rid].finished and got[rid].prompt_token_ids == requests[rid][0]
    wait_idle(engine_process)  # (the statistics come just after a step's outputs)


def test_bad_input_is_refused_here_and_the_engine_goes_on(engine_process):
    with pytest.raises(ValueError, match="max_model_len=128"):
        engine_process.validate([1] * 100, SamplingParams(max_tokens=64))
    out = asyncio.run(_run(engine_process, {"ok": ([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))}))
    assert len(out["ok"].outputs[0].token_ids) == 3


def test_load_error_is_raised_by_the_constructor():
    with pytest.raises(ValueError, match="no-such-model"):
        EngineProcess({**SETTINGS, "model": "no-such-model", "load_format": "auto"})


def test_a_dead_engine_process_fails_open_requests_and_refuses_new_ones():
    core = EngineProcess(SETTINGS)
    engine = AsyncEngine(core)

    async def main():
        async def long():
            async for _ in engine.generate("long", [1, 2], SamplingParams(max_tokens=120, ignore_eos=True)):
                pass
        task = asyncio.create_task(long())
        while engine.stats["num_running"] == 0:
            await asyncio.sleep(0.05)
        os.kill(core._proc.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="engine process exited"):
            await task
        with pytest.raises(Exception, match="engine process exited"):
            async for _ in engine.generate("late", [1], SamplingParams(max_tokens=1)):
                pass
    asyncio.run(main())
    assert engine.failed is not None
    engine.shutdown()


def test_warm_up_leaves_the_engine_idle_and_serving():
    engine = LLMEngine(EngineConfig.from_settings(**SETTINGS, max_num_seqs=8))
    step, tokens = engine.runner.step, []
    engine.runner.step = lambda plan, *a: tokens.append(sum(len(s.token_ids) for s in plan.seqs)) or step(plan, *a)
    engine.warm_up()
    engine.runner.step = step
    # the prompt of 100 tokens alone in its step, and the one of 150 (cut to this context of 128) beside the first
    # decoding: the FP8 kernel's row classes
    assert {100, 127 + 1} <= set(tokens)
    s = engine.stats()
    assert s["num_running"] == s["num_waiting"] == s["kv_slots_allocated"] == 0 and not engine.requests
    assert s["prefix_cache_hits"] > 0  # (its last wave's prompt began with a cached block)
    engine.add_request("after", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs[-1].outputs[0].token_ids) == 2
    for tiny in ({"max_model_len": 2}, {"max_model_len": 64, "num_gpu_blocks": 2}):  # (what fits, or nothing)
        small = LLMEngine(EngineConfig.from_settings(**{**SETTINGS, **tiny}))
        small.warm_up()
        assert not small.requests and small.stats()["kv_slots_allocated"] == 0


def test_warm_up_on_a_gpu_also_prefills_a_long_prompt_and_samples_every_kernel_variant(monkeypatch):
    """(The Hopper prefill's tiles for long items compile then, not at a server's first long prompt; so do the
    sampling kernels of every chunk count and filter use, not at the first request with the default sampling; and
    the decode kernel as a mixed step runs it, decoding sequences first beside a prompt: `DecodeSplit`,
    tests/test_mixed_steps.py.) On a CPU the warm-up stops short of the first two; the GPU's is simulated by the
    device name, which only the warm-up reads here."""
    for device, longest in (("cpu", 150), ("cuda", 2048)):
        engine = LLMEngine(EngineConfig.from_settings(**{**SETTINGS, "max_model_len": 2100}))
        engine.cfg = dataclasses.replace(engine.cfg, device=device)
        step, ends, mixed = engine.runner.step, [], []  # where each step's prompt chunks end; mixed steps

        def leading_decodes(seqs):  # decoding sequences before the first prompt chunk (0: none, or no chunk)
            return next((i for i, s in enumerate(seqs) if len(s.token_ids) > 1), 0)
        engine.runner.step = lambda plan, *a: ends.extend(
            s.positions[-1] + 1 for s in plan.seqs if len(s.token_ids) > 1) or mixed.append(
            leading_decodes(plan.seqs)) or step(plan, *a)
        ops, drawn, penalised = engine.runner.model.ops, set(), set()
        sample, penalties, bitmask = ops.sample, ops.apply_penalties, ops.apply_token_bitmask

        def record(logits, *args, filtered, **kw):
            drawn.add((num_chunks(logits.shape[0], logits.shape[1], logits.device), filtered))
            return sample(logits, *args, filtered=filtered, **kw)
        monkeypatch.setattr(ops, "sample", record)
        monkeypatch.setattr(ops, "apply_penalties", lambda *a: penalised.add(a[2].numel()) or penalties(*a))
        monkeypatch.setattr(ops, "apply_token_bitmask", lambda *a: penalised.add("mask") or bitmask(*a))
        engine.warm_up()
        monkeypatch.undo()
        # mixed steps whose leading decoding sequences number 1 and more (two variants of the decode kernel)
        assert max(ends) == longest and 1 in mixed and max(mixed) > 1, mixed
        assert penalised == ({1, 16, 17, "mask"} if device == "cuda" else set())
        vocab, dev = engine.config.vocab_size, engine.runner.device
        every = {(num_chunks(rows, vocab, dev), f) for rows in range(1, engine.cfg.max_num_batched_tokens + 1)
                 for f in (False, True)}
        assert (drawn >= every) == (device == "cuda"), drawn  # (on this CPU: 2 chunks up to 16 rows, 1 above)


def test_sampling_warm_up_verifies_drafts_where_a_draft_model_proposes(monkeypatch):
    from flashpage.engine.sampler import warm_up_sampling
    from flashpage.kernels import reference
    calls = []
    monkeypatch.setattr(reference, "sample", lambda logits, *a, filtered, draft_tokens=None, draft_probs=None:
                        calls.append((logits.shape[0], filtered, draft_tokens is not None)))
    monkeypatch.setattr(reference, "apply_penalties", lambda *a: None)
    monkeypatch.setattr(reference, "apply_token_bitmask", lambda *a: None)
    for drafts in (False, True):
        calls.clear()
        warm_up_sampling(reference, 4096, torch.device("cpu"), 20, drafts=drafts)
        # (on this CPU a row is cut in 2 up to 16 rows, in 1 above)
        assert sorted(calls) == sorted((rows, f, d) for rows in (1, 17) for f in (False, True)
                                       for d in ((False, True) if drafts else (False,)))


def test_sampling_chunk_classes_are_one_batch_per_kernel_variant(monkeypatch):
    """On an H100 (132 SMs) `sample` cuts a row into 64, 32, ... 2 pieces as the batch grows; a warm-up samples
    the smallest batch of each."""
    from flashpage.kernels import sampling
    monkeypatch.setattr(sampling, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    classes = sampling.chunk_classes(49152, cuda, 256)
    assert classes == [1, 9, 17, 33, 66, 132]
    assert [sampling.num_chunks(b, 49152, cuda) for b in classes] == [64, 32, 16, 8, 4, 2]
    assert sampling.num_chunks(8, 49152, cuda) == 64 and sampling.num_chunks(256, 49152, cuda) == 2
    assert sampling.chunk_classes(3000, cuda, 4) == [1]  # at most one piece per 1,024-wide tile: 4
