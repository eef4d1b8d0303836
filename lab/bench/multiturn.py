"""Multi-turn chats against the embedding cache: each turn resends the earlier turns' images and adds one.

    python -m lab.bench.multiturn [--device gpu --checkpoint DIR] [--chats 16 --turns 6] [--section multiturn]

A chat client resends the whole conversation every turn, images included. The trace: `--chats` chats of
`--turns` turns; turn k of a chat sends its k earlier images and one new one (sizes cycling through
`--sizes`, 448^2 to 3000^2 by default; photo-like JPEGs, quality 90), in prompt order. It is replayed with
one chat at a time (concurrency 1) and with every chat at once (concurrency = `--chats`), each turn waiting
for the previous one as a chat does, on two servers of the same deployment: the embedding cache on (its
default budget, or `--cache-bytes`) and off. Then, on the cache-on server, `--pairs` fresh 1 x 1024^2
requests, each sent twice: the first a miss, the second a hit.

Prints, per (cache, concurrency): images/s over all images sent (repeats included), request p50/p99, and
on the cache-on server the hit rate and the bytes the cache held at the end (from the server's metrics);
then the 1024^2 miss and hit p50, and the time each spent in each composing model (the server's
statistics). On a GPU the embeddings go into one CUDA region registered once (what a
co-located LLM does, so that what is timed is the service, not the trip back: the issue on embeddings
out); on CPU through the gRPC response.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time

import tritonclient.grpc as grpcclient

from backends.deploy.launcher import deployment_server, resolve_device
from backends.deploy.repository import Deployment
from backends.deploy.supervisor import scrape
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like
from lab.bench.results_page import report
from lab.bench.server_stats import breakdown, model_ns


def trace(chats: int, turns: int, sizes: list[int], seed: int = 0) -> list[list[list[bytes]]]:
    """chats x turns requests: turn k sends the chat's first k + 1 images (all new to the server for a
    `seed` not used before)."""
    out = []
    for c in range(chats):
        images = [encode(photo_like(sizes[(c + k) % len(sizes)], sizes[(c + k) % len(sizes)],
                                    seed=seed + 1000 * c + k),
                         "JPEG", quality=90) for k in range(turns)]
        out.append([images[:k + 1] for k in range(turns)])
    return out


class Sender:
    """One client per thread; on a GPU the embeddings go into a CUDA region registered once per client."""

    def __init__(self, url: str, gpu: bool, capacity: int):
        self.client = KimiVisionClient(url)
        self.region = None
        if gpu:
            from clients.kimi_client import CudaOutputRegion

            self.region = CudaOutputRegion(self.client, capacity)

    def send(self, blobs: list[bytes]) -> float:
        ids = chat_prompt_ids(len(blobs))
        t0 = time.perf_counter()
        if self.region is not None:
            self.client.infer_into(self.region, ids, blobs)
        else:
            self.client.infer(ids, blobs)
        return (time.perf_counter() - t0) * 1000

    def close(self):
        if self.region is not None:
            self.region.close()
        self.client.close()


def replay(url: str, chats: list[list[list[bytes]]], concurrency: int, gpu: bool, capacity: int) -> dict:
    """Chats in `concurrency` threads, each chat's turns one after another: images/s and latencies."""
    latencies, lock, next_chat = [], threading.Lock(), [0]

    def worker():
        sender = Sender(url, gpu, capacity)
        try:
            while True:
                with lock:
                    c = next_chat[0]
                    next_chat[0] += 1
                if c >= len(chats):
                    return
                for blobs in chats[c]:
                    ms = sender.send(blobs)
                    with lock:
                        latencies.append((ms, len(blobs)))
        finally:
            sender.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ms = sorted(m for m, _ in latencies)
    return {"images_per_s": sum(n for _, n in latencies) / wall, "p50": statistics.median(ms),
            "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))], "requests": len(ms)}


def cache_counts(metrics_url: str) -> dict[str, float]:
    out = {"hits": 0.0, "misses": 0.0, "bytes": 0.0}
    for name, labels, value in scrape(metrics_url):
        for kind in out:
            if name == f"kimi_vision_cache_{kind}" + ("" if kind == "bytes" else "_total"):
                out[kind] += value
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    ap.add_argument("--checkpoint", default=os.environ.get("KIMI_VISION_CHECKPOINT", ""))
    ap.add_argument("--chats", type=int, default=16, help="0: only the 1024^2 miss and hit pairs")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--sizes", default="448,640,1024,1500,2048,3000", help="image sides, cycled")
    ap.add_argument("--pairs", type=int, default=10, help="1024^2 requests sent twice each (miss, then hit)")
    ap.add_argument("--cache-bytes", type=int, default=None, help="the cache-on server's budget (default: the device's)")
    ap.add_argument("--section", default="")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    gpu = device == "gpu"
    sizes = [int(s) for s in args.sizes.split(",")]
    # One trace per concurrency level, the same for both servers: each replay meets only new images first.
    levels = (1, args.chats) if args.chats else ()
    traces = {c: trace(args.chats, args.turns, sizes, seed=100_000 * n) for n, c in enumerate(levels)}
    pairs = [[encode(photo_like(1024, 1024, seed=5000 + i), "JPEG", quality=90)] for i in range(args.pairs)]
    # Room for the largest request's embeddings: every patch of a full request, 1/4 of them as rows.
    capacity = 64 << 20 if not gpu else 1 << 30
    rows, t_start = [], time.monotonic()
    for cache_bytes in (args.cache_bytes, 0) if args.chats else (args.cache_bytes,):
        dep = Deployment(device=device, checkpoint=args.checkpoint, cache_bytes=cache_bytes)
        label = "off" if dep.cache_bytes == 0 else f"on ({dep.cache_bytes / 2**30:.1f} GiB)"
        with deployment_server(dep, f"multiturn-{device}") as server:
            warm = Sender(server.grpc_url, gpu, capacity)
            for side in sorted(set(sizes)):  # kernels and graphs for each size before the clock runs
                warm.send([encode(photo_like(side, side, seed=99), "JPEG", quality=90)])
            warm.close()
            for concurrency in levels:
                before = cache_counts(server.metrics_url)
                result = replay(server.grpc_url, traces[concurrency], concurrency, gpu, capacity)
                time.sleep(0.5)  # the stubs send their counts every 0.2 s
                after = cache_counts(server.metrics_url)
                looked = (after["hits"] - before["hits"]) + (after["misses"] - before["misses"])
                result.update(cache=label, concurrency=concurrency,
                              hit_rate=(after["hits"] - before["hits"]) / looked if looked else None,
                              held=after["bytes"])
                rows.append(result)
            if dep.cache_bytes:
                sender = Sender(server.grpc_url, gpu, capacity)
                stats = grpcclient.InferenceServerClient(server.grpc_url)
                reading = [model_ns(stats.get_inference_statistics(as_json=True))]
                miss = [sender.send(p) for p in pairs]  # first sight: decoded and encoded
                reading.append(model_ns(stats.get_inference_statistics(as_json=True)))
                hit = [sender.send(p) for p in pairs]  # again: from the cache
                reading.append(model_ns(stats.get_inference_statistics(as_json=True)))
                stats.close()
                sender.close()
    lines = [f"$ python -m lab.bench.multiturn {' '.join(sys.argv[1:] if argv is None else argv)}",
             f"{platform.node()}, device={device}, checkpoint={args.checkpoint or 'embedded demo'}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}, wall {time.monotonic() - t_start:.0f} s; {args.chats} chats x "
             f"{args.turns} turns, sides {args.sizes}; embeddings {'into a registered CUDA region' if gpu else 'in the gRPC response'}",
             "", "| cache | concurrency | images/s | p50 ms | p99 ms | hit rate | cache bytes held |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        rate = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
        lines.append(f"| {r['cache']} | {r['concurrency']} | {r['images_per_s']:.1f} | {r['p50']:.1f} | {r['p99']:.1f} | "
                     f"{rate} | {r['held'] / 2**20:.0f} MiB |")
    for c in levels:
        on, off = (next(r for r in rows if r["concurrency"] == c and (r["cache"] != "off") == want) for want in (True, False))
        lines.append(f"\nconcurrency {c}: images/s with the cache {on['images_per_s'] / off['images_per_s']:.2f}x without")
    lines.append(f"1 x 1024^2, {args.pairs} fresh images each sent twice: miss p50 {statistics.median(miss):.1f} ms, "
                 f"hit p50 {statistics.median(hit):.1f} ms = {statistics.median(hit) / statistics.median(miss):.3f}x")
    lines.append(f"where their time went, mean ms by model (queue + compute; the rest is hand-offs and the client): "
                 f"miss {statistics.mean(miss):.1f}: {breakdown(reading[0], reading[1], len(pairs))}; "
                 f"hit {statistics.mean(hit):.1f}: {breakdown(reading[1], reading[2], len(pairs))}")
    report("\n".join(lines), device, args.section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
