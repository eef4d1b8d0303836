"""Host code run once per request is slower than the same code in a benchmark loop (any machine).

    python -m bench.cold_bench [--out bench/out]

Why: inside the server each stub runs a few milliseconds of Python per request and then waits while
the other stubs and the GPU work, so at low load its code runs "cold" (caches and branch predictors
trained by other work), while an in-process loop (`timed` in bench/gpu_timing.py, the "alone" columns
of bench/stage_bench.py) keeps it hot. This measures the placeholder step called with IMAGES, as a
direct caller of kimi_placeholder runs it (header reads and id expansion: pure host work; the ensemble
no longer runs it so, it hands the step preprocessing's counts and no image), back to back, and after
20 ms of other work between calls: sleeping, spinning in Python, or sweeping 64 MiB of memory. Medians
of --iters calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from backends.config import DEMO_CONFIG
from backends.serving.steps import PlaceholderStep
from bench.cases import case_jpegs
from bench.gpu_timing import machine_line, spin, write_report
from contract import chat_prompt_ids

GAP_S = 0.02


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--iters", type=int, default=60)
    args = ap.parse_args(argv)
    junk = np.zeros(64 << 20, np.uint8)

    def sweep(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            junk[::64] += 1

    gaps = {"none (hot loop)": None, "sleep 20 ms": lambda: time.sleep(GAP_S), "spin 20 ms": lambda: spin(GAP_S),
            "sweep 64 MiB for 20 ms": lambda: sweep(GAP_S)}
    step = PlaceholderStep(DEMO_CONFIG)
    cases = {case: case_jpegs(case) for case in ("1x1024^2", "8x448^2")}
    results: dict = {}
    lines = ["# Per-request host code, hot and cold\n", f"{machine_line()}\n",
             f"`PlaceholderStep` (kimi_placeholder's work: headers, plan, id expansion), median of {args.iters} calls, ms.\n",
             "| case | " + " | ".join(gaps) + " |", "|---|" + "---|" * len(gaps)]
    for case, blobs in cases.items():
        ids = np.asarray(chat_prompt_ids(len(blobs)), np.int64)
        for _ in range(10):
            step(ids, blobs)
        row = {}
        for name, gap in gaps.items():
            times = []
            for _ in range(args.iters):
                if gap:
                    gap()
                t = time.perf_counter()
                step(ids, blobs)
                times.append(time.perf_counter() - t)
            row[name] = statistics.median(times) * 1e3
        results[case] = row
        lines.append(f"| {case} | " + " | ".join(f"{row[n]:.3f}" for n in gaps) + " |")
    write_report(args.out, "cold_bench", lines, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
