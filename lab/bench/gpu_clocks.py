"""The GPU's SM clock and power draw, sampled from `nvidia-smi` every 100 ms while a benchmark runs.

Why: the H200 runs the encoder near its power limit, and its clock then follows the power drawn; the
same kernels take longer at a lower clock. A figure timed in a short burst and one timed under many
seconds of load are only comparable with their clocks beside them (lab/bench/perf.py prints them;
docs/findings.md#the-power-limit-and-the-encoders-burst). Recorded, never asserted.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import threading
import time


def median_clock(samples: list[tuple[float, float]]) -> str:
    """'1755 MHz, 690 W' from (MHz, watts) samples; '-' for none."""
    if not samples:
        return "-"
    return f"{statistics.median(m for m, _ in samples):.0f} MHz, {statistics.median(w for _, w in samples):.0f} W"


def gpu_id() -> str:
    """This process's cuda:0 as nvidia-smi names it: its UUID where this process has a CUDA context
    (nvidia-smi's indices ignore CUDA_VISIBLE_DEVICES), else CUDA_VISIBLE_DEVICES' first entry or 0.
    Never creates a context (lab/bench/perf.py's process must not, before its server runs)."""
    import torch

    if torch.cuda.is_initialized():
        uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", "") or "")
        if uuid:
            return uuid if uuid.startswith("GPU-") else "GPU-" + uuid
    return (os.environ.get("CUDA_VISIBLE_DEVICES", "") or "0").split(",")[0].strip() or "0"


class ClockSampler:
    """(time, SM MHz, watts) every 100 ms from `nvidia-smi -lms`, for this process's cuda:0."""

    def __init__(self):
        self.samples: list[tuple[float, float, float]] = []
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                 "-lms", "100", "-i", gpu_id()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                mhz, watts = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), mhz, watts))

    def between(self, t0: float, t1: float) -> str:
        """The median SM clock and power of the samples taken between two time.perf_counter() readings."""
        return median_clock([(m, w) for t, m, w in self.samples if t0 <= t <= t1])

    def close(self) -> str:
        """Stops sampling; nvidia-smi's complaint if it gave no sample (a rejected -i or field)."""
        if self.proc is None:
            return "nvidia-smi not found"
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "" if self.samples else "nvidia-smi gave no samples and did not stop"
        # stdout belongs to the reader thread; stderr is read here, once nvidia-smi has exited.
        return "" if self.samples else f"nvidia-smi gave no samples: {self.proc.stderr.read().strip()[:300]}"
