"""AsyncEngine: one thread steps the LLMEngine; each request gets a mailbox of updates.

Only that thread touches the engine: a background thread of its own, or (`start=False`, `flashpage serve`) the
caller's, which calls `run()`. Requests and aborts reach it through a thread-safe inbox, and each step's results
go back to the event loop with call_soon_threadsafe. The waiting queue is bounded, so overload is refused at the
door instead of exhausting memory.

On a CPU the thread that loaded the model should be the one that steps it: PyTorch's OpenMP team belongs to the
thread that first ran parallel work, and a second team in another thread makes OpenMP throttle its waiting on a
machine with few cores, which cost a third of the decode speed (docs/cpu.md).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from flashpage.engine.llm_engine import LLMEngine
from flashpage.outputs import RequestOutput
from flashpage.parallel.workers import WorkerFailed
from flashpage.sampling_params import SamplingParams


class EngineOverloaded(Exception):
    """The waiting queue is full; the client should retry later."""


@dataclass
class Update:
    output: RequestOutput  # the request's state after a step (full text so far per sample)
    time: float  # when the step finished (perf_counter)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256, start: bool = True):
        self.engine = engine
        self.max_waiting = max_waiting
        self.stats: dict = engine.stats()
        self._inbox: queue.Queue = queue.Queue()
        self._queues: dict[str, tuple[_Mailbox, asyncio.AbstractEventLoop]] = {}
        self._pending = 0  # requests sent to the thread but not yet admitted by it
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._deadline = 0.0  # once stopping: when what still runs is aborted
        self.step_observers: list = []  # called from the engine thread with each step's token count
        self.failed: WorkerFailed | None = None  # why the engine stopped for good (a tensor-parallel rank died)
        self.on_failure = None  # called from the engine thread with that error (the server exits)
        self._stats_time = 0.0
        self._thread = threading.Thread(target=self.run, name="flashpage-engine", daemon=True)
        if start:
            self._thread.start()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ----- called from the event loop ------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)  # reads configuration only: safe from any thread

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, stream: bool = True) -> AsyncIterator[Update]:
        """Updates for one request until it finishes (`stream=False`: its final one only, which spares the event
        loop a wake-up per step, and so the engine's thread the wait for the GIL). Leaving the iteration early
        aborts the request."""
        q = _Mailbox()
        with self._lock:  # (the inbox is filled under the lock: a failing engine answers everything in it)
            if self.failed:
                raise EngineOverloaded(str(self.failed))
            if self._stop:
                raise EngineOverloaded("the server is shutting down")
            if self.stats["num_waiting"] + self._pending >= self.max_waiting:
                raise EngineOverloaded(f"too many waiting requests (max {self.max_waiting})")
            self._pending += 1
            self._queues[request_id] = (q, asyncio.get_running_loop(), stream)
            self._inbox.put(("add", request_id, prompt_token_ids, params, prompt))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.output.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, grace: float = 0.0, wait: bool = True) -> None:
        """Stop admitting (new requests get 503); let running requests go on for up to `grace` seconds, then abort
        the rest (each stream gets a final output with finish_reason "abort"); stop the thread."""
        with self._lock:
            if not self._stop:
                self._stop, self._deadline = True, time.perf_counter() + grace
        self._wake.set()
        if wait and self._thread.ident is not None:
            self._thread.join(grace + 10)

    # ----- the engine thread ---------------------------------------------------------------------
    def run(self) -> None:
        """Step the engine until shut down (or failed): the background thread's work, or the caller's."""
        eng = self.engine
        while True:
            self._drain_inbox()
            if self._stop and (time.perf_counter() >= self._deadline or not eng.has_unfinished_requests()):
                for request_id in eng.unfinished_request_ids():
                    self._send(request_id, Update(eng.abort_request(request_id), time.perf_counter()))
                self.stats = eng.stats()
                return
            if not eng.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = eng.step()
            except WorkerFailed as e:
                self._fail(e)
                return
            except Exception as e:  # a failed step must not take the server down silently
                for request_id in eng.unfinished_request_ids():
                    eng.abort_request(request_id)
                    self._send(request_id, RuntimeError(f"engine step failed: {e}"))
                outputs = []
            for observe in self.step_observers:
                observe(eng.last_step_tokens)
            now = time.perf_counter()
            self._send_all([(out.request_id, Update(out, now)) for out in outputs])
            if now - self._stats_time > 0.1 or not eng.has_unfinished_requests():
                self._refresh_stats()

    def _fail(self, error: WorkerFailed) -> None:
        """The engine cannot go on: every request, running or still in the inbox, gets the error (a 503)."""
        with self._lock:
            self.failed, self._stop = error, True
        for request_id in self.engine.unfinished_request_ids():
            self._send(request_id, RuntimeError(str(error)))
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if msg[0] == "add":
                self._send(msg[1], RuntimeError(str(error)))
        if self.on_failure:
            self.on_failure(error)

    def _refresh_stats(self) -> None:
        """The engine's statistics, snapshotted for the event loop: at most ten times a second while busy (a
        snapshot walks every block table) and whenever the engine goes idle."""
        self.stats, self._stats_time = self.engine.stats(), time.perf_counter()

    def _drain_inbox(self) -> None:
        drained = False
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                if drained:
                    self._refresh_stats()
                return
            drained = True
            if msg[0] == "add":
                _, request_id, ids, params, prompt = msg
                with self._lock:
                    self._pending -= 1
                if request_id not in self._queues:
                    continue  # the client left before admission
                if self._stop:
                    self._send(request_id, EngineOverloaded("the server is shutting down"))
                    continue
                try:
                    self.engine.add_request(request_id, ids, params, prompt)
                except ValueError as e:
                    self._send(request_id, e)
            else:
                self.engine.abort_request(msg[1])

    def _send(self, request_id: str, item) -> None:
        self._send_all([(request_id, item)])

    def _send_all(self, items: list[tuple[str, object]]) -> None:
        """Hand items to their requests' queues: one wake-up of each event loop per call, not one per request."""
        by_loop: dict = {}
        for request_id, item in items:
            entry = self._queues.get(request_id)
            if entry is not None and (entry[2] or not isinstance(item, Update) or item.output.finished):
                by_loop.setdefault(entry[1], []).append((entry[0], item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)


class _Mailbox:
    """The latest update of one request. An update holds the request's whole state (text and tokens so far), so a
    newer one replaces one not yet read: a busy event loop then handles one event covering several tokens instead
    of falling behind (and holding back the requests still arriving). An error is never replaced."""

    def __init__(self):
        self.item = None
        self.ready = asyncio.Event()

    def put_nowait(self, item) -> None:
        if not isinstance(self.item, BaseException):
            self.item = item
        self.ready.set()

    async def get(self):
        await self.ready.wait()
        self.ready.clear()
        item, self.item = self.item, None
        return item


def _put_all(batch: list[tuple[_Mailbox, object]]) -> None:
    for box, item in batch:
        box.put_nowait(item)
