"""Tensor parallelism on CPU over gloo: N ranks (processes) give what one rank gives.

Every engine here with tensor_parallel_size > 1 starts its ranks as processes; each test shuts its engine down.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from conftest import TINY, randomize_, rel_err

from flashpage import LLM, BeamSearchParams, SamplingParams
from flashpage.parallel.workers import WorkerFailed

PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 1, 42], [300], list(range(20, 57))]  # odd lengths, one token


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory, smollm_gguf):
    """name -> directory: GQA (8 query / 2 KV heads), MQA with QKV bias (1 KV head), tied embeddings with a
    vocabulary no rank count divides (387), and a chat model (SmolLM2's tokenizer and vocabulary)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    out = {"gqa": tiny_checkpoints["llama3-rope-scaling"][0], "mqa": tiny_checkpoints["qwen2-bias"][0]}
    for name, cfg in {"tied-387": LlamaConfig(**{**TINY, "vocab_size": 387}, tie_word_embeddings=True),
                      "chat": LlamaConfig(**{**TINY, "vocab_size": 49152})}.items():
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        randomize_(model, seed=7)
        out[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(out[name])
    AutoTokenizer.from_pretrained(str(smollm_gguf.parent), gguf_file=smollm_gguf.name).save_pretrained(out["chat"])
    return {name: str(path) for name, path in out.items()}


def run(llm: LLM, prompts, params, **kw):
    outs = llm.generate(prompts, params, use_tqdm=False, **kw)
    return [[(o.token_ids, o.cumulative_logprob) for o in out.outputs] for out in outs], outs


@pytest.mark.parametrize("name, size", [("gqa", 2), ("gqa", 4), ("mqa", 4), ("tied-387", 2)])
def test_ranks_give_the_tokens_and_logits_of_one(checkpoints, name, size):
    params = SamplingParams(max_tokens=10, temperature=0, prompt_logprobs=3, logprobs=3)
    results = {}
    for tp in (1, size):
        llm = LLM(checkpoints[name], dtype="float32", device="cpu", tensor_parallel_size=tp, seed=0)
        try:
            tokens, outs = run(llm, PROMPTS, params)
            results[tp] = tokens, outs, llm.engine.runner.last_logits.clone()
        finally:
            llm.shutdown()
        workers = llm.engine.workers
        # every rank left its loop and the group on its own (a terminated one exits with -SIGTERM)
        assert [p.exitcode for p in workers.processes] == [0] * (size - 1) if workers else tp == 1, \
            [p.exitcode for p in workers.processes]
    (tokens_1, outs_1, logits_1), (tokens_n, outs_n, logits_n) = results[1], results[size]
    assert [[t for t, _ in s] for s in tokens_n] == [[t for t, _ in s] for s in tokens_1]
    assert logits_n.shape == logits_1.shape and logits_1.shape[-1] == (387 if name == "tied-387" else 384)
    assert rel_err(logits_n, logits_1) < 1e-5
    for a, b in zip(outs_n, outs_1):  # prompt log-probs go through the gathered logits too
        for pos_a, pos_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert list(pos_a) == list(pos_b)
            assert [e.logprob for e in pos_a.values()] == pytest.approx([e.logprob for e in pos_b.values()], rel=1e-5)


def test_fp8_weights_under_two_ranks(checkpoints):
    """Each rank quantizes its shard as it loads (a row-parallel rank scales its part of each row by that part's
    largest magnitude, so the rounding differs from one rank's): two ranks' FP8 model is as close to the float32
    one as one rank's."""
    logits = {}
    for tp, quantization in ((1, None), (1, "fp8"), (2, "fp8")):
        llm = LLM(checkpoints["gqa"], device="cpu", tensor_parallel_size=tp, quantization=quantization)
        try:
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=1, temperature=0),
                         use_tqdm=False)
            logits[tp, quantization] = llm.engine.runner.last_logits.clone()
        finally:
            llm.shutdown()
    one_rank = rel_err(logits[1, "fp8"], logits[1, None])
    print(f"FP8 vs float32 logits: one rank {one_rank:.3f}, two ranks {rel_err(logits[2, 'fp8'], logits[1, None]):.3f}")
    assert 0 < rel_err(logits[2, "fp8"], logits[1, None]) < 1.5 * one_rank


def test_engine_features_under_two_ranks(checkpoints):
    """Chunked prefill, prefix caching, preemption (a cache too small for the batch), n > 1, beam search and
    speculative decoding (prompt lookup: verify steps of several tokens per sequence)."""
    shared = list(range(100, 148))  # three blocks of common prefix
    prompts = [shared + [i, i + 1, i + 2] for i in range(6)] + PROMPTS
    sampled = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=12)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    settings = dict(dtype="float32", device="cpu", seed=0, max_num_batched_tokens=32, num_gpu_blocks=10, block_size=16,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    results = {}
    for tp in (1, 2):
        llm = LLM(checkpoints["gqa"], tensor_parallel_size=tp, **settings)
        try:
            out = run(llm, prompts, greedy)[0] + run(llm, prompts[:3], sampled)[0]
            beams = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=3, max_tokens=6))
            results[tp] = out, [(s.tokens, s.cum_logprob) for s in beams[0].sequences], llm.stats()
        finally:
            llm.shutdown()
    (out_1, beams_1, stats_1), (out_2, beams_2, stats_2) = results[1], results[2]
    assert [[t for t, _ in s] for s in out_2] == [[t for t, _ in s] for s in out_1]
    assert [t for t, _ in beams_2] == [t for t, _ in beams_1]
    assert stats_2["num_preemptions"] == stats_1["num_preemptions"] > 0
    assert stats_2["prefix_cache_hits"] == stats_1["prefix_cache_hits"] > 0
    assert stats_2["spec_num_accepted_tokens"] == stats_1["spec_num_accepted_tokens"] > 0


def test_sparse_attention_under_two_ranks(checkpoints):
    """SparQ (each rank calibrates the bases of its own KV heads) and block-sparse prefill, a fixed pattern and
    blocks chosen per KV head (each rank choosing for its own): two ranks give one's tokens, and count the same
    fraction of keys read, below all of them."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (200, 90, 150)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for sparse in ({"method": "sparq", "r": 4, "k": 8}, {"method": "block", "local": 1},
                   {"method": "block", "local": 1, "density": 0.6, "sample": 4}):
        results = {}
        for tp in (1, 2):
            llm = LLM(checkpoints["gqa"], dtype="float32", device="cpu", tensor_parallel_size=tp, seed=0,
                      sparse_attention=sparse)
            try:
                results[tp] = run(llm, prompts, greedy)[0], llm.stats()["sparse_attention_keys_fraction"]
            finally:
                llm.shutdown()
        (out_1, read_1), (out_2, read_2) = results[1], results[2]
        assert [[t for t, _ in s] for s in out_2] == [[t for t, _ in s] for s in out_1], sparse
        assert read_2 == read_1 < 0.9, (sparse, read_1)


def test_each_rank_loads_its_shard_of_one_dummy_model():
    """Dummy weights are drawn whole in one order, so the ranks' shards put together are the one-rank model; a
    rank holds about 1/N of it."""
    from flashpage.loader import build_empty, init_dummy_weights
    from flashpage.loader.presets import preset_config
    from flashpage.parallel.group import TensorParallel

    cfg = preset_config("smollm2-135m")
    cfg.num_hidden_layers = 2
    whole = build_empty(cfg, torch.float32, torch.device("cpu"))
    init_dummy_weights(whole, seed=3)
    ranks = [build_empty(cfg, torch.float32, torch.device("cpu"), TensorParallel(r, 3)) for r in range(3)]
    for m in ranks:
        init_dummy_weights(m, seed=3)
        assert sum(p.numel() for p in m.parameters()) < 0.4 * sum(p.numel() for p in whole.parameters())
    attn = [m.layers[1].self_attn for m in ranks]
    full = whole.layers[1].self_attn
    q, kv = full.q_size, full.kv_size
    q_shards = [a.qkv_proj.weight[:a.q_size] for a in attn]
    k_shards = [a.qkv_proj.weight[a.q_size:a.q_size + a.kv_size] for a in attn]
    assert torch.equal(torch.cat(q_shards), full.qkv_proj.weight[:q])
    assert torch.equal(torch.cat(k_shards), full.qkv_proj.weight[q:q + kv])
    assert torch.equal(torch.cat([a.o_proj.weight for a in attn], 1), full.o_proj.weight)
    assert torch.equal(torch.cat([m.embed_tokens.weight for m in ranks]), whole.embed_tokens.weight)


def test_smollm2_over_three_ranks(smollm_llm, smollm_gguf):
    """The default model (9 query / 3 KV heads: 3 ranks, one KV head each) from its GGUF, float32."""
    params = SamplingParams(max_tokens=16, temperature=0)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    ref = [o.outputs[0].token_ids for o in smollm_llm.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(smollm_gguf), dtype="float32", device="cpu", tensor_parallel_size=3)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    finally:
        llm.shutdown()


def test_bad_sizes_fail_before_anything_starts(checkpoints, monkeypatch):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot split .* \(8 query, 2 key/value\)"):
        LLM(checkpoints["gqa"], device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs on this host, which has 0"):
        LLM(checkpoints["gqa"], device="cuda", tensor_parallel_size=2)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"torchrun started 4 ranks .* tensor_parallel_size=2"):
        LLM(checkpoints["gqa"], device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(checkpoints["gqa"], device="cpu", tensor_parallel_size=0)


def test_a_killed_worker_ends_the_run_with_a_clear_error(checkpoints):
    llm = LLM(checkpoints["gqa"], device="cpu", tensor_parallel_size=2)
    engine = llm.engine
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(engine.workers.processes[0].pid, signal.SIGKILL)
    start = time.perf_counter()
    with pytest.raises(WorkerFailed, match="rank 1 exited with signal SIGKILL"):
        while time.perf_counter() - start < 30:
            engine.step()
    assert time.perf_counter() - start < 10
    with pytest.raises(WorkerFailed, match="stopped"):
        engine.step()


def _wait_healthy(url: str, processes: list, timeout: float) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except (urllib.error.URLError, ConnectionError):
            assert time.time() < deadline and all(p.poll() is None for p in processes), "server did not start"
            time.sleep(0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_under_torchrun(checkpoints, tmp_path):
    """`torchrun --nnodes 2` on loopback, one rank per "node": rank 0 prints what one rank alone generates."""
    ref = LLM(checkpoints["chat"], device="cpu").generate("Hello there", SamplingParams(max_tokens=8, temperature=0),
                                                          use_tqdm=False)
    port = _free_port()
    cmd = lambda node: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",  # noqa: E731
                        "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m",
                        "flashpage", "generate", "Hello there", "--model", checkpoints["chat"], "--device", "cpu",
                        "--max-tokens", "8", "--tensor-parallel-size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(cmd(node), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for node in (0, 1)]
    outs = [p.communicate(timeout=240) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert outs[0][0].strip() == ref[0].outputs[0].text.strip() != ""
    assert outs[1][0].strip() == ""  # the worker rank prints nothing


def test_server_under_torchrun_serves_from_rank_0_and_both_ranks_exit_0(checkpoints):
    """`torchrun --nnodes 2` of `flashpage serve`: rank 0's engine process joins the group, rank 1 runs its worker
    loop; the answer is one rank's alone, and SIGTERM to rank 0 ends both."""
    ref = LLM(checkpoints["chat"], device="cpu").generate("Hello there", SamplingParams(max_tokens=6, temperature=0),
                                                          use_tqdm=False)[0].outputs[0].text
    master, http = _free_port(), _free_port()
    cmd = lambda node: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",  # noqa: E731
                        "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(master), "-m",
                        "flashpage", "serve", "--model", checkpoints["chat"], "--device", "cpu", "--port", str(http),
                        "--tensor-parallel-size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(cmd(node), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for node in (0, 1)]
    url = f"http://127.0.0.1:{http}"
    try:
        _wait_healthy(url, nodes, 180)
        body = json.dumps({"prompt": "Hello there", "max_tokens": 6, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.load(r)["choices"][0]["text"] == ref
        # torchrun runs flashpage serve as its child: rank 0's server gets the signal
        servers = subprocess.run(["pgrep", "-P", str(nodes[0].pid)], capture_output=True, text=True).stdout.split()
        os.kill(int(servers[0]), signal.SIGTERM)
        assert [p.wait(timeout=60) for p in nodes] == [0, 0]
    finally:
        for p in nodes:
            p.kill()
            p.wait()


def test_server_answers_503_and_exits_when_a_worker_dies(checkpoints):
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "flashpage", "serve", "--model", checkpoints["chat"], "--device",
                               "cpu", "--port", str(port), "--tensor-parallel-size", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, [server], 120)

        def spawned(parent: int) -> list[int]:
            children = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
            return [int(p) for p in children if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
        engine = spawned(server.pid)  # the engine's process, and the other rank its child
        assert len(engine) == 1
        workers = spawned(engine[0])
        assert len(workers) == 1

        def complete(max_tokens: int):
            body = json.dumps({"model": checkpoints["chat"], "prompt": "Hi", "max_tokens": max_tokens}).encode()
            req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, json.load(r)
            except urllib.error.HTTPError as e:
                return e.code, json.load(e)

        assert complete(4)[0] == 200
        os.kill(workers[0], signal.SIGKILL)
        status, body = complete(4)
        assert status == 503 and "tensor-parallel" in body["error"]["message"], body
        assert server.wait(timeout=30) != 0
    finally:
        server.kill()
        server.wait()
