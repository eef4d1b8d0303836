"""Optional profiling of the models' own work inside the Triton stubs (KIMI_PROFILE_DIR).

With KIMI_PROFILE_DIR set, each model instance profiles a window of its `execute` calls (after
KIMI_PROFILE_SKIP calls, default 5, and once the file KIMI_PROFILE_TRIGGER exists if that is set,
the next KIMI_PROFILE_CALLS, default 5) with torch's profiler (host and CUDA activity) and cProfile
(the Python around the torch ops), and writes both tables to <dir>/<model>-<pid>.txt when the window
ends or the model is unloaded; with KIMI_PROFILE_TRACE=1 also torch's chrome trace beside it
(<model>-<pid>.json, for tools/gpu_timeline.py: how busy the GPU was). Off (and free) otherwise.
bench/stage_bench.py uses it.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import logging
import os
import pstats
import threading
from pathlib import Path

from backends.config import env_flag, env_int

log = logging.getLogger(__name__)


class ExecuteProfiler:
    def __init__(self, model: str):
        self.dir = os.environ.get("KIMI_PROFILE_DIR", "")
        self.skip = env_int("KIMI_PROFILE_SKIP", 5)
        self.calls = max(1, env_int("KIMI_PROFILE_CALLS", 5))
        # Optional: the window opens only once this file exists (a benchmark creates it after its
        # measured requests; with several instances per model, call counts per instance are unknown).
        self.trigger = os.environ.get("KIMI_PROFILE_TRIGGER", "")
        # KIMI_PROFILE_TORCH=0: cProfile only. torch's profiler (CUPTI) makes CUDA API calls slower, so
        # host times under it are inflated; cProfile alone costs ~1 us per Python call.
        self.torch = env_flag("KIMI_PROFILE_TORCH", True) if self.dir else True  # read only when profiling
        self.model, self.seen, self.prof, self.py, self.opened, self.in_window = model, 0, None, None, 0, 0

    def __call__(self):
        """A context manager around one execute call."""
        if not self.dir:
            return contextlib.nullcontext()
        self.seen += 1
        if self.prof is not None:
            if self.in_window == self.calls:
                self.close()  # before this call: the window holds exactly `calls` calls
            else:
                self.in_window += 1
        elif not self.opened and self.seen > self.skip and (not self.trigger or os.path.exists(self.trigger)):
            try:
                self._open()
            except Exception:  # noqa: BLE001 - a diagnostic must never cost a request
                log.exception("%s: could not start profiling; profiling off", self.model)
                self.dir, self.prof, self.py = "", None, None
        return contextlib.nullcontext()

    def _open(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.opened, self.in_window = self.seen, 1
        # is_initialized, not is_available: a CPU model (the placeholder) on a GPU host has no CUDA
        # context, and profiling it must not create one (nor time its creation).
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_initialized() else [])
        self.prof = profile(activities=activities) if self.torch else contextlib.nullcontext()
        self.prof.__enter__()
        # torch's profiler sees torch ops only; cProfile sees the Python around them on this thread
        # (IPC calls to the server such as is_cancelled(), header reads, conversions; our metric
        # updates go out from their own thread, backends/serving/metrics.py).
        self.py = cProfile.Profile()
        self.py.enable()

    def close(self) -> None:
        """Ends an open window and writes its tables (also called as the model is unloaded, so a window
        that saw fewer calls than asked for is still written)."""
        if self.prof is None:
            return
        import torch

        try:
            self.py.disable()  # before the synchronize: it is the profiler's wait, not the window's work
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            sort = "self_cuda_time_total" if torch.cuda.is_initialized() else "self_cpu_time_total"
            table = self.prof.key_averages().table(sort_by=sort, row_limit=40) if self.torch else "(torch profiler off)"
            threads = ", ".join(t.name for t in threading.enumerate())
            out = Path(self.dir) / f"{self.model}-{os.getpid()}.txt"
            out.parent.mkdir(parents=True, exist_ok=True)
            if self.torch and env_flag("KIMI_PROFILE_TRACE", False):
                self.prof.export_chrome_trace(str(out.with_suffix(".json")))
            out.write_text(f"{self.model}: {self.in_window} execute calls from call {self.opened}\n"
                           f"Python threads: {threads}; CUDA device flags: {cuda_device_flags()}\n"
                           f"(a window's own host time: Self CPU; GPU kernels: Self CUDA)\n{table}\n"
                           f"Python, by cumulative time:\n{python_table(self.py)}\n")
        except Exception:  # noqa: BLE001 - a diagnostic must never cost a request
            log.exception("%s: could not write the profile; profiling off", self.model)
            self.dir = ""
        finally:
            self.prof = self.py = None


def python_table(profile: cProfile.Profile, rows: int = 35) -> str:
    """A cProfile's most expensive functions by cumulative time, as pstats prints them."""
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(rows)
    return text.getvalue()


def cuda_device_flags() -> str:
    """cudaGetDeviceFlags of this process's current device, e.g. whether a host waiting for the GPU
    spins or blocks (a blocking wait adds an OS wake-up to every synchronization)."""
    import ctypes

    import torch

    if not torch.cuda.is_initialized():
        return "no CUDA context in this process"
    try:
        flags = ctypes.c_uint(0)
        # The runtime torch already loaded (dlopen by soname returns the loaded copy).
        lib = ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
        status = lib.cudaGetDeviceFlags(ctypes.byref(flags))
        schedule = {0: "auto", 1: "spin", 2: "yield", 4: "blocking_sync"}.get(flags.value & 7, hex(flags.value & 7))
        return f"{hex(flags.value)} (schedule {schedule}, status {int(status)})"
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        return f"unknown ({type(exc).__name__}: {exc})"
