"""The host threads that preprocessing shares across every Preprocessor of a process: Pillow decodes
and resizes, which drop the GIL while they work. The JPEG scan check has its own C threads
(scan_check.THREADS), not this pool: a Python thread needs the GIL to start and to end each job, and a
check is short enough for that wait to matter."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container or taskset may give it fewer
    than the host has), else the host's count."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


THREADS = min(8, available_cores())

_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    """The process-wide pool, started on first use (concurrent first calls must not each start one:
    idle threads never exit)."""
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="kimi-decode")
    return _POOL
