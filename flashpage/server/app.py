"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
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

from flashpage.engine.llm_engine import streamable_end
from flashpage.outputs import RequestOutput
from flashpage.server.async_engine import AsyncEngine, EngineOverloaded, Update
from flashpage.server.metrics import Metrics
from flashpage.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
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
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        metrics.update_engine(engine.stats)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "flashpage", "max_model_len": max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_auth(request)
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", "invalid_request_error", 400, "echo")
        params = _params(body, body.max_tokens, body.logprobs)
        if not body.prompts():
            raise APIError(400, "prompt is empty: give a string, token ids, or a non-empty list of them",
                           "invalid_request_error", 400, "prompt")
        prompts = [_tokenize(p, tokenizer) for p in body.prompts()]
        for ids in prompts:
            _validate(engine, ids, params)
        rid = f"cmpl-{secrets.token_hex(12)}"
        streams = [engine.generate(f"{rid}-{i}", ids, params) for i, ids in enumerate(prompts)]
        n = params.n
        if body.stream:
            def chunk(i, o, delta, finish):
                return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                        "choices": [{"index": i * n + o.index, "text": delta, "logprobs": None,
                                     "finish_reason": finish, "stop_reason": o.stop_reason if finish else None}]}
            return _sse(streams, prompts, params, chunk, None, body.stream_options, rid, "text_completion", model_name,
                        metrics)
        finals = await _collect(streams, request, metrics, n)
        choices = [{"index": i * n + o.index, "text": o.text, "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason, "logprobs": _completion_logprobs(o, tokenizer)}
                   for i, out in enumerate(finals) for o in out.outputs]
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage(finals)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_auth(request)
        check_model(body.model)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template", "invalid_request_error", 400)
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        params = _params(body, body.max_completion_tokens or body.max_tokens, top)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = tokenizer.apply_chat_template(messages, body.add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), "invalid_request_error", 400, "messages") from e
        ids = tokenizer.encode(text, add_special_tokens=False)
        _validate(engine, ids, params)
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        streams = [engine.generate(rid, ids, params, prompt=text)]
        if body.stream:
            def chunk(_, o, delta, finish):
                return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name,
                        "choices": [{"index": o.index, "delta": {"content": delta} if delta else {},
                                     "logprobs": None, "finish_reason": finish}]}

            def first(o):
                return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name,
                        "choices": [{"index": o, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]}
            return _sse(streams, [ids], params, chunk, first, body.stream_options, rid, "chat.completion.chunk",
                        model_name, metrics)
        finals = await _collect(streams, request, metrics, params.n)
        choices = [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                    "logprobs": _chat_logprobs(o, tokenizer, top) if body.logprobs else None,
                    "finish_reason": o.finish_reason, "stop_reason": o.stop_reason} for o in finals[0].outputs]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage(finals)}

    return app


# ----- helpers ---------------------------------------------------------------------------------------
def _params(body, max_tokens, logprobs):
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_request_error", 400, getattr(e, "param", None)) from e


def _tokenize(prompt, tokenizer: Tokenizer | None) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "invalid_request_error", 400,
                       "prompt")
    return tokenizer.encode(prompt)


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
                gaps = n - prev_n - (prev_t is None)  # the sample's first token has no gap before it
                for _ in range(gaps):
                    m.itl.observe((update.time - prev_t) / (n - prev_n))
                self.last[key] = (update.time, n)
            if o.finish_reason is not None and key not in self.ended:
                self.ended.add(key)
                m.requests.labels(o.finish_reason).inc()
        if out.finished:
            m.e2e.observe(update.time - self.start)
            m.request_finished(out.metrics)

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


def _sse(streams, prompts, params, chunk, first_chunk, stream_options, rid, obj, model_name, metrics) -> StreamingResponse:
    include_usage = bool(stream_options and stream_options.include_usage)

    async def events():
        timing = _Timing(metrics, len(streams))
        sent: dict[tuple[int, int], int] = {}  # (prompt, sample) -> characters streamed
        closed: set[tuple[int, int]] = set()  # samples whose finish_reason was sent
        finals: dict[int, RequestOutput] = {}
        ended = False  # the stream ran to its end (else the client left mid-stream)
        try:
            if first_chunk:
                for index in range(params.n):
                    yield _event(first_chunk(index))
            async for i, update in _merged(streams):
                timing.observe(i, update)
                for o in update.output.outputs:
                    done = o.finish_reason is not None
                    end = streamable_end(o.text, params.stop, done)
                    key = (i, o.index)
                    start = sent.get(key, 0)
                    if end > start or (done and key not in closed):
                        sent[key] = max(start, end)
                        if done:
                            closed.add(key)
                        yield _event(chunk(i, o, o.text[start:end], o.finish_reason if done else None))
                if update.output.finished:
                    finals[i] = update.output
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


def _usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_logprobs(o, tokenizer: Tokenizer | None) -> dict | None:
    if o.logprobs is None:
        return None
    def text(t):
        return tokenizer.decode([t], skip_special_tokens=False) if tokenizer else str(t)
    return {"tokens": [text(t) for t in o.token_ids], "token_logprobs": [e[t] for t, e in zip(o.token_ids, o.logprobs)],
            "top_logprobs": [{text(k): v for k, v in e.items()} for e in o.logprobs], "text_offset": []}


def _chat_logprobs(o, tokenizer: Tokenizer, k: int) -> dict:
    """OpenAI's chat log-probs: each token's own, and its position's k most likely (none for k = 0)."""
    def entry(t, lp):
        s = tokenizer.decode([t], skip_special_tokens=False)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}
    return {"content": [{**entry(t, e[t]), "top_logprobs": [entry(i, v) for i, v in sorted(e.items(), key=lambda kv: -kv[1])[:k]]}
                        for t, e in zip(o.token_ids, o.logprobs or [])]}
