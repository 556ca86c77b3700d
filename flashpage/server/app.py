"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, and
vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from flashpage import __version__
from flashpage.engine.llm_engine import streamable_end
from flashpage.outputs import RequestOutput
from flashpage.server.async_engine import AsyncEngine, EngineOverloaded, Update
from flashpage.server.metrics import Metrics
from flashpage.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                       error_body)
from flashpage.tokenizer import Tokenizer

log = logging.getLogger("flashpage.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, code=None, param=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param, self.headers = status, message, type_, code, param, headers


def build_app(engine: AsyncEngine, tokenizer: Tokenizer | None, model_name: str, api_key: str | None = None) -> FastAPI:
    metrics = Metrics()
    max_model_len = engine.max_model_len

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()  # SIGTERM: uvicorn stops accepting, then this aborts what is left

    app = FastAPI(title="flashpage", version="0.1.0", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    engine.step_observers.append(metrics.iteration_tokens.observe)

    # ----- errors: always OpenAI-style JSON, never a traceback -----
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(error_body(e.message, e.type, e.code, e.param), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"malformed JSON body: {first.get('ctx', {}).get('error', '')}",
                                           "invalid_request_error", 400), status_code=400)
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return JSONResponse(error_body(message, "invalid_request_error", 400, where or None), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind, e.status_code), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception):
        log.exception("unexpected error")
        return JSONResponse(error_body("internal server error", "internal_error", 500), status_code=500)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not secrets.compare_digest(header.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key", "authentication_error", 401)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model `{name}` does not exist", "not_found_error", "model_not_found", "model")

    # ----- routes -----
    @app.get("/health")
    async def health():
        if engine.failed:
            raise APIError(503, str(engine.failed), "service_unavailable", 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        metrics.update_engine(engine.stats)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "flashpage", "max_model_len": max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        """vLLM's: the token ids a completion's prompt or a chat's messages become."""
        check_auth(request)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "invalid_request_error", 400, "prompt")
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "invalid_request_error", 400)
        chat = body.messages is not None
        text = _render_chat(tokenizer, body) if chat else body.prompt
        special = body.add_special_tokens if body.add_special_tokens is not None else not chat
        ids = tokenizer.encode(text, add_special_tokens=special)
        strs = [tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None  # (as vLLM's)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        """vLLM's: the text of token ids (special tokens included)."""
        check_auth(request)
        check_model(body.model)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "invalid_request_error", 400)
        vocab = engine.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be integers in [0, {vocab})", "invalid_request_error", 400, "tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_auth(request)
        check_model(body.model)
        _refuse_unserved(body)
        if not body.prompts():
            raise APIError(400, "prompt is empty: give a string, token ids, or a non-empty list of them",
                           "invalid_request_error", 400, "prompt")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo)", "invalid_request_error", 400, "max_tokens")
        echo_only = body.echo and body.max_tokens == 0  # the prompt's log-probs alone (lm-evaluation-harness)
        prompt_lp = body.logprobs if body.echo and body.logprobs is not None else None
        if body.prompt_logprobs is not None:
            prompt_lp = max(body.prompt_logprobs, prompt_lp or 0)
        params = _params(body, 1 if echo_only else body.max_tokens, body.logprobs, prompt_lp)
        prompts = [_tokenize(p, tokenizer, body.truncate_prompt_tokens, body.add_special_tokens) for p in body.prompts()]
        for ids in prompts:
            _validate(engine, ids, params)
        texts = [p if isinstance(p, str) and not body.truncate_prompt_tokens else _decode(ids, tokenizer)
                 for p, ids in zip(body.prompts(), prompts)]
        rid = f"cmpl-{secrets.token_hex(12)}"
        streams = [engine.generate(f"{rid}-{i}", ids, params, stream=bool(body.stream))
                   for i, ids in enumerate(prompts)]
        n, k = params.n, body.logprobs

        def echoed(out: RequestOutput, i: int):
            """The prompt's text and (token, entry) pairs, where echoed."""
            if not body.echo:
                return "", []
            entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            return texts[i], list(zip(out.prompt_token_ids, entries))

        if body.stream:
            offsets: dict[tuple[int, int], int] = {}  # (prompt, sample) -> text offset of its next token

            def chunk(i, out, o, delta, tokens, finish):
                if tokens is None:  # the first chunk of a sample: the echoed prompt
                    delta, tokens = echoed(out, i)
                elif echo_only:
                    delta, tokens = "", []
                logprobs = None
                if k is not None:
                    logprobs = _completion_logprobs(tokens, tokenizer, offsets.get((i, o.index), 0))
                    offsets[i, o.index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) if tokens else \
                        offsets.get((i, o.index), 0)
                return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                        "choices": [{"index": i * n + o.index, "text": delta, "logprobs": logprobs,
                                     "finish_reason": finish, "stop_reason": o.stop_reason if finish else None}]}
            return _sse(streams, params, chunk, None, body.stream_options, rid, "text_completion", model_name, metrics,
                        echo=body.echo)
        finals = await _collect(streams, request, metrics, n)
        choices = []
        for i, out in enumerate(finals):
            for o in out.outputs:
                text, tokens = echoed(out, i)
                if not echo_only:
                    text, tokens = text + o.text, tokens + list(zip(o.token_ids, o.logprobs or [None] * len(o.token_ids)))
                choices.append({"index": i * n + o.index, "text": text, "finish_reason": o.finish_reason,
                                "stop_reason": o.stop_reason,
                                "logprobs": None if k is None else _completion_logprobs(tokens, tokenizer)})
                if body.prompt_logprobs is not None:  # vLLM's field: {token id: {logprob, rank, decoded_token}}
                    choices[-1]["prompt_logprobs"] = [None if e is None else {t: dataclasses.asdict(lp) for t, lp in e.items()}
                                                      for e in out.prompt_logprobs]
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage(finals, echo_only)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_auth(request)
        check_model(body.model)
        _refuse_unserved(body)
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        params = _params(body, body.max_completion_tokens or body.max_tokens, top)
        text = _render_chat(tokenizer, body)
        ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        if body.truncate_prompt_tokens:
            ids = ids[-body.truncate_prompt_tokens:]
        _validate(engine, ids, params)
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        streams = [engine.generate(rid, ids, params, prompt=text, stream=bool(body.stream))]
        if body.stream:
            def chunk(_, out, o, delta, tokens, finish):
                return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name,
                        "choices": [{"index": o.index, "delta": {"content": delta} if delta else {},
                                     "logprobs": _chat_logprobs(tokens, tokenizer, top) if body.logprobs else None,
                                     "finish_reason": finish}]}

            def first(o):
                return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name,
                        "choices": [{"index": o, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]}
            return _sse(streams, params, chunk, first, body.stream_options, rid, "chat.completion.chunk",
                        model_name, metrics)
        finals = await _collect(streams, request, metrics, params.n)
        choices = [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                    "logprobs": _chat_logprobs(list(zip(o.token_ids, o.logprobs)), tokenizer, top)
                    if body.logprobs else None,
                    "finish_reason": o.finish_reason, "stop_reason": o.stop_reason} for o in finals[0].outputs]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage(finals)}

    return app


# ----- helpers ---------------------------------------------------------------------------------------
def _params(body, max_tokens, logprobs, prompt_logprobs=None):
    try:
        return body.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_request_error", 400, getattr(e, "param", None)) from e


def _render_chat(tokenizer: Tokenizer | None, body) -> str:
    """A chat request's messages as the chat template renders them (its add_generation_prompt,
    continue_final_message and chat_template_kwargs)."""
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so no chat template", "invalid_request_error", 400)
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        return tokenizer.apply_chat_template(messages, body.add_generation_prompt, body.continue_final_message,
                                             body.chat_template_kwargs)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_request_error", 400, "messages") from e


def _tokenize(prompt, tokenizer: Tokenizer | None, keep_last: int | None = None,
              add_special_tokens: bool = True) -> list[int]:
    if isinstance(prompt, list):
        ids = prompt
    elif tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "invalid_request_error", 400,
                       "prompt")
    else:
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    return ids[-keep_last:] if keep_last else ids


def _decode(ids: list[int], tokenizer: Tokenizer | None) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ""


def _refuse_unserved(body) -> None:
    unserved = body.unserved()
    if unserved:
        raise APIError(400, f"parameter {unserved[0]!r} is not supported by flashpage", "invalid_request_error", 400,
                       unserved[0])


def _validate(engine: AsyncEngine, ids: list[int], params) -> None:
    try:
        engine.validate(ids, params)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_request_error", 400, getattr(e, "param", None)) from e


def _overloaded(e: EngineOverloaded) -> APIError:
    return APIError(503, str(e), "server_overloaded", 503, headers={"Retry-After": "1"})


async def _merged(streams) -> AsyncIterator[tuple[int, Update]]:
    """Interleave several requests' update streams; closing this closes (and so aborts) all of them."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for update in stream:
                await q.put((i, update))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Timing:
    """Per-request latency and token bookkeeping for the metrics. Counters add up: every generated token is counted
    once; each sample's tokens after its first give one inter-token latency each; every sample that ends, however
    it ends, counts once under its finish reason (`close` counts the ones a departed client left as aborts)."""

    def __init__(self, metrics: Metrics, num_prompts: int):
        self.metrics, self.start = metrics, time.perf_counter()
        self.first = [None] * num_prompts
        self.last: dict[tuple[int, int], tuple[float, int]] = {}  # (prompt, sample) -> (time, tokens) so far
        self.ended: set[tuple[int, int]] = set()

    def observe(self, i: int, update: Update) -> None:
        out, m = update.output, self.metrics
        if self.first[i] is None and out.finished and out.metrics.first_token_time is not None:
            self._observe_final(i, out)
            return
        for o in out.outputs:
            key = (i, o.index)
            prev_t, prev_n = self.last.get(key, (None, 0))
            n = len(o.token_ids)
            if n > prev_n:
                if self.first[i] is None:
                    self.first[i] = update.time
                    m.ttft.observe(update.time - self.start)
                    m.prompt_tokens.inc(len(out.prompt_token_ids))
                m.generation_tokens.inc(n - prev_n)
                # one latency per token after the sample's first; tokens that came with its first one came with no gap
                gap = 0.0 if prev_t is None else (update.time - prev_t) / (n - prev_n)
                for _ in range(n - prev_n - (prev_t is None)):
                    m.itl.observe(gap)
                self.last[key] = (update.time, n)
            if o.finish_reason is not None and key not in self.ended:
                self.ended.add(key)
                m.requests.labels(o.finish_reason).inc()
        if out.finished:
            m.e2e.observe(update.time - self.start)
            m.request_finished(out.metrics)

    def _observe_final(self, i: int, out: RequestOutput) -> None:
        """A request seen only at its end (not streamed: `AsyncEngine.generate(stream=False)`): its time to first
        token and its mean inter-token latency from the engine's own times."""
        m, t = self.metrics, out.metrics
        self.first[i] = t.first_token_time
        m.ttft.observe(t.first_token_time - t.arrival_time)
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        for o in out.outputs:
            n = len(o.token_ids)
            m.generation_tokens.inc(n)
            for _ in range(n - 1):
                m.itl.observe((t.last_token_time - t.first_token_time) / (n - 1))
            self.ended.add((i, o.index))
            m.requests.labels(o.finish_reason).inc()
        m.e2e.observe(t.finished_time - t.arrival_time)
        m.request_finished(t)

    def close(self, num_samples: int) -> None:
        """The response is over: samples that never ended were aborted (their client left)."""
        unended = len(self.first) * num_samples - len(self.ended)
        if unended:
            self.metrics.requests.labels("abort").inc(unended)


async def _collect(streams, request: Request, metrics: Metrics, num_samples: int) -> list[RequestOutput]:
    """Final outputs of all streams; a client that disconnects meanwhile aborts them."""
    finals: dict[int, RequestOutput] = {}
    timing = _Timing(metrics, len(streams))

    async def consume():
        async for i, update in _merged(streams):
            timing.observe(i, update)
            if update.output.finished:
                finals[i] = update.output

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                timing.close(num_samples)
                raise APIError(499, "client disconnected", "client_closed_request", 499)
        task.result()
    except EngineOverloaded as e:
        raise _overloaded(e) from e
    except ValueError as e:
        raise APIError(400, str(e), "invalid_request_error", 400) from e
    except RuntimeError as e:
        raise APIError(503, str(e), "service_unavailable", 503, headers={"Retry-After": "1"}) from e
    finally:
        if not task.done():
            task.cancel()
    return [finals[i] for i in range(len(streams))]


def _sse(streams, params, chunk, first_chunk, stream_options, rid, obj, model_name, metrics,
         echo: bool = False) -> StreamingResponse:
    """Server-sent events. `chunk(i, output, sample, text, tokens, finish)` builds one event: `tokens` are the
    sample's (token id, log-probs entry) pairs new since its last event (None for an echoed prompt's event)."""
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = bool(stream_options and stream_options.continuous_usage_stats)

    async def events():
        timing = _Timing(metrics, len(streams))
        sent: dict[tuple[int, int], int] = {}  # (prompt, sample) -> characters streamed
        tokens_sent: dict[tuple[int, int], int] = {}  # (prompt, sample) -> tokens whose log-probs were streamed
        closed: set[tuple[int, int]] = set()  # samples whose finish_reason was sent
        finals: dict[int, RequestOutput] = {}
        latest: dict[int, RequestOutput] = {}
        ended = False  # the stream ran to its end (else the client left mid-stream)

        def event(payload):
            if continuous:
                payload["usage"] = _usage(list(latest.values()))
            return _event(payload)

        try:
            if first_chunk:
                for index in range(params.n):
                    yield _event(first_chunk(index))
            async for i, update in _merged(streams):
                timing.observe(i, update)
                out = latest[i] = update.output
                for o in out.outputs:
                    key = (i, o.index)
                    if echo and key not in tokens_sent:
                        tokens_sent[key] = 0
                        yield event(chunk(i, out, o, "", None, None))
                    done = o.finish_reason is not None
                    end = streamable_end(o.text, params.stop, done)
                    start, first_token = sent.get(key, 0), tokens_sent.get(key, 0)
                    # (with continuous usage, every step's tokens are an event: a client counts arrivals even where
                    # the text does not grow)
                    if end > start or (done and key not in closed) or (continuous and len(o.token_ids) > first_token):
                        sent[key], tokens_sent[key] = max(start, end), len(o.token_ids)
                        if done:
                            closed.add(key)
                        new = list(zip(o.token_ids[first_token:], (o.logprobs or [None] * len(o.token_ids))[first_token:]))
                        yield event(chunk(i, out, o, o.text[start:end], new, o.finish_reason if done else None))
                if out.finished:
                    finals[i] = out
            ended = True
            if include_usage:
                yield _event({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                              "choices": [], "usage": _usage([finals[i] for i in sorted(finals)])})
        except EngineOverloaded as e:
            ended = True
            yield _event(error_body(str(e), "server_overloaded", 503))
        except (ValueError, RuntimeError) as e:
            ended = True
            yield _event(error_body(str(e), "invalid_request_error" if isinstance(e, ValueError) else "service_unavailable",
                                    400 if isinstance(e, ValueError) else 503))
        finally:
            if not ended:  # closed mid-stream: the client left, which aborted what was still running
                timing.close(params.n)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(finals: list[RequestOutput], echo_only: bool = False) -> dict:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = 0 if echo_only else sum(len(o.token_ids) for f in finals for o in f.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _piece(token: int, lp, tokenizer: Tokenizer | None) -> str:
    """A token's text: the engine's decoding in its Logprob where there is one, else decoded here."""
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer else str(token)


def _completion_logprobs(tokens: list[tuple[int, dict | None]], tokenizer: Tokenizer | None,
                         offset: int = 0) -> dict:
    """OpenAI's completion log-probs for (token id, log-probs entry) pairs; a prompt's first token has no entry.
    `text_offset` counts each token's text, from the start of the text returned."""
    texts = [_piece(t, e[t] if e else None, tokenizer) for t, e in tokens]
    return {"tokens": texts, "token_logprobs": [e[t].logprob if e else None for t, e in tokens],
            "top_logprobs": [{_piece(i, lp, tokenizer): lp.logprob for i, lp in e.items()} if e else None
                             for _, e in tokens],
            "text_offset": list(itertools.accumulate((len(x) for x in texts[:-1]), initial=offset)) if texts else []}


def _chat_logprobs(tokens: list[tuple[int, dict]], tokenizer: Tokenizer, k: int) -> dict:
    """OpenAI's chat log-probs: each token's own, and its position's k most likely (none for k = 0)."""
    def entry(t, lp):
        s = _piece(t, lp, tokenizer)
        return {"token": s, "logprob": lp.logprob, "bytes": list(s.encode())}
    return {"content": [{**entry(t, e[t]), "top_logprobs": [entry(i, lp) for i, lp in
                                                            sorted(e.items(), key=lambda kv: -kv[1].logprob)[:k]]}
                        for t, e in tokens]}
