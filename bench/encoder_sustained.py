"""The encoder alone in a short burst and under sustained load, with the GPU's SM clock beside each.

bench/perf.py compares served images/s with "the encoder alone": a graph replay timed 20 times after 3
warm-ups, about half a second of work (and a full batch 5 times after 2). perf_analyzer's figure comes from many seconds of load. If the
GPU holds a higher clock for half a second than for ten, the burst figure is a rate that no sustained
service could reach, the encoder itself included. This bench times the same forward both ways in one
process, one after the other, and samples `nvidia-smi` (SM clock, power draw and limit) every 100 ms
meanwhile (nvidia-smi's power reading is itself an average, so a burst's watts lag):

- `burst`: 20 calls after 3 warm-ups (bench/perf.py's measurement of one request);
- `sustained`: calls one after another for `--seconds` (the host waits for each), over the last half;
- `back to back`: calls queued with no host wait between them for `--seconds` (as a loaded server keeps
  the GPU fed; bench/perf.py's `--alone-seconds` figure), over the last half;
- the same two for a full moonvit3d batch (`--batch` requests in one forward, eager over the graphs'
  patch bound), which is what the encoder runs under concurrency.

The GPU idles `--rest` seconds before each burst, so that each starts from the same state. Recorded, never
asserted.

    python -m bench.encoder_sustained --checkpoint /tmp/kimi-random --images 1024,8x448 --out bench/out
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from backends.deploy.repository import Deployment
from backends.weights.load import load_model
from bench.gpu_clocks import ClockSampler
from bench.gpu_timing import back_to_back, machine_line, timed, write_report
from bench.perf import encoder_workload, request_images


def _one(fn) -> float:
    return timed(fn, 1, warmup=0)[0]


def burst(fn, clocks: ClockSampler) -> tuple[float, str]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()  # the warm-ups are done: the window below holds the timed calls alone
    t0 = time.perf_counter()  # the clock and power of the timed calls, not of the warm-ups
    times = timed(fn, 20, warmup=0)
    return statistics.median(times), clocks.between(t0, time.perf_counter())


def sustained(fn, seconds: float, clocks: ClockSampler) -> tuple[float, str]:
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        times.append((time.perf_counter(), _one(fn)))
    half = start + seconds / 2
    return statistics.median(ms for t, ms in times if t >= half), clocks.between(half, time.perf_counter())


def measure(model, cfg, kind: str, batch: int, seconds: float, rest: float, clocks: ClockSampler,
            results: list) -> list[str]:
    """The table lines for one request kind; each row's numbers also go to `results`."""
    encoder, (pixels, grids), (batch_pixels, batch_grids) = encoder_workload(
        model, cfg, request_images(kind), Deployment("gpu").cuda_graphs, batch)
    one = (lambda: encoder(pixels, grids), 1)
    full = (lambda: encoder(batch_pixels, batch_grids), batch)
    lines = [f"### {kind}: {pixels.shape[0]} patches per request; a full batch of {batch} "
             f"({'graphed' if encoder.applies(batch_pixels.shape[0]) else 'eager'})", "",
             "| forward | how | ms per request | images/s | SM clock, power (median) |", "|---|---|---|---|---|"]
    images = len(grids)
    for label, (fn, n) in (("one request", one), (f"{batch} requests", full)):
        for how in ("burst", "sustained", "back to back", "burst"):
            time.sleep(rest)
            ms, clock = (burst(fn, clocks) if how == "burst" else sustained(fn, seconds, clocks) if how == "sustained"
                         else back_to_back(fn, seconds, clocks))
            ms /= n
            lines.append(f"| {label} | {how} | {ms:.2f} | {1000 / ms * images:.1f} | {clock} |")
            results.append({"images": kind, "forward": label, "how": how, "ms_per_request": ms, "clock": clock})
    return lines + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="", help="checkpoint folder (empty: the small demo model)")
    ap.add_argument("--images", default="1024,8x448", help="request kinds, as bench/perf.py's --images")
    ap.add_argument("--batch", type=int, default=Deployment("gpu").max_batch, help="requests in a full batch")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each sustained run")
    ap.add_argument("--rest", type=float, default=2.0, help="idle seconds before each run")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    model, cfg = load_model(args.checkpoint, "cuda", torch.bfloat16)
    clocks = ClockSampler()
    results: list = []
    lines = ["# The encoder alone: a short burst against sustained load", "", machine_line(), "",
             f"$ python -m bench.encoder_sustained --checkpoint {args.checkpoint or '(demo)'} --images {args.images} "
             f"--batch {args.batch} --seconds {args.seconds:g} --rest {args.rest:g}", ""]
    try:
        for kind in args.images.split(","):
            lines += measure(model, cfg, kind, args.batch, args.seconds, args.rest, clocks, results)
    finally:
        complaint = clocks.close()
    lines.append(complaint or f"power limit reported by nvidia-smi: {clocks.limit_w:.0f} W")
    write_report(Path(args.out), "encoder_sustained", lines, {"runs": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
