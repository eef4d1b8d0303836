"""How busy the GPU was, from a torch profiler trace: the union of every kernel, copy and memset on
every stream, the idle gaps between them, how much two streams overlapped, and the kernels by name.
It answers the question the fused model's shortfall at concurrency 16 raises (docs/triton_runtime.md):
is the GPU idle between forwards, or are the forwards themselves slower than the encoder alone's?

    # a trace the fused model wrote (KIMI_PROFILE_DIR with KIMI_PROFILE_TRACE=1), per request:
    python -m tools.gpu_timeline /tmp/prof/kimi_k25_vision_fused-123.json --requests 40
    # the encoder alone, as bench.perf times it (CUDA graphs, one request after another), traced here:
    python -m tools.gpu_timeline --encoder-alone /tmp/alone.json --checkpoint /tmp/kimi-random --images 8x448
    # both side by side (the kernels by name, their mean durations in each):
    python -m tools.gpu_timeline A.json --requests 40 --compare B.json --compare-requests 40

The summary is a pure function of the trace's GPU events (tests/unit/test_gpu_timeline.py).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_BOUNDS_US = (10.0, 100.0, 1000.0)  # idle gaps counted at or above each bound


def gpu_events(trace: dict) -> list[dict]:
    """The complete GPU events ('X' phase) of a chrome trace as torch's profiler writes it."""
    return [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat", "").lower() in GPU_CATEGORIES and "dur" in e]


def load(path: Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def summarize(events: list[dict]) -> dict:
    """Span, busy time (the union of all GPU events), idle gaps, overlap and per-stream sums, in us."""
    if not events:
        return {"events": 0}
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events)
    busy, gaps = 0.0, []
    start, end = spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    span = max(e for _, e in spans) - spans[0][0]
    durations = sum(e - s for s, e in spans)
    streams: dict = defaultdict(lambda: [0, 0.0])
    for e in events:
        stream = streams[(e.get("args") or {}).get("stream", "?")]
        stream[0] += 1
        stream[1] += float(e["dur"])
    return {
        "events": len(events), "span_us": span, "busy_us": busy, "idle_us": span - busy,
        # the sum of durations beyond the union: time two events ran at once (three at once count twice)
        "overlap_us": durations - busy,
        "gaps": {bound: (sum(1 for g in gaps if g >= bound), sum(g for g in gaps if g >= bound))
                 for bound in GAP_BOUNDS_US},
        "largest_gaps_us": sorted(gaps, reverse=True)[:5],
        "streams": {str(k): (n, total) for k, (n, total) in sorted(streams.items(), key=lambda kv: -kv[1][1])},
    }


def gap_details(trace: dict, n: int = 8) -> list[str]:
    """The `n` longest idle gaps of the GPU, each with the GPU events either side and the host call that
    launched the event after it: launched after the gap began means the host was late (the GPU had
    nothing queued); launched before means the GPU waited on something else (an event, a dependency)."""
    events = sorted(gpu_events(trace), key=lambda e: float(e["ts"]))
    if not events:
        return []
    origin = float(events[0]["ts"])
    runtime = {(e.get("args") or {}).get("correlation"): e for e in trace.get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat", "").lower() in ("cuda_runtime", "cuda_driver")}
    threads = {e.get("tid"): (e.get("args") or {}).get("name", "") for e in trace.get("traceEvents", [])
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    ops = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat", "").lower() == "cpu_op"]
    gaps, last, end = [], events[0], float(events[0]["ts"]) + float(events[0]["dur"])
    for e in events[1:]:
        start = float(e["ts"])
        if start > end:
            gaps.append((start - end, end, last, e))
        if start + float(e["dur"]) > end:
            last, end = e, start + float(e["dur"])
    lines = []
    for gap, at, before, after in sorted(gaps, key=lambda g: -g[0])[:n]:
        stream = lambda ev: (ev.get("args") or {}).get("stream", "?")  # noqa: E731
        line = (f"- {gap:.0f} us idle at +{(at - origin) / 1000:.1f} ms: after {before.get('name', '?')[:40]} "
                f"(stream {stream(before)}), then {after.get('name', '?')[:40]} (stream {stream(after)})")
        launch = runtime.get((after.get("args") or {}).get("correlation"))
        if launch is not None:
            ts, tid = float(launch["ts"]), launch.get("tid")
            around = [o for o in ops if o.get("tid") == tid and float(o["ts"]) <= ts <= float(o["ts"]) + float(o["dur"])]
            outer = max(around, key=lambda o: float(o["dur"]), default=None)
            line += (f"; launched by {launch.get('name', '?')} at {ts - at:+.0f} us from the gap's start on "
                     f"{threads.get(tid, tid)}" + (f", inside {outer.get('name', '?')[:50]}" if outer else ""))
        lines.append(line)
    return lines


def kernels_by_name(events: list[dict]) -> dict[str, tuple[int, float]]:
    """name -> (count, total us), GPU events only."""
    table: dict = defaultdict(lambda: [0, 0.0])
    for e in events:
        row = table[e.get("name", "?")]
        row[0] += 1
        row[1] += float(e["dur"])
    return {k: (n, t) for k, (n, t) in table.items()}


def report(summary: dict, requests: int | None, label: str) -> list[str]:
    if not summary.get("events"):
        return [f"{label}: no GPU events in the trace"]
    per = requests or 1
    unit = "per request" if requests else "in the window"
    ms = lambda us: us / 1000 / per  # noqa: E731
    lines = [f"{label}: {summary['events']} GPU events; {unit}: span {ms(summary['span_us']):.2f} ms, "
             f"busy {ms(summary['busy_us']):.2f} ms ({summary['busy_us'] / summary['span_us']:.1%} of the span), "
             f"idle {ms(summary['idle_us']):.2f} ms, overlap (durations beyond the busy time) {ms(summary['overlap_us']):.2f} ms"]
    lines.append("  idle gaps: " + "; ".join(
        f">= {bound:g} us: {n} totalling {total / 1000:.2f} ms" for bound, (n, total) in summary["gaps"].items())
        + "; largest " + ", ".join(f"{g:.0f}" for g in summary["largest_gaps_us"]) + " us")
    lines.append("  streams (events, busy ms " + unit + "): " + ", ".join(
        f"{stream}: {n} / {ms(total):.2f}" for stream, (n, total) in list(summary["streams"].items())[:6]))
    return lines


def compare(a: dict, a_requests: int, b: dict, b_requests: int, labels: tuple[str, str], rows: int = 25) -> list[str]:
    """The kernels by name: per request, calls and total us in each trace, largest in `a` first."""
    names = sorted(set(a) | set(b), key=lambda k: -(a.get(k, (0, 0.0))[1] + b.get(k, (0, 0.0))[1]))
    lines = [f"| kernel | {labels[0]}: calls, us per request | {labels[1]}: calls, us per request | difference us |",
             "|---|---|---|---|"]
    total = [0.0, 0.0]
    for name in names:
        (na, ta), (nb, tb) = a.get(name, (0, 0.0)), b.get(name, (0, 0.0))
        total[0] += ta / a_requests
        total[1] += tb / b_requests
        if len(lines) < rows + 2:
            lines.append(f"| {name[:90]} | {na / a_requests:.1f}, {ta / a_requests:.1f} | "
                         f"{nb / b_requests:.1f}, {tb / b_requests:.1f} | {ta / a_requests - tb / b_requests:+.1f} |")
    lines.append(f"| all | {total[0]:.1f} | {total[1]:.1f} | {total[0] - total[1]:+.1f} |")
    return lines


def trace_encoder_alone(path: Path, checkpoint: Path, images: str, requests: int) -> None:
    """The encoder as bench.perf's encoder alone runs it (bf16, CUDA graphs, one request after another
    with no sync between), `requests` forwards under torch's profiler, written to `path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from backends.weights.load import load_model
    from bench.perf import encoder_workload, request_images

    model, cfg = load_model(checkpoint, "cuda", torch.bfloat16)
    encoder, (pixels, grids), _ = encoder_workload(model, cfg, request_images(images), 16, 1)
    for _ in range(5):
        encoder(pixels, grids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(requests):
            encoder(pixels, grids)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path, nargs="?", help="a chrome trace (.json or .json.gz) to summarize")
    ap.add_argument("--requests", type=int, default=None, help="requests in the trace's window (per-request figures)")
    ap.add_argument("--compare", type=Path, default=None, help="a second trace: kernels by name side by side")
    ap.add_argument("--compare-requests", type=int, default=None)
    ap.add_argument("--encoder-alone", type=Path, default=None, help="write the encoder alone's trace here first")
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--images", default="8x448")
    ap.add_argument("--alone-requests", type=int, default=40)
    args = ap.parse_args(argv)
    if args.encoder_alone is not None:
        if args.checkpoint is None:
            ap.error("--encoder-alone needs --checkpoint")
        trace_encoder_alone(args.encoder_alone, args.checkpoint, args.images, args.alone_requests)
        if args.trace is None:
            args.trace, args.requests = args.encoder_alone, args.alone_requests
    if args.trace is None:
        ap.error("give a trace, or --encoder-alone")
    trace = load(args.trace)
    events = gpu_events(trace)
    print("\n".join(report(summarize(events), args.requests, args.trace.name)))
    print("  the longest idle gaps:")
    print("\n".join(gap_details(trace)))
    if args.compare is not None:
        other = gpu_events(load(args.compare))
        print("\n".join(report(summarize(other), args.compare_requests, args.compare.name)))
        print()
        print("\n".join(compare(kernels_by_name(events), args.requests or 1, kernels_by_name(other),
                                args.compare_requests or 1, (args.trace.name, args.compare.name))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
