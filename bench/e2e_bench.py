"""End-to-end latency through tritonserver (GPU deployment, a random real-size checkpoint): one request
per case, client-measured over gRPC, median of N, for 1x1024^2, 1x3000^2 and 8x448^2 JPEGs.

    python -m bench.e2e_bench --checkpoint /tmp/kimi-random --out bench/out
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from backends.deploy.repository import Deployment
from backends.deploy.server import deployment_server
from bench.gpu_timing import machine_line, write_report
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like

CASES = {"1x1024^2": [(1024, 1024)], "1x3000^2": [(3000, 3000)], "8x448^2": [(448, 448)] * 8}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    server = deployment_server(Deployment(device="gpu", checkpoint=args.checkpoint), "e2e")
    lines = [f"# Ensemble end to end (tritonserver, GPU deployment, random real-size weights)\n\n{machine_line()}\n",
             "| case | median ms | min ms | embeds |", "|---|---|---|---|"]
    results = {}
    with server:
        client = KimiVisionClient(server.grpc_url)
        for case, sizes in CASES.items():
            blobs = [encode(photo_like(w, h, seed=i), "JPEG", quality=90) for i, (w, h) in enumerate(sizes)]
            ids = chat_prompt_ids(len(blobs))
            r = client.infer(ids, blobs)  # warm-up (kernel compilation, caches)
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                client.infer(ids, blobs)
                times.append((time.perf_counter() - t0) * 1e3)
            results[case] = {"median_ms": statistics.median(times), "min_ms": min(times)}
            lines.append(f"| {case} | {statistics.median(times):.1f} | {min(times):.1f} | {tuple(r.image_embeds.shape)} |")
        client.close()
    write_report(args.out, "e2e_bench", lines, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
