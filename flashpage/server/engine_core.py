"""The engine's side of the server: a loop that steps an LLMEngine, on a thread of the server's process
(`EngineLoop`) or as the main loop of a process of its own (`EngineProcess`, what `flashpage serve` runs, as vLLM
v1's EngineCore).

Why a process of its own: the server's event loop does Python work for every streamed token (JSON, SSE, metrics).
In one process that work and the engine's scheduling take turns on the GIL, and the GPU waits for both: on an H100
with 256 streams a decode step took 24–34 ms in the server against 12.5 ms offline (docs/cpu.md has the log). The
engine process only steps and sends each step's outputs as deltas (the tokens and text new since the last one),
so what crosses the pipe does not grow with a sequence's length.

Both run the same loop. It takes messages through `put` — ("add", request_id, prompt_token_ids, params, prompt),
("abort", request_id), ("stop", grace) — and reports through `emit`, in order:
  ("outputs", [(request_id, RequestOutput)], tokens)  a step's outputs and the tokens it computed (None: not a step)
  ("error", request_id, exception)                     a request refused at admission, or whose step failed
  ("stats", stats, admitted)                           the engine's statistics, and how many adds came in since the
                                                       last report
  ("failed", exception)                                the engine cannot go on (a tensor-parallel rank died)
  ("stopped",)                                         the loop has returned
"""

from __future__ import annotations

import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from flashpage.engine.llm_engine import LLMEngine
from flashpage.engine.validation import EngineLimits, RequestValidator
from flashpage.outputs import CompletionOutput, RequestMetrics, RequestOutput
from flashpage.parallel.workers import WorkerFailed
from flashpage.tokenizer import Tokenizer


class EngineOverloaded(Exception):
    """The waiting queue is full, or the server is stopping; the client should retry later."""


class EngineLoop:
    """Steps `engine` on the thread that calls `run` until stopped. Statistics are reported at most ten times a
    second while busy (a snapshot walks every block table) and whenever the engine goes idle."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.validator: RequestValidator = engine.validator
        self.max_model_len = engine.max_model_len
        self.initial_stats = engine.stats()
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop_at: float | None = None  # once stopping: when what still runs is aborted
        self._admitted = 0
        self._stats_time = 0.0

    def put(self, msg: tuple) -> None:
        self._inbox.put(msg)
        self._wake.set()

    def run(self, emit: Callable[[tuple], None]) -> None:
        eng = self.engine
        while True:
            self._drain_inbox(emit)
            if self._stop_at is not None and (time.perf_counter() >= self._stop_at or not eng.has_unfinished_requests()):
                emit(("outputs", [(rid, eng.abort_request(rid)) for rid in eng.unfinished_request_ids()], None))
                # (an unfinished request is known to the engine, so each abort returns its final output)
                self._report(emit)
                emit(("stopped",))
                return
            if not eng.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = eng.step()
            except WorkerFailed as e:
                self._fail(e, emit)
                return
            except Exception as e:  # a failed step must not take the server down silently
                for request_id in eng.unfinished_request_ids():
                    eng.abort_request(request_id)
                    emit(("error", request_id, RuntimeError(f"engine step failed: {e}")))
                outputs = []
            emit(("outputs", [(out.request_id, out) for out in outputs], eng.last_step_tokens))
            if time.perf_counter() - self._stats_time > 0.1 or not eng.has_unfinished_requests():
                self._report(emit)

    def join(self, timeout: float | None = None) -> None:
        """(The loop runs on its caller's thread: once run() has returned there is nothing left to wait for.)"""

    def _drain_inbox(self, emit) -> None:
        drained = False
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                if drained:
                    self._report(emit)
                return
            drained = True
            if msg[0] == "add":
                _, request_id, ids, params, prompt = msg
                self._admitted += 1
                if self._stop_at is not None:
                    emit(("error", request_id, EngineOverloaded("the server is shutting down")))
                    continue
                try:
                    self.engine.add_request(request_id, ids, params, prompt)
                except ValueError as e:
                    emit(("error", request_id, e))
            elif msg[0] == "abort":
                self.engine.abort_request(msg[1])
            else:  # ("stop", grace)
                stop_at = time.perf_counter() + msg[1]
                self._stop_at = stop_at if self._stop_at is None else min(self._stop_at, stop_at)

    def _report(self, emit) -> None:
        emit(("stats", self.engine.stats(), self._admitted))
        self._admitted, self._stats_time = 0, time.perf_counter()

    def _fail(self, error: WorkerFailed, emit) -> None:
        """Every request, running or still in the inbox, gets the error (a 503); then the loop ends."""
        for request_id in self.engine.unfinished_request_ids():
            emit(("error", request_id, RuntimeError(str(error))))
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if msg[0] == "add":
                emit(("error", msg[1], RuntimeError(str(error))))
        emit(("failed", error))


# ----- the engine in a process of its own ------------------------------------------------------------------------
@dataclass
class EngineInfo:
    """What the server's process needs of the engine, sent once it has loaded."""
    limits: EngineLimits
    tokenizer: Tokenizer | None
    stats: dict


class EngineProcess:
    """An EngineLoop in a child process (spawned: CUDA and OpenMP start fresh there, and the loop runs on its main
    thread). The constructor returns once the model has loaded, or raises the loader's error."""

    def __init__(self, settings: dict):
        """`settings`: the `LLM(...)` keyword arguments (EngineConfig's fields)."""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_process_main, args=(child_end, settings), name="flashpage-engine")
        self._proc.start()
        child_end.close()
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._proc.join()
            raise RuntimeError(f"the engine process exited (code {self._proc.exitcode}) while loading the model")
        except BaseException:  # (Ctrl-C while loading: the process ignores SIGINT, so it is stopped here)
            self._proc.kill()
            raise
        if kind == "error":
            self._proc.join()
            raise payload
        info: EngineInfo = payload
        self.tokenizer = info.tokenizer
        self.max_model_len = info.limits.max_model_len
        self.validator = RequestValidator(info.limits, info.tokenizer)
        self.initial_stats = info.stats
        self._send_lock = threading.Lock()  # (a Connection is not safe to send on from two threads at once)

    def put(self, msg: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(msg)
            except (BrokenPipeError, OSError):
                pass  # the process has gone: run() reports it

    def run(self, emit: Callable[[tuple], None]) -> None:
        """Relay the process's events until it stops; a process that dies reports itself failed."""
        decoder = DeltaDecoder()
        while True:
            try:
                event = self._conn.recv()
            except (EOFError, OSError):
                self._proc.join(5)
                emit(("failed", RuntimeError(f"the engine process exited (code {self._proc.exitcode})")))
                return
            if event[0] == "outputs":
                event = ("outputs", [(rid, decoder.apply(rid, d)) for rid, d in event[1]], event[2])
            emit(event)
            if event[0] in ("stopped", "failed"):
                return

    def join(self, timeout: float | None = None) -> None:
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def _engine_process_main(conn, settings: dict) -> None:
    from flashpage.engine.llm import LLM

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches the whole process group: the server stops us)
    try:
        llm = LLM(**settings)
    except (ValueError, RuntimeError, OSError) as e:
        base = next(t for t in (ValueError, OSError, RuntimeError) if isinstance(e, t))
        conn.send(("error", base(str(e))))  # (as its base type, which always unpickles; a subclass may not)
        return
    llm.engine.warm_up()  # (first use compiles Triton's kernels on a GPU, packs the weights on a CPU: 1.7 s)
    loop = EngineLoop(llm.engine)
    conn.send(("ready", EngineInfo(llm.engine.limits, llm.tokenizer, loop.initial_stats)))

    def read():
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the server is gone: stop now
                loop.put(("stop", 0.0))
                return
            loop.put(msg)

    threading.Thread(target=read, name="flashpage-engine-inbox", daemon=True).start()
    encoder = DeltaEncoder()

    def emit(event: tuple) -> None:
        if event[0] == "outputs":
            event = ("outputs", [(rid, encoder.encode(out)) for rid, out in event[1]], event[2])
        try:
            conn.send(event)
        except (BrokenPipeError, OSError):
            loop.put(("stop", 0.0))

    loop.run(emit)
    llm.shutdown()


# ----- outputs as deltas -----------------------------------------------------------------------------------------
@dataclass
class SampleDelta:
    index: int
    text_kept: int  # characters of the text sent before that stay (a stop string found later cuts some off)
    text: str  # what follows them
    tokens_kept: int
    token_ids: list[int]
    logprobs: list[dict] | None  # the new tokens' entries, where asked for
    finish_reason: str | None
    stop_reason: int | str | None
    cumulative_logprob: float | None


@dataclass
class OutputDelta:
    samples: list[SampleDelta]
    finished: bool
    metrics: RequestMetrics | None


class DeltaEncoder:
    """A request's first output goes whole, each later one as what changed since. In a step a sample's text and
    tokens grow and may then be cut short (a stop string, which ends the sample), so what stays of the last output
    is as long as the shorter of the two."""

    def __init__(self):
        self._sent: dict[str, list[tuple[int, int]]] = {}  # request id -> each sample's (characters, tokens) sent

    def encode(self, out: RequestOutput) -> RequestOutput | OutputDelta:
        before = self._sent.get(out.request_id)
        if out.finished:
            self._sent.pop(out.request_id, None)
        else:
            self._sent[out.request_id] = [(len(o.text), len(o.token_ids)) for o in out.outputs]
        if before is None:
            return out
        samples = []
        for o, (chars, tokens) in zip(out.outputs, before):
            chars, tokens = min(chars, len(o.text)), min(tokens, len(o.token_ids))
            samples.append(SampleDelta(o.index, chars, o.text[chars:], tokens, o.token_ids[tokens:],
                                       None if o.logprobs is None else o.logprobs[tokens:], o.finish_reason,
                                       o.stop_reason, o.cumulative_logprob))
        return OutputDelta(samples, out.finished, out.metrics)


class DeltaDecoder:
    """Rebuilds each request's whole output from the encoder's deltas: a fresh RequestOutput per step, as the
    engine's own."""

    def __init__(self):
        self._latest: dict[str, RequestOutput] = {}

    def apply(self, request_id: str, item: RequestOutput | OutputDelta) -> RequestOutput:
        if isinstance(item, OutputDelta):
            last = self._latest[request_id]
            outputs = []
            for o, d in zip(last.outputs, item.samples):
                logprobs = None if d.logprobs is None else o.logprobs[:d.tokens_kept] + d.logprobs
                outputs.append(CompletionOutput(d.index, o.text[:d.text_kept] + d.text,
                                                o.token_ids[:d.tokens_kept] + d.token_ids, d.finish_reason,
                                                d.stop_reason, d.cumulative_logprob, logprobs))
            item = RequestOutput(request_id, last.prompt, last.prompt_token_ids, outputs, item.finished,
                                 last.prompt_logprobs, item.metrics)
        if item.finished:
            self._latest.pop(request_id, None)
        else:
            self._latest[request_id] = item
        return item
