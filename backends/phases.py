"""Where a request's host time goes inside one step, phase by phase (KIMI_PHASES=1; off otherwise, and
then a mark costs one check of a flag).

tritonserver's trace (clients/tracing.py) says how long a request stays in each stub; this says what
our code does with that time. The adapter calls `begin()` when a request's (or a batch's) work starts;
code anywhere below it calls `mark(name)` as a phase ends, charging the time since the previous mark
to `name` (a phase marked again, e.g. once per run of images, adds up); `end()` returns the phases in
the order they were first marked, name -> seconds, and the adapter counts them
(kimi_vision_phase_seconds_total, backends/serving/metrics.py). The clock is per thread: requests on
other threads do not mix in. Host time only: GPU work launched in a phase runs on after it, and a
phase that waits for the GPU holds that wait.
"""

from __future__ import annotations

import threading
import time

from backends.config import env_flag

ENABLED = env_flag("KIMI_PHASES", False)
_local = threading.local()


def begin() -> None:
    """Start a request's clock on this thread (a clock left open by a failed request is dropped)."""
    if ENABLED:
        _local.clock = [time.perf_counter(), {}]


def mark(name: str) -> None:
    """The phase `name` ends now: the time since the previous mark (or `begin`) is its."""
    if not ENABLED:
        return
    clock = getattr(_local, "clock", None)
    if clock is None:  # no request open on this thread (e.g. a benchmark calling the code directly)
        return
    now = time.perf_counter()
    clock[1][name] = clock[1].get(name, 0.0) + (now - clock[0])
    clock[0] = now


def end() -> dict[str, float]:
    """The request's phases, name -> seconds, in the order first marked; the clock closes."""
    if not ENABLED:
        return {}
    clock = getattr(_local, "clock", None)
    _local.clock = None
    return clock[1] if clock is not None else {}
