"""Soak: many mixed requests at a fixed concurrency; memory sampled as it goes; good requests never fail.

    python -m lab.bench.soak                       # CPU: 2000 requests, concurrency 8 (`make soak`)
    python -m lab.bench.soak --device gpu --requests 10000 --concurrency 16 --checkpoint DIR

A mix of good requests (several sizes, one or two images, both ensembles, and a JPEG whose damaged
scan Pillow still decodes, which the GPU route's scan check sends back to Pillow) and the bad ones of
our bad-input tests (placeholder/image mismatch, garbage bytes, a truncated JPEG, a header over the
pixel limit, too many images, bad MEDIA_FRAMES, negative ids), sent by `--concurrency` threads. Every `--sample-every`
requests: the server's process tree memory (RSS and PSS, from /proc; PSS counts shared pages once),
the server's Python-backend regions in /dev/shm, and on a GPU the device memory in use and, summed
over the GPU stubs, what torch's caching allocator holds for live tensors (`alloc`, of which our
bounded caches keep `cached` and the rest is `uncached`) and from the driver (`reserved`). Verdict:
good requests that failed (must be 0), bad requests that did not fail with INVALID_ARG (must be 0),
each host series and `gpu` flat within --tolerance after the first sample past warm-up, and
`uncached` not grown, idle before the run against idle after it. Also prints the effect of one request
at the limits (8 x 1792^2) on memory, right after it and after 200 small ones.
Recorded, never asserted in tests.
"""

from __future__ import annotations

import argparse
import http.client
import io
import os
import platform
import random
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

from backends.deploy.launcher import BUILD, deployment_server, resolve_device
from backends.deploy.repository import Deployment
from backends.deploy.supervisor import process_tree, scrape
from backends.serving.metrics import ModelMetrics
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like, text_card
from lab.bench.results_page import write_section
from oracles.jpeg_corpus import damaged


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (no pixel data): refused from its header."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


def broken_but_decodable(jpeg: bytes) -> bytes:
    """A copy of `jpeg` with a damaged scan that Pillow still decodes and, where the C scan check can be
    built, that the check refuses (so that on a GPU it exercises the second preprocessing pass)."""
    try:
        from backends.preprocess import scan_check
        scan_check.library()
    except Exception:  # noqa: BLE001 - no compiler: any damage Pillow decodes will do
        scan_check = None
    for _, blob in damaged(jpeg, 5, 60):
        try:
            Image.open(io.BytesIO(blob)).convert("RGB")
        except OSError:
            continue
        if scan_check is None or scan_check.check(blob) is not None:
            return blob
    raise RuntimeError("no damaged copy that Pillow decodes and the scan check refuses")


def request_mix(seed: int = 0):
    """(label, good?, ids, images, media_frames) templates, drawn with weights."""
    rng = np.random.default_rng(seed)
    small = encode(photo_like(64, 48, seed=1), "PNG")
    photo = encode(photo_like(640, 480, seed=2), "JPEG", quality=90)
    card = encode(text_card(300, 200), "PNG")
    big = encode(photo_like(1024, 1024, seed=3), "JPEG", quality=90)
    frames = [encode(photo_like(320, 240, seed=10 + i), "JPEG", quality=85) for i in range(3)]
    broken = broken_but_decodable(photo)
    good = [
        ("small", chat_prompt_ids(1), [small], None, 30),
        ("photo", chat_prompt_ids(1), [photo], None, 25),
        ("two images", chat_prompt_ids(2), [photo, card], None, 15),
        ("1024^2", chat_prompt_ids(1), [big], None, 8),
        ("chunk + image", chat_prompt_ids(2), frames + [card], [3, 0], 7),
        ("text only", chat_prompt_ids(0), [], None, 5),
        # Pillow decodes it, the GPU route's scan check refuses it: that request is preprocessed again
        ("damaged scan", chat_prompt_ids(2), [broken, photo], None, 3),
    ]
    bad = [
        ("1:1 mismatch", chat_prompt_ids(2), [small], None, 3),
        ("garbage bytes", chat_prompt_ids(1), [rng.bytes(300)], None, 3),
        ("truncated JPEG", chat_prompt_ids(1), [photo[:len(photo) // 2]], None, 2),
        ("pixel limit", chat_prompt_ids(1), [png_header_only(20000, 20000)], None, 1),
        ("65 images", chat_prompt_ids(65), [small] * 65, None, 1),
        ("bad MEDIA_FRAMES", chat_prompt_ids(1), [small], [5], 1),
        ("negative id", np.array([-1, 163605], np.int64), [small], None, 1),
    ]
    return [(label, True, *rest) for label, *rest in good] + [(label, False, *rest) for label, *rest in bad]


def memory(server, instances: dict | None = None) -> dict[str, float]:
    """MiB: RSS and PSS of the server's process tree, its /dev/shm regions, GPU memory in use, and the
    CUDA allocator's gauges summed over the instances (`instances`: a scrape already made)."""
    rss = pss = 0
    for p in process_tree(server.proc.pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            pass
    shm = sum(f.stat().st_size for f in Path("/dev/shm").glob(f"{server.server.shm_prefix}*"))
    out = {"rss": rss / 1024, "pss": pss / 1024, "shm": shm / 2**20}
    try:
        used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.split()
        if used:
            out["gpu"] = float(sum(int(u) for u in used))
    except (OSError, subprocess.TimeoutExpired):
        pass
    out.update(cuda_allocator(allocator_by_instance(server) if instances is None else instances))
    return out


# Device series without a verdict per sample: `reserved` (the allocator's cache) and `cached` (our
# bounded caches) may grow by design, so `alloc` may too; `uncached` taken under load includes the
# tensors of whatever requests are in flight. `uncached` is judged idle against idle instead.
NO_SAMPLE_VERDICT = ("reserved", "cached", "alloc", "uncached")
# Idle `uncached` may differ by a few small device buffers (bicubic tap tables in kimi_preprocess,
# rounded by the allocator): growth below this is not read as a leak. Half of one cuBLAS workspace
# (32 MiB on an H200), the leak this verdict was made for (bench/results/h200-2026-12-01-fifth.md at 21ee467).
IDLE_SLACK_MIB = 16


def idle_verdict(before: dict, after: dict, tolerance: float, gpu: bool) -> tuple[str, bool]:
    """(line, ok) for `uncached` idle before the run against idle after it: ok unless it grew by more
    than IDLE_SLACK_MIB or `tolerance` of its start (shrinking is fine); on a GPU run, missing gauges
    fail (a soak that cannot see device memory must not pass as flat). Without a GPU: no line."""
    if "uncached" not in before or "uncached" not in after:
        return ("uncached at idle: no CUDA allocator gauges (NOT judged, a failure on a GPU run)", False) if gpu else ("", True)
    a, b = before["uncached"], after["uncached"]
    ok = b - a <= max(tolerance * a, IDLE_SLACK_MIB)
    return (f"uncached at idle: {a:.0f} MiB after warm-up, {b:.0f} MiB after the run "
            f"({'flat' if ok else 'NOT flat'}; growth allowed {IDLE_SLACK_MIB} MiB or {tolerance:.0%})"), ok


def cuda_allocator(instances: dict[tuple[str, str], float]) -> dict[str, float]:
    """MiB, summed over the GPU model instances, from the stubs' kimi_vision_cuda_memory_bytes gauges:
    torch's caching allocator, `alloc` (tensors alive) and `reserved` (held from the driver); `cached`,
    the part of `alloc` the encoder's bounded caches keep (CUDA graphs' buffers, per-grid tables); and
    `uncached` = alloc - cached. Growing `gpu` with flat `alloc` is the allocator's cache filling;
    growing `alloc` with flat `uncached` is our caches filling towards their bounds; only `uncached`
    growing is a leak. Empty on CPU."""
    out: dict[str, float] = {}
    for (_, key), mib in instances.items():
        out[key] = out.get(key, 0.0) + mib
    if "alloc" in out and "cached" in out:
        out["uncached"] = out["alloc"] - out["cached"]
    return out


def allocator_by_instance(server) -> dict[tuple[str, str], float]:
    """(model instance, alloc | reserved | cached) -> MiB, from the kimi_vision_cuda_memory_bytes gauges."""
    try:
        samples = scrape(server.metrics_url)
    except (OSError, http.client.HTTPException, UnicodeDecodeError):  # down, cut short, or not text: none
        return {}
    out = {}
    for name, labels, value in samples:
        if name == "kimi_vision_cuda_memory_bytes":
            key = {"allocated": "alloc", "reserved": "reserved", "cached": "cached"}.get(labels.get("kind", ""))
            if key:
                out[(labels.get("instance") or labels.get("model", "?"), key)] = value / 2**20
    return out


def idle_memory(server) -> dict[str, float]:
    """memory() once the stubs' gauges have caught up with an idle server (they are set about once a
    second, ModelMetrics.MEMORY_EVERY_S): no request's tensors are in flight, so `uncached` compares
    across idle moments without the noise of the samples taken under load. Also keeps the gauges per
    model instance, under "instances", to tell which stub holds what."""
    time.sleep(2.5 * ModelMetrics.MEMORY_EVERY_S)  # two sends at least, and a scrape's worth
    instances = allocator_by_instance(server)
    out = memory(server, instances)
    out["instances"] = instances
    return out


def _mib(sample: dict, key: str) -> str:
    return f"{sample[key]:.0f}" if key in sample else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    ap.add_argument("--checkpoint", default=os.environ.get("KIMI_VISION_CHECKPOINT", ""))
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-every", type=int, default=250)
    ap.add_argument("--warmup-samples", type=int, default=2, help="samples before the flatness baseline")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=BUILD / "soak")
    ap.add_argument("--section", default="", help="also write the report into this section of lab/results/<machine>.md")
    ap.add_argument("--distinct", action="store_true",
                    help="every good one-image request brings an image never sent before (the embedding cache "
                         "fills to its budget and must then stay there)")
    ap.add_argument("--cache-bytes", type=int, default=None, help="the embedding cache's budget (default: the device's)")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    mix = request_mix()
    weights = [m[-1] for m in mix]
    rng = random.Random(0)
    plan = rng.choices(range(len(mix)), weights=weights, k=args.requests)
    peak_blobs = [encode(photo_like(1792, 1792, seed=i), "JPEG", quality=90) for i in range(8)]
    lock, counts, problems, samples = threading.Lock(), Counter(), [], []
    next_index = [0]
    t0 = time.monotonic()
    dep = Deployment(device=device, checkpoint=args.checkpoint, cache_bytes=args.cache_bytes)
    with deployment_server(dep, f"soak-{device}") as server:
        client = KimiVisionClient(server.grpc_url)
        before = memory(server)
        client.infer(chat_prompt_ids(8), peak_blobs)
        after_peak = memory(server)
        for _ in range(200):
            client.infer(chat_prompt_ids(1), [mix[0][3][0]])
        after_small = idle_memory(server)
        client.close()

        def worker():
            c = KimiVisionClient(server.grpc_url)
            c_batched = KimiVisionClient(server.grpc_url, batched=True)
            while True:
                with lock:
                    i = next_index[0]
                    next_index[0] += 1
                if i >= len(plan):
                    break
                label, good, ids, blobs, frames, _ = mix[plan[i]]
                if args.distinct and good and len(blobs) == 1:  # new to the server: a miss, then held
                    side = 96 + (i % 8) * 8
                    blobs = [encode(photo_like(side, side, seed=1_000_000 + i), "PNG")]
                target = c_batched if i % 2 == 0 else c
                try:
                    target.infer(ids, blobs, media_frames=frames, timeout_s=600)
                    outcome = "ok" if good else "bad request accepted"
                except Exception as exc:  # noqa: BLE001
                    msg = str(exc)
                    outcome = "failed" if good else ("refused" if "INVALID" in msg or "400" in msg else "bad: " + msg[:80])
                with lock:
                    counts[(label, outcome)] += 1
                    if (good and outcome != "ok") or (not good and outcome != "refused"):
                        problems.append(f"request {i} ({label}): {outcome}")
                    done = sum(counts.values())
                    if done % args.sample_every == 0:
                        samples.append((done, memory(server)))
            c.close()
            c_batched.close()

        threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after_run = idle_memory(server)
        restarts = server.relay.restarts.copy()
    wall = time.monotonic() - t0

    # The allocator gauges appear once the stubs' metric senders have run: take the keys from the last sample.
    last = samples[-1][1] if samples else after_small
    keys = [k for k in ("rss", "pss", "shm", "gpu", "alloc", "cached", "uncached", "reserved") if k in before or k in last]
    lines = [f"$ python -m lab.bench.soak {' '.join(sys.argv[1:] if argv is None else argv)}",
             f"{platform.node()} {os.cpu_count()} CPUs, device={device}, checkpoint={args.checkpoint or 'embedded demo'}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}, {args.requests} requests at concurrency {args.concurrency}"
             f"{', every good one-image request a new image' if args.distinct else ''}, embedding cache "
             f"{dep.cache_bytes / 2**20:.0f} MiB, "
             f"wall {wall:.0f} s", "",
             "## One request at the limits (8 x 1792^2), memory in MiB", "",
             "| when | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for when, m in (("before", before), ("right after", after_peak), ("after 200 small requests (idle)", after_small),
                    ("after the whole run (idle)", after_run)):
        lines.append(f"| {when} | " + " | ".join(_mib(m, k) for k in keys) + " |")
    lines += ["", "## Memory every %d requests (MiB)" % args.sample_every, "",
              "| requests | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    lines += [f"| {n} | " + " | ".join(_mib(m, k) for k in keys) + " |" for n, m in samples]
    verdict = []
    if len(samples) > args.warmup_samples:
        base = samples[args.warmup_samples][1]
        for k in keys:
            if k in NO_SAMPLE_VERDICT or any(k not in m for _, m in samples[args.warmup_samples:]):
                continue  # judged otherwise (above); a series with gaps has no verdict
            drift = max(abs(m[k] - base[k]) / max(base[k], 1.0) for _, m in samples[args.warmup_samples:])
            verdict.append(f"{k}: max drift {drift:.1%} after warm-up ({'flat' if drift <= args.tolerance else 'NOT flat'})")
    # Idle against idle: the one comparison of device memory that in-flight requests cannot blur.
    idle_line, idle_ok = idle_verdict(after_small, after_run, args.tolerance, device == "gpu")
    if idle_line:
        verdict.append(idle_line)
    instances = sorted({i for i, _ in after_small.get("instances", {})} | {i for i, _ in after_run.get("instances", {})})
    if instances:
        lines += ["", "## CUDA allocator per model instance at idle (MiB): after 200 small requests -> after the run", "",
                  "| instance | alloc | cached | reserved |", "|---|---|---|---|"]
        for inst in instances:
            cells = []
            for key in ("alloc", "cached", "reserved"):
                a, b = after_small.get("instances", {}).get((inst, key)), after_run.get("instances", {}).get((inst, key))
                cells.append("-" if a is None and b is None else
                             f"{'-' if a is None else f'{a:.0f}'} -> {'-' if b is None else f'{b:.0f}'}")
            lines.append(f"| {inst} | " + " | ".join(cells) + " |")
    lines += ["", "## Outcomes", "", "| request | outcome | count |", "|---|---|---|"]
    lines += [f"| {label} | {outcome} | {n} |" for (label, outcome), n in sorted(counts.items())]
    good_failed = sum(n for (label, outcome), n in counts.items() if outcome == "failed")
    lines += ["", f"good requests failed: {good_failed}; problems: {len(problems)}; server restarts: {dict(restarts)}"]
    lines += verdict + problems[:20]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"soak_{device}.md").write_text(text + "\n")
    if args.section:
        print(f"written to {write_section(device, args.section, text)}")
    flat = idle_ok and all("NOT flat" not in v for v in verdict)
    return 0 if not problems and flat else 1


if __name__ == "__main__":
    raise SystemExit(main())
