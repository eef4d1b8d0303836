"""Timing helpers for GPU benchmarks: CUDA-event medians, the machine's bf16 matmul peak and its
device-to-device copy bandwidth, both measured in the same run as the numbers they normalize."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def cuda_time_ms(fn, *, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of fn() over `iters` runs, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_time_ms(fn, *, iters: int = 10) -> float:
    """Median milliseconds of replaying fn() captured in a CUDA graph: GPU time without launch costs."""
    fn()  # compile / warm caches before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time_ms(graph.replay, iters=iters)


def timed(fn, iters: int, warmup: int = 2) -> list[float]:
    """Wall-clock milliseconds of fn() per run (host work included); a GPU, if present, is synchronized
    before and after each run."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def back_to_back(fn, seconds: float, clocks=None) -> tuple[float, str]:
    """fn (GPU work) queued call after call for `seconds`, the host waiting only every 8 calls so that the
    GPU never idles: ms per call over the second half, and the clock then ('-' without a sampler)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    half_at, half_calls, calls = None, 0, 0
    while True:
        for _ in range(8):
            fn()
        calls += 8
        torch.cuda.synchronize()
        now = time.perf_counter()
        if half_at is None and now - start >= seconds / 2:
            half_at, half_calls = now, calls
        if now - start >= seconds and calls > half_calls:
            break
    return (now - half_at) * 1000 / (calls - half_calls), (clocks.between(half_at, now) if clocks else "-")


def wall_time_ms(fn, *, warmup: int = 1, iters: int = 5) -> float:
    """Median of `timed`."""
    return statistics.median(timed(fn, iters, warmup))


def matmul_peak_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, warmup=5, iters=20)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, counting bytes read + written (GB/s)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def machine_line() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{platform.node()} | {name} | torch {torch.__version__} | "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def write_report(out: Path, name: str, lines: list[str], results: dict) -> None:
    """Print the markdown table and keep it (name.md) with the raw numbers (name.json) under out/; the
    table, under the command that made it, also becomes section `name` of this machine's results page
    (lab/results/<kind>.md)."""
    from lab.bench.results_page import write_section

    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    command = "$ python -m " + " ".join([f"lab.bench.{Path(sys.argv[0]).stem}", *sys.argv[1:]])
    write_section("gpu" if torch.cuda.is_available() else "cpu", name, f"{command}\n\n{text}")
