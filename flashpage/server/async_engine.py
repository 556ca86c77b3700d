"""AsyncEngine: the server's handle on the engine; each request gets a mailbox of updates.

The engine steps elsewhere: in a process of its own (`EngineProcess`, what `flashpage serve` runs) or on a thread
of this process (`EngineLoop`, given an LLMEngine: tests, and programs that embed the server). Requests and aborts
go to it as messages; each step's outputs come back to the event loop with one call_soon_threadsafe per step.
`run()` relays those events until the engine stops: on a thread of its own (`start=True`) or the caller's. The
waiting queue is bounded, so overload is refused at the door instead of exhausting memory.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from flashpage.engine.llm_engine import LLMEngine
from flashpage.outputs import RequestOutput
from flashpage.sampling_params import SamplingParams
from flashpage.server.engine_core import EngineLoop, EngineOverloaded, EngineProcess

__all__ = ["AsyncEngine", "EngineOverloaded", "Update"]


@dataclass
class Update:
    output: RequestOutput  # the request's state after a step (full text so far per sample)
    time: float  # when it reached this process (perf_counter)


class AsyncEngine:
    def __init__(self, engine: LLMEngine | EngineProcess, max_waiting: int = 256, start: bool = True):
        self.core = EngineLoop(engine) if isinstance(engine, LLMEngine) else engine
        self.max_waiting = max_waiting
        self.stats: dict = self.core.initial_stats
        self._queues: dict[str, tuple[_Mailbox, asyncio.AbstractEventLoop, bool]] = {}
        self._pending = 0  # requests sent to the engine but not yet admitted by it
        self._lock = threading.Lock()
        self._stop = False
        self.step_observers: list = []  # called from run()'s thread with each step's token count
        self.failed: Exception | None = None  # why the engine stopped for good (a tensor-parallel rank died)
        self.on_failure = None  # called from run()'s thread with that error (the server exits)
        self._thread = threading.Thread(target=self.run, name="flashpage-engine", daemon=True)
        if start:
            self._thread.start()

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.validator.limits.vocab_size

    # ----- called from the event loop ------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.core.validator(prompt_token_ids, params)  # reads the engine's limits only: safe from any thread

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, stream: bool = True) -> AsyncIterator[Update]:
        """Updates for one request until it finishes (`stream=False`: its final one only, which spares the event
        loop a wake-up per step). Leaving the iteration early aborts the request."""
        q = _Mailbox()
        with self._lock:  # (sent under the lock: once the engine has failed or stopped, everything open is answered)
            if self.failed:
                raise EngineOverloaded(str(self.failed))
            if self._stop:
                raise EngineOverloaded("the server is shutting down")
            if self.stats["num_waiting"] + self._pending >= self.max_waiting:
                raise EngineOverloaded(f"too many waiting requests (max {self.max_waiting})")
            self._pending += 1
            self._queues[request_id] = (q, asyncio.get_running_loop(), stream)
            self.core.put(("add", request_id, prompt_token_ids, params, prompt))
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
        self.core.put(("abort", request_id))

    def shutdown(self, grace: float = 0.0, wait: bool = True) -> None:
        """Stop admitting (new requests get 503); let running requests go on for up to `grace` seconds, then abort
        the rest (each stream gets a final output with finish_reason "abort"); stop the engine."""
        with self._lock:
            self._stop = True
        self.core.put(("stop", grace))
        if wait:
            if self._thread.ident is not None:
                self._thread.join(grace + 10)
            self.core.join(10)

    # ----- run()'s thread ------------------------------------------------------------------------
    def run(self) -> None:
        """Relay the engine's events to the requests' mailboxes until it stops (or fails)."""
        self.core.run(self._on_event)

    def _on_event(self, event: tuple) -> None:
        kind = event[0]
        if kind == "outputs":
            _, outputs, tokens = event
            if tokens is not None:
                for observe in self.step_observers:
                    observe(tokens)
            now = time.perf_counter()
            self._send_all([(rid, Update(out, now)) for rid, out in outputs])
        elif kind == "error":
            self._send_all([(event[1], event[2])])
        elif kind == "stats":
            with self._lock:
                self.stats, self._pending = event[1], self._pending - event[2]
        else:  # "failed" or "stopped": answer whatever is still open (sent while the engine was stopping)
            with self._lock:
                self._stop = True
                if kind == "failed":
                    self.failed = event[1]
                open_ids = list(self._queues)
            error = RuntimeError(str(self.failed)) if self.failed else EngineOverloaded("the server is shutting down")
            self._send_all([(rid, error) for rid in open_ids])
            if kind == "failed" and self.on_failure:
                self.on_failure(self.failed)

    def _send_all(self, items: list[tuple[str, object]]) -> None:
        """Hand items to their requests' queues: one wake-up of each event loop per call, not one per request. A
        request's last item (its final output, or an error) closes its entry, so nothing can follow it."""
        by_loop: dict = {}
        for request_id, item in items:
            entry = self._queues.get(request_id)
            last = not isinstance(item, Update) or item.output.finished
            if entry is not None and (entry[2] or last):
                by_loop.setdefault(entry[1], []).append((entry[0], item))
                if last:
                    self._queues.pop(request_id, None)
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
