"""The OpenAI-compatible server, started for real on loopback ports, driven by the official openai client."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import engine_from
from flashpage import SamplingParams
from flashpage.server.app import build_app
from flashpage.server.async_engine import AsyncEngine

KEY = "test-key"
MODEL = "smollm2-135m"
# The server's engine and the session's LLM are two engines with their own prefix caches: a prefix hit reuses K/V
# that its engine computed in some earlier batch, whose shape changes the float32 rounding. So the same request's
# log-probs agree to about 1e-5 on one CPU and differed by 6e-4 on CI's (-1.88270 against -1.88331, the first token
# of a chat). Any relaying mistake (another position, another token, processed log-probs) moves them by far more.
ACROSS_ENGINES = 2e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """uvicorn serving `app` on a loopback port in a thread of this process."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(smollm_llm):
    engine = AsyncEngine(engine_from(smollm_llm), max_waiting=64)
    server = RunningServer(build_app(engine, smollm_llm.tokenizer, MODEL, api_key=KEY))
    yield server, engine
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def small_server(smollm_llm):
    """No API key, a 64-token context: for fuzzing, so no request can run long."""
    engine = AsyncEngine(engine_from(smollm_llm, max_model_len=64), max_waiting=64)
    server = RunningServer(build_app(engine, smollm_llm.tokenizer, MODEL))
    yield server, engine
    server.stop()
    engine.shutdown()


def client(served):
    from openai import OpenAI

    return OpenAI(base_url=f"{served[0].url}/v1", api_key=KEY)


def wait_idle(engine: AsyncEngine, timeout: float = 30) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = engine.stats
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_slots_allocated"] == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {engine.stats}")


def test_openai_client_completions_and_chat_equal_llm(served, smollm_llm):
    c = client(served)
    assert [m.id for m in c.models.list().data] == [MODEL]
    prompt = "The three primary colours are"
    want = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    got = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                                         max_tokens=20, stream=True))
    assert streamed == want.text

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = smollm_llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    got = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    assert got.choices[0].message.content == want.text and "Paris" in want.text
    assert got.choices[0].finish_reason == want.finish_reason
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids) and chunks[-1].choices == []
    for k in (0, 2):  # each token's own log-prob, and exactly k alternatives (OpenAI's top_logprobs)
        got = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4, logprobs=True,
                                        top_logprobs=k)
        want = smollm_llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, logprobs=max(k, 1)),
                               use_tqdm=False)[0].outputs[0]
        content = got.choices[0].logprobs.content
        assert [len(e.top_logprobs) for e in content] == [k] * len(want.token_ids)
        for e, token, lps in zip(content, want.token_ids, want.logprobs):
            assert e.logprob == pytest.approx(lps[token].logprob, abs=ACROSS_ENGINES)
            assert [t.logprob for t in e.top_logprobs] == pytest.approx(
                sorted((lp.logprob for lp in lps.values()), reverse=True)[:k], abs=ACROSS_ENGINES)
    wait_idle(served[1])


def test_chat_continues_the_final_message_and_refuses_what_it_cannot_serve(served, smollm_llm):
    """vLLM's continue_final_message: the prompt ends inside the assistant's message (no end-of-turn token), and
    the answer equals LLM.chat's; settings that cannot hold together get a 400 naming the problem."""
    c = client(served)
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    want = smollm_llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False,
                           add_generation_prompt=False, continue_final_message=True)[0]
    assert want.prompt.endswith("<|im_start|>assistant\nMy favourite is")
    got = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                    extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert got.choices[0].message.content == want.outputs[0].text
    headers = {"Authorization": f"Bearer {KEY}"}
    for extra, words in (({"continue_final_message": True}, "cannot both be set"),
                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs cannot set"),
                         ({"chat_template": "{{ messages }}"}, "chat_template"),
                         ({"repetition_penalty": 0}, "repetition_penalty")):
        r = httpx.post(f"{served[0].url}/v1/chat/completions", headers=headers,
                       json={"model": MODEL, "messages": messages, "max_tokens": 2, **extra})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (extra, r.text)
    wait_idle(served[1])


def test_add_special_tokens_decides_the_bos(smollm_llm):
    """vLLM's add_special_tokens: a completion's text prompt gets the tokenizer's BOS unless it is false; a chat's
    rendered template gets none unless it is true (here a tokenizer that adds one). The app gets an engine of its
    own: stopping an app shuts its engine down, and a shared one would answer every later test with 503."""
    tok = copy.copy(smollm_llm.tokenizer)
    tok.add_bos = True
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # (SmolLM2's starts with its BOS)
    engine = AsyncEngine(engine_from(smollm_llm, max_model_len=64), max_waiting=64)
    server = RunningServer(build_app(engine, tok, MODEL))
    try:
        def prompt_tokens(path, body):
            r = httpx.post(f"{server.url}{path}", json={"model": MODEL, "max_tokens": 1, **body})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]
        n = len(tok.encode("Hello there", add_special_tokens=False))
        assert prompt_tokens("/v1/completions", {"prompt": "Hello there"}) == n + 1
        assert prompt_tokens("/v1/completions", {"prompt": "Hello there", "add_special_tokens": False}) == n
        chat = {"messages": [{"role": "user", "content": "Hello"}]}
        assert prompt_tokens("/v1/chat/completions", {**chat, "add_special_tokens": True}) == \
            prompt_tokens("/v1/chat/completions", chat) + 1
        wait_idle(engine)
    finally:
        server.stop()
        engine.shutdown()


def test_tokenize_and_detokenize_as_vllm(served, smollm_llm, smollm_gguf):
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize, and their errors."""
    from transformers import AutoTokenizer

    headers = {"Authorization": f"Bearer {KEY}"}
    tok = smollm_llm.tokenizer
    ref_tok = AutoTokenizer.from_pretrained(str(smollm_gguf.parent), gguf_file=smollm_gguf.name)

    def post(path, body):
        return httpx.post(f"{served[0].url}{path}", headers=headers, json={"model": MODEL, **body})
    r = post("/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["token_strs"] == ref_tok.convert_ids_to_tokens(r["tokens"]) and r["max_model_len"] == served[1].max_model_len
    messages = [{"role": "user", "content": "Hi"}]
    r = post("/tokenize", {"messages": messages}).json()
    assert r["tokens"] == smollm_llm.chat_prompt_ids(messages) and r["token_strs"] is None
    assert post("/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == tok.apply_chat_template(messages)
    for path, body, words in (("/tokenize", {}, "either prompt or messages"),
                              ("/tokenize", {"prompt": "a", "messages": messages}, "either prompt or messages"),
                              ("/tokenize", {"messages": messages, "continue_final_message": True}, "cannot both"),
                              ("/detokenize", {"tokens": [0, 10**7]}, "tokens must be integers"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")):
        r = post(path, body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (path, body, r.text)
    assert httpx.post(f"{served[0].url}/tokenize", json={"prompt": "a"}).status_code == 401


def test_concurrent_streams_with_disconnects_lose_nothing(served, smollm_llm):
    prompts = [f"Fact number {i}: the" for i in range(8)]
    want = {p: o.outputs[0].text for p, o in zip(prompts, smollm_llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False))}
    headers = {"Authorization": f"Bearer {KEY}"}

    leaving = [i for i in range(32) if i % 3 == 0]
    aborted_before = served[1].stats["num_aborted_requests"]

    async def one(i: int, http: httpx.AsyncClient):
        # a client that will leave asks for far more than could finish meanwhile: only an abort ends it in time
        body = {"model": MODEL, "prompt": prompts[i % 8], "temperature": 0, "max_tokens": 2000 if i in leaving else 12,
                "ignore_eos": True, "stream": True}
        text, events = "", 0
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events += 1
                text += json.loads(line[6:])["choices"][0]["text"]
                if i in leaving and events == 2:
                    return None  # disconnect mid-stream
        return text

    async def main():
        async with httpx.AsyncClient(base_url=served[0].url, timeout=120) as http:
            return await asyncio.gather(*(one(i, http) for i in range(32)))

    results = asyncio.run(main())
    for i, text in enumerate(results):
        if i not in leaving:
            assert text == want[prompts[i % 8]], i
    stats = wait_idle(served[1], timeout=20)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_aborted_requests"] - aborted_before == len(leaving)


def test_error_statuses_and_bodies(served, smollm_llm):
    url = served[0].url
    auth = {"Authorization": f"Bearer {KEY}"}
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 2}

    def post(path, body=None, headers=auth, raw=None):
        r = httpx.post(url + path, json=body, content=raw, headers={**headers, "content-type": "application/json"})
        return r.status_code, r.json()

    assert post("/v1/completions", ok, headers={})[0] == 401
    assert post("/v1/completions", ok, headers={"Authorization": "Bearer wrong"})[0] == 401
    status, body = post("/v1/completions", {**ok, "model": "gpt-4"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = post("/v1/completions", {**ok, "temperature": -1})
    assert status == 400 and body["error"]["param"] == "temperature" and "temperature" in body["error"]["message"]
    status, body = post("/v1/completions", {**ok, "prompt": [5] * 9000})
    assert status == 400 and "max_model_len" in body["error"]["message"]
    status, body = post("/v1/completions", {**ok, "max_tokens": 100000})  # refused, not clamped to the context
    assert status == 400 and body["error"]["param"] == "max_tokens" and "max_model_len=8192" in body["error"]["message"]
    for field in ("temperature", "repetition_penalty", "top_p"):  # JSON's Infinity and NaN are refused
        for value in (b"Infinity", b"NaN"):
            status, body = post("/v1/completions", raw=b'{"prompt": "hi", "max_tokens": 2, "%s": %s}' % (field.encode(), value))
            assert status == 400 and body["error"]["param"] == field, (field, value, body)
    status, body = post("/v1/completions", {**ok, "prompt": []})  # no prompt is an error, not an empty 200
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = post("/v1/completions", raw=b'{"prompt": "hi",')
    assert status == 400 and "malformed JSON" in body["error"]["message"]
    status, body = post("/v1/chat/completions", {"model": MODEL, "messages": []})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = post("/v1/completions", {**ok, "max_tokens": "many"})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    for _, b in [post("/v1/completions", {**ok, "n": 0})]:
        assert set(b["error"]) == {"message", "type", "param", "code"}
    wait_idle(served[1])


def test_overload_gets_503_with_retry_after(smollm_llm):
    engine = AsyncEngine(engine_from(smollm_llm), max_waiting=0)
    server = RunningServer(build_app(engine, smollm_llm.tokenizer, MODEL))
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == 503
    finally:
        server.stop()
        engine.shutdown()


def test_metrics_parse_and_move(served):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape():
        text = httpx.get(served[0].url + "/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    before = scrape()
    client(served).completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    after = scrape()
    assert after["flashpage_generation_tokens_total"] - before.get("flashpage_generation_tokens_total", 0) == 5
    assert after["flashpage_time_to_first_token_seconds_count"] > before.get("flashpage_time_to_first_token_seconds_count", 0)
    assert after["flashpage_e2e_request_latency_seconds_count"] >= 1
    for name in ("flashpage_num_requests_running", "flashpage_num_requests_waiting", "flashpage_kv_cache_usage_ratio",
                 "flashpage_prefix_cache_hit_rate", "flashpage_num_preemptions", "flashpage_prompt_tokens_total",
                 "flashpage_inter_token_latency_seconds_count"):
        assert name in after


def test_metrics_add_up_with_aborts_and_vllm_names(smollm_llm):
    """Every sample that ends counts once under its finish reason (client departures as aborts); every generated
    token once; each token after a sample's first gives one inter-token latency; vLLM's phase histograms count
    the requests that finished."""
    from prometheus_client.parser import text_string_to_metric_families

    engine = AsyncEngine(engine_from(smollm_llm), max_waiting=64)
    server = RunningServer(build_app(engine, smollm_llm.tokenizer, MODEL))
    try:
        c = httpx.Client(base_url=server.url, timeout=120)
        body = {"model": MODEL, "temperature": 0, "ignore_eos": True}
        for i in range(3):
            assert c.post("/v1/completions", json={**body, "prompt": f"Fact {i}:", "max_tokens": 5}).status_code == 200
        assert c.post("/v1/completions", json={**body, "prompt": "Two:", "max_tokens": 4, "n": 2, "temperature": 1,
                                               "seed": 1}).status_code == 200
        for i in range(2):  # clients that leave mid-stream
            with c.stream("POST", "/v1/completions", json={**body, "prompt": f"Long {i}:", "max_tokens": 500,
                                                            "stream": True}) as r:
                events = 0
                for line in r.iter_lines():
                    events += line.startswith("data: ")
                    if events == 2:
                        break
        wait_idle(engine)
        deadline = time.time() + 10
        while True:
            text = c.get("/metrics").text
            samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
            value = lambda name, **labels: sum(s.value for s in samples if s.name == name  # noqa: E731
                                               and all(s.labels.get(k) == v for k, v in labels.items()))
            if value("flashpage_requests_total", finish_reason="abort") == 2 or time.time() > deadline:
                break
            time.sleep(0.1)
        assert value("flashpage_requests_total") == 3 + 2 + 2
        assert value("flashpage_requests_total", finish_reason="length") == 5
        assert value("flashpage_requests_total", finish_reason="abort") == 2
        assert value("flashpage_generation_tokens_total") == value("flashpage_inter_token_latency_seconds_count") + 7
        assert value("flashpage_generation_tokens_total") >= 3 * 5 + 2 * 4 + 2 * 2
        assert value("flashpage_time_to_first_token_seconds_count") == 6
        for name in ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                     "vllm:request_decode_time_seconds_count"):
            assert value(name) == 4, name
        assert value("vllm:iteration_tokens_total_sum") >= value("flashpage_prompt_tokens_total")
        assert value("vllm:prefix_cache_queries_total") >= value("vllm:prefix_cache_hits_total") >= 0
    finally:
        server.stop()
        engine.shutdown()


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=20), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
          "seed", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "stream", "stream_options",
          "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "echo"]
PLAUSIBLE = {
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 60000), max_size=8)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                                "content": st.one_of(st.text(max_size=20), st.none(), st.integers())}),
                         max_size=3),
    "max_tokens": st.one_of(st.integers(-2, 8), st.none()), "n": st.integers(-1, 3),
    "temperature": st.floats(-1, 3, allow_nan=False, allow_infinity=False), "stream": st.booleans(),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)),
}


@st.composite
def request_bodies(draw):
    body = {}
    for f in draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=8)):
        body[f] = draw(PLAUSIBLE[f] if f in PLAUSIBLE and draw(st.booleans()) else JSON_VALUES)
    if draw(st.booleans()) and "max_tokens" not in body:
        body["max_tokens"] = 3
    return body


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=request_bodies())
def test_fuzzed_requests_never_get_500(small_server, path, body):
    assert not small_server[1]._stop, "the small server's engine was shut down by an earlier test"
    r = httpx.post(small_server[0].url + path, json=body, timeout=60)
    assert r.status_code in (200, 400, 404), (r.status_code, body, r.text[:300])
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_sigterm_aborts_running_streams_after_the_grace_time_and_exits_0():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flashpage", "serve", "--model", "smollm2-135m", "--load-format",
                             "dummy", "--device", "cpu", "--port", str(port), "--max-model-len", "2048",
                             "--shutdown-timeout", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        # a stream that would run for a minute or more: only the shutdown's abort ends it in time (a dummy model has
        # no tokenizer, so its text is empty and the final chunk is the only one)
        body = {"prompt": [1, 2, 3], "max_tokens": 1500, "ignore_eos": True, "stream": True, "temperature": 0}
        events = []

        def stream():
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
                events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        while "flashpage_num_requests_running 1.0" not in httpx.get(f"http://127.0.0.1:{port}/metrics").text:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        signalled = time.time()
        reader.join(60)
        assert time.time() - signalled < 15
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


def test_bench_serve_reports_throughput_and_latencies(served, tmp_path, capsys):
    from flashpage.bench.serve import main

    out = tmp_path / "bench.json"
    rc = main(["--url", served[0].url, "--api-key", KEY, "--num-prompts", "6", "--request-rate", "20",
               "--input-len", "12", "--output-len", "5", "--vocab", "40000", "--json", str(out),
               "--client-processes", "2"])
    result = json.loads(out.read_text())
    assert rc == 0 and result["completed"] == 6 and result["failed"] == 0
    assert result["output_token_throughput"] > 0 and result["ttft"]["median_ms"] > 0 and result["itl"]["p99_ms"] > 0
    printed = capsys.readouterr().out
    assert "throughput:" in printed and "speculative decoding" not in printed and "spec_acceptance_rate" not in result
    wait_idle(served[1])


def test_completions_echo_logprobs_offsets_usage_and_unserved_fields(served, smollm_llm):
    """echo with prompt log-probs (lm-evaluation-harness's log-likelihood call), text_offset equal streamed and
    not, log-probs in streamed chunks, continuous usage, truncate_prompt_tokens, logit_bias, /version, and a 400
    for a field flashpage does not serve."""
    url, headers = served[0].url, {"Authorization": f"Bearer {KEY}"}
    post = lambda body: httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, headers=headers, timeout=60)  # noqa: E731
    prompt = "The capital of France is"
    ids = smollm_llm.tokenizer.encode(prompt)
    want = smollm_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                               use_tqdm=False)[0]
    r = post({"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}).json()
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"] == prompt and r["usage"]["completion_tokens"] == 0
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(ids)
    for got, entry, t in zip(lp["token_logprobs"][1:], want.prompt_logprobs[1:], ids[1:]):
        assert got == pytest.approx(entry[t].logprob, abs=ACROSS_ENGINES)
    body = {"prompt": prompt, "max_tokens": 6, "echo": True, "logprobs": 2, "temperature": 0, "ignore_eos": True}
    whole = post(body).json()["choices"][0]
    events = [json.loads(line[6:]) for line in httpx.post(url + "/v1/completions", json={
        "model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        headers=headers, timeout=60).text.splitlines() if line.startswith("data: {")]
    chunks = [e for e in events if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    streamed = {key: [v for c in chunks for v in c["choices"][0]["logprobs"][key]] for key in whole["logprobs"]}
    assert streamed == whole["logprobs"] and len(streamed["tokens"]) == len(ids) + 6
    assert streamed["text_offset"] == sorted(streamed["text_offset"])
    assert all("usage" in e for e in events) and events[-1]["usage"]["completion_tokens"] == 6
    short = post({"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 2}).json()
    assert short["usage"]["prompt_tokens"] == 2
    biased = post({"prompt": prompt, "max_tokens": 3, "temperature": 0, "logit_bias": {"42": 100}}).json()
    assert biased["choices"][0]["text"] == smollm_llm.tokenizer.decode([42, 42, 42])
    with_prompt_lp = post({"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}).json()
    entries = with_prompt_lp["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and entries[1][str(ids[1])]["logprob"] == pytest.approx(
        want.prompt_logprobs[1][ids[1]].logprob, abs=ACROSS_ENGINES)
    for field, value in [("tools", [{"type": "function", "function": {"name": "f"}}]), ("suffix", "!")]:
        r = post({"prompt": prompt, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert httpx.get(url + "/version").json()["version"]
    wait_idle(served[1])
