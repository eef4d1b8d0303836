"""Image sizes the server has not seen: the first request after start-up, and 40 random sizes twice.

    python -m lab.bench.mixed_sizes [--device gpu --checkpoint DIR] [--images 40] [--section mixed_sizes]

Starts the deployment (cold start to ready timed: model load and start-up captures included), then one
chat at a time (concurrency 1), each request one photo-like JPEG (quality 90):
1. the first request after start-up: 1 x 1024^2;
2. pass 1: `--images` JPEGs of distinct random sizes (each side 500-1500, seeded), none seen before;
3. pass 2: the same sizes again, with new content (so that the embedding cache misses and every image is
   decoded and encoded as in pass 1: only the sizes have been seen);
4. steady: `--steady` more 1 x 1024^2 requests, new content each.
Prints p50 / p90 / max of each pass, pass 1's p90 over pass 2's, and the first request over the steady p50
(issue targets: at most 1.1x and 1.2x); for the first request, the slowest pass-1 request and their twins,
where the time went by model (the server's own statistics: queue + compute of each composing model). On a GPU the embeddings go into a CUDA region registered once
before the first request, so that what is timed is the service, not the trip back.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient

from backends.deploy.launcher import deployment_server, resolve_device
from backends.deploy.repository import Deployment
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from lab.bench.cases import jpeg, random_sizes
from lab.bench.results_page import report
from lab.bench.server_stats import breakdown, model_ns


def summary(ms: list[float]) -> str:
    s = sorted(ms)
    return f"p50 {statistics.median(s):.1f}, p90 {s[int(0.9 * (len(s) - 1))]:.1f}, max {s[-1]:.1f} ms"


def p90(ms: list[float]) -> float:
    s = sorted(ms)
    return s[int(0.9 * (len(s) - 1))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    ap.add_argument("--checkpoint", default=os.environ.get("KIMI_VISION_CHECKPOINT", ""))
    ap.add_argument("--images", type=int, default=40)
    ap.add_argument("--steady", type=int, default=20)
    ap.add_argument("--section", default="")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    gpu = device == "gpu"
    sizes = random_sizes(args.images)
    # Every image made before the server starts: the clock sees requests only.
    first = jpeg(1024, 1024, seed=1)
    passes = [[jpeg(w, h, seed=10_000 * p + i) for i, (w, h) in enumerate(sizes)] for p in (1, 2)]
    steady = [jpeg(1024, 1024, seed=50_000 + i) for i in range(args.steady)]
    t0 = time.monotonic()
    with deployment_server(Deployment(device=device, checkpoint=args.checkpoint), f"mixed-{device}") as server:
        cold = time.monotonic() - t0
        client = KimiVisionClient(server.grpc_url)
        stats = grpcclient.InferenceServerClient(server.grpc_url)
        region = None
        if gpu:
            from clients.kimi_client import CudaOutputRegion

            region = CudaOutputRegion(client, 1 << 30)

        where: dict[tuple, str] = {}  # (pass, index) -> that request's time by model

        def send(blob: bytes, tag: tuple) -> float:
            ids = chat_prompt_ids(1)
            before = model_ns(stats.get_inference_statistics(as_json=True))
            t = time.perf_counter()
            if region is not None:
                client.infer_into(region, ids, [blob])
            else:
                client.infer(ids, [blob])
            ms = (time.perf_counter() - t) * 1000
            where[tag] = breakdown(before, model_ns(stats.get_inference_statistics(as_json=True)))
            return ms

        try:
            first_ms = send(first, ("first", 0))
            results = [[send(b, (p, i)) for i, b in enumerate(blobs)] for p, blobs in enumerate(passes)]
            steady_ms = [send(b, ("steady", i)) for i, b in enumerate(steady)]
        finally:
            if region is not None:
                region.close()
            client.close()
            stats.close()
    one, two = results
    worst = max(range(len(one)), key=lambda i: one[i] / two[i])
    typical = min(range(len(steady_ms)), key=lambda i: abs(steady_ms[i] - statistics.median(steady_ms)))
    steady_p50 = statistics.median(steady_ms)
    lines = [f"$ python -m lab.bench.mixed_sizes {' '.join(sys.argv[1:] if argv is None else argv)}",
             f"{platform.node()}, device={device}, checkpoint={args.checkpoint or 'embedded demo'}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}; one request at a time, one JPEG each; embeddings "
             f"{'into a CUDA region registered once' if gpu else 'in the gRPC response'}",
             f"cold start to ready: {cold:.1f} s",
             f"first request after start-up (1 x 1024^2): {first_ms:.1f} ms; steady 1 x 1024^2 ({args.steady} new "
             f"images): {summary(steady_ms)}; first / steady p50 = {first_ms / steady_p50:.2f}x",
             f"{args.images} random sizes (sides 500-1500), pass 1 (sizes never seen): {summary(one)}",
             f"the same sizes, new content, pass 2: {summary(two)}",
             f"pass 1 p90 / pass 2 p90 = {p90(one) / p90(two):.2f}x; slowest pass-1 request over its pass-2 twin: "
             f"{one[worst] / two[worst]:.2f}x",
             "where the time went, ms by model (queue + compute; the rest is hand-offs and the client):",
             f"  first request {first_ms:.1f}: {where[('first', 0)]}; a steady request {steady_ms[typical]:.1f}: "
             f"{where[('steady', typical)]}",
             f"  slowest pass-1 request ({sizes[worst][0]}x{sizes[worst][1]}) {one[worst]:.1f}: {where[(0, worst)]}; "
             f"its pass-2 twin {two[worst]:.1f}: {where[(1, worst)]}"]
    report("\n".join(lines), device, args.section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
