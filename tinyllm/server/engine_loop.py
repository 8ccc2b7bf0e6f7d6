"""The engine thread: the one owner of the Engine, fed through a queue by the HTTP handlers."""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass


from ..engine import Engine, RequestOutput
from .metrics import ServerMetrics
from .protocol import Job

# An idle engine waits for commands this long at a time. serve() runs it on the main thread, the one where Python
# runs signal handlers: a SIGTERM the OS hands to another thread (a kernel worker's) only sets a flag, which the
# main thread reads when it next runs Python, so a wait with no end could ignore it for good.
IDLE_WAKE_S = 0.5


# --- the engine thread ---------------------------------------------------------------------------------------------
@dataclass
class _Active:
    """A request the engine thread is serving, and where its events go."""
    request: object                  # engine.Request (its samples are request.children)
    loop: asyncio.AbstractEventLoop
    inbox: asyncio.Queue
    deadline: float
    remaining: int                   # samples not finished yet


class EngineLoop:
    """The one thread that owns the engine. Handlers call `submit` / `abort` (thread-safe: they only put commands
    on a queue); events come back on each request's asyncio.Queue as ("events", [RequestOutput]) or
    ("error", status, message)."""

    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None, request_timeout: float = 600.0):
        self.engine, self.metrics, self.request_timeout = engine, metrics, request_timeout
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.active: dict[str, _Active] = {}        # engine thread only
        self.ready = threading.Event()              # set once the kernels are compiled
        self.num_waiting = 0                        # published after each step, read by the handlers
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tinyllm-engine", daemon=True)
        self.on_caller = False                      # serve(): the loop runs in run_here's thread, not its own

    def start(self) -> None:
        if not self.on_caller:
            self.thread.start()

    def run_here(self) -> None:
        """Run the loop on the calling thread until stop(). serve() runs it on the thread that loaded the model:
        OpenMP gives every thread that starts parallel kernels a pool of workers, and once a process has more
        workers than cores their waits are cut short, so each of a step's parallel kernels waits for a wake-up
        (docs/serving.md, "One thread runs the kernels")."""
        self.on_caller, self.thread = True, threading.current_thread()
        self._run()

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue) -> None:
        self.commands.put(("add", job, loop, inbox))

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

    def call(self, fn, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        """Run fn(engine) on the engine thread between two steps (a consistent view of the pool and queues, for
        the lab page); its result or exception is set on `future`."""
        self.commands.put(("call", fn, loop, future))

    def end_all(self, status: int, message: str) -> None:
        """End every request now with an error (the drain's deadline); the engine keeps serving."""
        self.commands.put(("end_all", status, message))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything still running and end the thread."""
        self.commands.put(("stop",))
        if self.thread.ident and self.thread is not threading.current_thread() and not self.on_caller:
            self.thread.join(timeout)

    @property
    def queued(self) -> int:
        """Requests waiting for the engine: its queue plus commands not yet taken (approximate, for 429)."""
        return self.num_waiting + self.commands.qsize()

    # ---- inside the thread
    def _run(self) -> None:
        try:
            self._warm_up()
        except BaseException as e:                  # a model that cannot run: report it, never mark ready
            self.error = e
            return
        self.ready.set()
        try:
            self._serve()
        except BaseException as e:                  # a bug in the loop: fail what is pending, /health turns 500
            self.error = e
            for rid in list(self.active):
                self._end(rid, ("error", 500, f"the engine thread failed: {type(e).__name__}: {e}"))

    def _serve(self) -> None:
        while True:
            # Idle: block on the queue (no spinning; awake every IDLE_WAKE_S). Busy: take whatever arrived, then step.
            block = not self.engine.has_unfinished()
            while True:
                try:
                    command = self.commands.get(block=block, timeout=IDLE_WAKE_S if block else None)
                except queue.Empty:
                    break
                if command[0] == "stop":
                    for rid in list(self.active):
                        self._end(rid, ("error", 503, "the server is shutting down"))
                    return
                if command[0] == "end_all":
                    for rid in list(self.active):
                        self._end(rid, ("error", command[1], command[2]))
                    continue
                self._handle(command)
                block = False
            if self.engine.has_unfinished():
                self._step()

    def _warm_up(self) -> None:
        """Compile prefill, batched decode and sampling on a throwaway pool before the first request."""
        pool = self.engine.pool
        warm = Engine(self.engine.model, num_blocks=8, block_size=pool.block_size, max_num_seqs=2,
                      kv_dtype=pool.kv_dtype)
        warm.add_request("a", [1, 2, 3], max_tokens=3, stop_token_ids=())
        warm.add_request("b", [1, 2], max_tokens=3, stop_token_ids=())
        list(warm.run())

    def _handle(self, command) -> None:
        if command[0] == "call":
            _, fn, loop, future = command
            try:
                result, error = fn(self.engine), None
            except Exception as e:                  # handed to the caller, who answers with it
                result, error = None, e
            loop.call_soon_threadsafe(_settle, future, result, error)
            return
        if command[0] == "abort":                  # its client left; a handler still waiting hears it and ends
            if command[1] in self.active:
                self._end(command[1], ("error", 499, "the client went away and the request was aborted"))
            return
        _, job, loop, inbox = command
        stop_ids = () if job.ignore_eos else None
        try:
            req = self.engine.add_request(job.request_id, job.prompt_ids, job.params, job.max_tokens,
                                          stop_token_ids=stop_ids, stop=job.stop, n=job.n, logprobs=job.logprobs)
        except ValueError as e:
            loop.call_soon_threadsafe(inbox.put_nowait, ("error", 400, str(e)))
            return
        self.active[job.request_id] = _Active(req, loop, inbox, req.metrics.arrival + self.request_timeout, job.n)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:                      # a bug, not bad input: fail the running requests, keep serving
            for rid in [r for r in self.active]:
                self._end(rid, ("error", 500, f"the engine failed: {type(e).__name__}: {e}"))
            return
        by_request: dict[str, list[RequestOutput]] = {}
        for e in events:
            by_request.setdefault(e.request_id, []).append(e)
        for rid, evs in by_request.items():
            a = self.active.get(rid)
            if a is None:
                continue
            a.loop.call_soon_threadsafe(a.inbox.put_nowait, ("events", evs))
            a.remaining -= sum(e.finished for e in evs)
            if a.remaining == 0:
                del self.active[rid]
                self._observe_finished(a.request)
        now = self.engine.clock()
        for rid in [rid for rid, a in self.active.items() if now > a.deadline]:
            self._end(rid, ("error", 504, f"the request took longer than the server's timeout "
                                          f"({self.request_timeout:g} s) and was aborted"))
        self.num_waiting = len(self.engine.scheduler.waiting)
        if self.metrics is not None:
            self.metrics.update(self.engine)

    def _end(self, rid: str, item) -> None:
        """Abort a request (its blocks freed, its samples' finish times set) and hand its client `item`."""
        self.engine.abort(rid)
        a = self.active.pop(rid)
        a.loop.call_soon_threadsafe(a.inbox.put_nowait, item)
        self._observe_finished(a.request)

    def _observe_finished(self, req) -> None:
        if self.metrics is not None:
            for r in [req, *req.children]:
                self.metrics.finished(r, r.finish_reason or "abort")
            self.metrics.update(self.engine)




def _settle(future: asyncio.Future, result, error) -> None:
    if not future.done():                           # the caller may have given up waiting
        future.set_exception(error) if error is not None else future.set_result(result)
