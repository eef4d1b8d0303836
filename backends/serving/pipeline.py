"""Two stages in one process: a request's preprocessing on the caller's thread, its encoder forward
and its answer on a worker thread, so that under load the next request is preprocessed while the
encoder runs this one (kimi_k25_vision_fused with its pipeline on; docs/triton_runtime.md#the-fused-models-pipeline).

Why one process: preprocessing kernels of another process (kimi_preprocess in the ensemble) take turns
with the encoder's on the GPU unless CUDA MPS is on; kernels of two streams of one process may run at
the same time. Why a worker thread: tritonserver gives a Python model instance its next request only
when `execute` returns, and an `execute` that returns its responses keeps the instance busy until
their GPU outputs are copied out; a request answered later through its response sender frees it at
once.

Triton-free: `launch` and `finish` are the adapter's; this module only orders them. A job launched is
finished exactly once, in the order submitted; the worker launches job k before it finishes job k-1,
so that the GPU has the next forward queued while the previous answer goes out.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_STOP = object()


class Pipeline:
    """`submit(job)` hands a job to the worker; the worker calls `launch(job)` (its result is the
    handle) and later `finish(job, handle, error)`, `error` being what `launch` raised (handle None).
    `finish` answers the request; what it raises is logged, never lost in a dead thread.

    Up to `in_flight` jobs are launched and not yet finished (2: the next forward queued while the
    previous answer goes out; one more per further lane that runs forwards side by side). `depth`
    jobs may wait for the worker beyond those; `submit` blocks while they do, so the caller (Triton's
    execute) stops taking requests and they queue in the server, where its queue policy bounds them.
    `context()` is entered once on the worker thread, around its loop (its CUDA device).

    Should the worker ever stop on an error of its own, every job it holds or that waits for it is
    finished with that error, and `submit` refuses from then on: no request is left without an answer.

    Stalls: with `stall_s`, a watchdog thread calls `on_stall(seconds, what)` once when jobs are held
    (submitted, not yet finished) and none has been launched or finished for `stall_s` seconds, or
    when the first stage (the caller's work inside `first_stage()`) has run that long; again only after
    progress resumed and stopped once more. It only reports (the adapter logs every thread's stack): a
    thread stuck in a call that never returns cannot be unstuck from here."""

    def __init__(self, launch: Callable[[Any], Any], finish: Callable[[Any, Any, BaseException | None], None], *,
                 depth: int = 1, in_flight: int = 2,
                 context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 name: str = "pipeline", stall_s: float | None = None,
                 on_stall: Callable[[float, str], None] | None = None):
        if in_flight < 1 or depth < 1:
            raise ValueError(f"in_flight and depth must be at least 1, got {in_flight} and {depth}")
        if stall_s is not None and stall_s <= 0:
            raise ValueError(f"stall_s must be above 0, got {stall_s}")
        self._launch, self._finish, self._context = launch, finish, context
        self._in_flight, self._depth = in_flight, depth
        self._cv = threading.Condition()  # guards the fields below
        self._waiting: deque = deque()  # submitted, not yet taken by the worker
        self._closing = False
        self._stopped: BaseException | None = None  # why the worker stopped early
        self._held = 0  # submitted and not yet finished
        self._progress = time.monotonic()  # the latest launch or finish (or the first submit after an idle spell)
        self._first_stage_since: float | None = None  # when the caller's current first stage began
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if stall_s is not None and on_stall is not None:
            threading.Thread(target=self._watch, args=(stall_s, on_stall), name=f"{name}-watchdog", daemon=True).start()

    def submit(self, job) -> None:
        with self._cv:
            while len(self._waiting) >= self._depth and not (self._closing or self._stopped):
                self._cv.wait()
            if self._stopped is not None:
                raise RuntimeError(f"the pipeline's worker stopped: {self._stopped!r}")
            if self._closing:
                raise RuntimeError("the pipeline is closed")
            if self._held == 0:
                self._progress = time.monotonic()  # an idle spell is no stall
            self._held += 1
            self._waiting.append(job)
            self._cv.notify_all()

    @contextlib.contextmanager
    def first_stage(self):
        """Around the caller's work for one job before `submit` (preprocessing): the watchdog reports it
        too when it runs `stall_s` or longer. One caller thread (Triton's execute)."""
        with self._cv:
            self._first_stage_since = time.monotonic()
        try:
            yield
        finally:
            with self._cv:
                self._first_stage_since = None

    def close(self, timeout: float | None = 60.0) -> bool:
        """Finishes every job already submitted, then stops the worker; False if it was still busy
        after `timeout` seconds (then it goes on in the background: a daemon thread)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the pipeline's worker was still answering %.0f s after close", timeout or 0)
            return False
        return True

    def _take(self, block: bool):
        """The next job; None when none waits and `block` is False; _STOP when closing and none waits."""
        with self._cv:
            while not self._waiting:
                if self._closing:
                    return _STOP
                if not block:
                    return None
                self._cv.wait()
            job = self._waiting.popleft()
            self._cv.notify_all()  # room for a submit
            return job

    def _run(self) -> None:
        pending: deque = deque()  # (job, handle, error): launched, not yet finished, oldest first
        try:
            with self._context():
                while True:
                    if len(pending) >= self._in_flight:
                        self._finish_one(pending.popleft())
                        continue
                    job = self._take(block=not pending)
                    if job is None:  # nothing to launch meanwhile: answer the oldest launched job now
                        self._finish_one(pending.popleft())
                        continue
                    if job is _STOP:
                        while pending:
                            self._finish_one(pending.popleft())
                        return
                    pending.append(self._launch_one(job))
        except BaseException as exc:  # noqa: BLE001 - e.g. the context failed: answer everything held
            log.exception("the pipeline's worker stopped")
            with self._cv:
                self._stopped = exc
                stranded = list(self._waiting)
                self._waiting.clear()
                self._cv.notify_all()
            for launched in pending:
                self._finish_one((launched[0], None, exc))
            for job in stranded:
                self._finish_one((job, None, exc))

    def _launch_one(self, job):
        try:
            return job, self._launch(job), None
        except BaseException as exc:  # noqa: BLE001 - the job's own failure, answered by finish
            return job, None, exc
        finally:
            self._moved(0)

    def _finish_one(self, launched) -> None:
        try:
            self._finish(*launched)
        except BaseException:  # noqa: BLE001 - the worker must live on for the next jobs
            log.exception("answering a request failed")
        finally:
            self._moved(1)

    def _moved(self, finished: int) -> None:
        with self._cv:
            self._progress = time.monotonic()
            self._held -= finished

    def _watch(self, stall_s: float, on_stall: Callable[[float, str], None]) -> None:
        reported_progress = reported_first = None  # the stalls already reported, by when they began
        while True:
            with self._cv:
                if self._closing and self._held == 0 or self._stopped is not None:
                    return
                self._cv.wait(min(stall_s / 4, 1.0))
                now, held, progress, first = time.monotonic(), self._held, self._progress, self._first_stage_since
            stalls = []
            if held and now - progress >= stall_s and reported_progress != progress:
                reported_progress = progress
                stalls.append((now - progress, f"{held} request(s) handed over and none launched or answered"))
            if first is not None and now - first >= stall_s and reported_first != first:
                reported_first = first
                stalls.append((now - first, "a request still in preprocessing (the first stage)"))
            for seconds, what in stalls:
                try:
                    on_stall(seconds, what)
                except Exception:  # noqa: BLE001 - a report must never stop the watch
                    log.exception("reporting a stalled pipeline failed")


class Streams:
    """The CUDA streams of the stages, and the events that order them: one for preprocessing and one per
    encoder lane. Every method is a no-op on the CPU, where the stages need no ordering beyond the job
    hand-over.

    All streams are non-blocking (torch creates its streams so): the Python backend's own copies of
    outputs, on the legacy default stream, then wait for no stage's later work.

    Lanes: forwards on different lanes may run at the same time, so that one forward's kernels fill what
    another leaves of the GPU (as two encoder instances under CUDA MPS do, with one copy of the weights).
    Only graph replays run side by side: a forward that may build the per-grid tables (an eager one, or
    a capture) first waits for every lane, and every later forward waits for it, so no forward reads a
    table another lane is still writing."""

    def __init__(self, device: torch.device, lanes: int = 1):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.lanes = max(1, lanes) if self.cuda else 1
        self.pre = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.encoders = [torch.cuda.Stream(device=self.device) for _ in range(self.lanes)] if self.cuda else [None]
        self._last_exclusive = None  # event: the end of the latest forward that did not run side by side

    def _on(self, stream) -> contextlib.AbstractContextManager:
        if not self.cuda:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))  # the current device is per thread too
        stack.enter_context(torch.cuda.stream(stream))
        return stack

    def preprocessing(self) -> contextlib.AbstractContextManager:
        """Around the first stage's GPU work (the caller's thread)."""
        return self._on(self.pre)

    def device_context(self) -> contextlib.AbstractContextManager:
        """Around the worker's loop: its CUDA device (the current device is per thread)."""
        return torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()

    def lane(self, lane: int) -> contextlib.AbstractContextManager:
        """Around one forward's launch on `lane` (the worker's thread)."""
        return self._on(self.encoders[lane])

    def record_pre(self):
        """An event marking the preprocessing queued so far (None on the CPU)."""
        return self._record(self.pre)

    def _record(self, stream):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def hand_over(self, ready, tensors, lane: int = 0) -> None:
        """The lane's stream waits for `ready` (the preprocessing that wrote `tensors`), and the
        allocator keeps `tensors`' memory from the preprocessing stream until the lane's work queued
        so far has read them (record_stream): without it the next request's preprocessing could reuse
        the memory while the forward still reads it."""
        if not self.cuda or ready is None:
            return
        stream = self.encoders[lane]
        stream.wait_event(ready)
        for t in tensors:
            if t.is_cuda:
                t.record_stream(stream)

    def before_forward(self, lane: int, side_by_side: bool) -> None:
        """Orders a forward about to be launched on `lane` (see the class notes)."""
        if not self.cuda:
            return
        stream = self.encoders[lane]
        if not side_by_side:
            for other in self.encoders:
                if other is not stream:
                    stream.wait_stream(other)
        elif self._last_exclusive is not None:
            stream.wait_event(self._last_exclusive)

    def after_forward(self, lane: int, side_by_side: bool):
        """The event marking the forward just launched on `lane` (None on the CPU)."""
        done = self._record(self.encoders[lane])
        if not side_by_side:
            self._last_exclusive = done
        return done

    @staticmethod
    def wait(done) -> None:
        """Blocks (without the GIL) until the work `done` marks has run."""
        if done is not None:
            done.synchronize()
