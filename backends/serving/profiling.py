"""An operator's profiling switch for the models' own work inside the Triton stubs (KIMI_PROFILE_DIR).

With KIMI_PROFILE_DIR set in the server's environment, each model instance profiles a window of its
`execute` calls: it lets SKIP calls go by (first-call work: kernel compilation, graph captures), then
records the next CALLS with torch's profiler (host and CUDA activity) and cProfile (the Python around
the torch ops), and writes <dir>/<model>-<pid>.txt (both tables) and <dir>/<model>-<pid>.json (torch's
chrome trace, for Perfetto or chrome://tracing) when the window ends or the model is unloaded. Unset,
it costs one attribute check per execute call.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import logging
import os
import pstats
from pathlib import Path

log = logging.getLogger(__name__)

SKIP, CALLS = 5, 5


class ExecuteProfiler:
    def __init__(self, model: str, skip: int = SKIP, calls: int = CALLS):
        self.dir = os.environ.get("KIMI_PROFILE_DIR", "")
        self.model, self.skip, self.calls = model, skip, max(1, calls)
        self.seen, self.opened, self.in_window = 0, 0, 0
        self.prof, self.py = None, None

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
        elif not self.opened and self.seen > self.skip:
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
        # context, and profiling it must not create one.
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_initialized() else [])
        self.prof = profile(activities=activities)
        self.prof.__enter__()
        self.py = cProfile.Profile()  # the Python around the torch ops, on this thread
        self.py.enable()

    def close(self) -> None:
        """Ends an open window and writes it (also called as the model is unloaded, so a window that saw
        fewer calls than asked for is still written)."""
        if self.prof is None:
            return
        import torch

        try:
            self.py.disable()  # before the synchronize: it is the profiler's wait, not the window's work
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            sort = "self_cuda_time_total" if torch.cuda.is_initialized() else "self_cpu_time_total"
            out = Path(self.dir) / f"{self.model}-{os.getpid()}.txt"
            out.parent.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(out.with_suffix(".json")))
            out.write_text(f"{self.model}: {self.in_window} execute calls from call {self.opened}\n"
                           f"{self.prof.key_averages().table(sort_by=sort, row_limit=40)}\n"
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
