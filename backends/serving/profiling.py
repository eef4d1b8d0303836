"""Optional profiling of the models' own work inside the Triton stubs (KIMI_PROFILE_DIR).

With KIMI_PROFILE_DIR set, each model instance profiles a window of its `execute` calls (after
KIMI_PROFILE_SKIP calls, default 5, the next KIMI_PROFILE_CALLS, default 5) with torch's profiler,
host and CUDA activity, and writes the table of the most expensive operations to
<dir>/<model>-<pid>.txt. Off (and free) otherwise. bench/stage_bench.py uses it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


class ExecuteProfiler:
    def __init__(self, model: str):
        self.dir = os.environ.get("KIMI_PROFILE_DIR", "")
        self.skip = int(os.environ.get("KIMI_PROFILE_SKIP", "5"))
        self.calls = int(os.environ.get("KIMI_PROFILE_CALLS", "5"))
        self.model, self.seen, self.prof = model, 0, None

    def __call__(self):
        """A context manager around one execute call."""
        if not self.dir:
            return contextlib.nullcontext()
        self.seen += 1
        if self.seen == self.skip + 1:
            import torch
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=activities)
            self.prof.__enter__()
        if self.prof is not None and self.seen == self.skip + self.calls + 1:
            self._finish()
        return contextlib.nullcontext()

    def _finish(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = self.prof.key_averages().table(sort_by=sort, row_limit=40)
        out = Path(self.dir) / f"{self.model}-{os.getpid()}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"{self.model}: {self.calls} execute calls after {self.skip}\n"
                       f"(a window's own host time: Self CPU; GPU kernels: Self CUDA)\n{table}\n")
        self.prof = None
