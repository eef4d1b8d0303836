"""Damaged and hostile JPEGs against the scan check built with AddressSanitizer and UBSan, or with
ThreadSanitizer (CPU only).

    python -m lab.tools.scan_check_fuzz --seconds 120 [--sanitizer thread]

Builds backends/preprocess/scan_check.c with -fsanitize=address,undefined (or thread) into a temporary folder, then
runs itself again with the sanitizer runtimes preloaded (a Python process must load them first) and
feeds the check, on 1, 4, 8 and 16 threads and in batches (scan_check.Checks, two at a time from two threads, some
checks dropped): bytes changed anywhere (headers included), truncations,
insertions, header bytes only, and random bytes after a start marker, built from small and large
photos (4:4:4, 4:2:2, 4:2:0, gray, restart markers). A memory error or undefined behaviour stops the
run with the sanitizer's report; otherwise it prints how many inputs got which answer."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from backends.preprocess import scan_check
from clients.samples import encode, photo_like

ROOT = Path(__file__).resolve().parents[1]

PHOTOS = [(64, 48, 0, 90, 0), (300, 200, 2, 75, 0), (33, 17, 1, 50, 3), (700, 500, 2, 95, 0), (1600, 1200, 2, 90, 0),
          (1200, 1200, 0, 95, 0)]  # width, height, subsampling, quality, restart every n blocks


def bases() -> list[bytes]:
    out = []
    for k, (w, h, sub, q, restart) in enumerate(PHOTOS):
        extra = {"restart_marker_blocks": restart} if restart else {}
        out.append(encode(photo_like(w, h, seed=k), "JPEG", quality=q, subsampling=sub, **extra))
    return out + [encode(Image.fromarray(photo_like(200, 100, seed=9)).convert("L"), "JPEG", quality=80)]


def mutate(blob: bytes, kind: int, rng) -> bytes:
    b = bytearray(blob)
    if kind == 0:  # a few bytes anywhere
        for _ in range(rng.integers(1, 6)):
            b[rng.integers(0, len(b))] = rng.integers(0, 256)
    elif kind == 1:  # cut anywhere
        b = b[:rng.integers(0, len(b))]
    elif kind == 2:  # header bytes only
        sos = b.index(b"\xff\xda")
        for _ in range(rng.integers(1, 4)):
            b[rng.integers(2, sos + 10)] = rng.integers(0, 256)
    elif kind == 3:  # random bytes inserted
        k = rng.integers(0, len(b))
        b = b[:k] + bytes(rng.integers(0, 256, rng.integers(1, 40)).tolist()) + b[k:]
    else:  # garbage after a start marker
        b = bytearray(b"\xff\xd8" + bytes(rng.integers(0, 256, rng.integers(0, 3000)).tolist()))
    return bytes(b)


def batch_differs(lib, blobs: list[bytes], answers: list[str | None], seed: int) -> tuple[int, int, int]:
    """The same inputs as one batch (scan_check.Checks on this library), drops asked for a quarter of
    them at once and the rest asked for in a shuffled order: (verdicts that differ from the one-by-one
    answers, drops that took effect, 1 if the batch was collected while a check still ran and kept
    aside). A drop that took effect must raise; one too late must answer. Half the batches are closed,
    half collected, some of those right after their drops, while checks may still run."""
    rng = np.random.default_rng(seed)
    checks = scan_check.Checks(blobs, 4, 0, lib=lib)
    dropped = {k for k in rng.choice(len(blobs), size=len(blobs) // 4, replace=False).tolist() if checks.drop(k)}
    if rng.random() < 0.25:  # collected at once: what still runs keeps the batch aside
        before = scan_check.sweep_retired()
        del checks
        return 0, len(dropped), int(scan_check.sweep_retired() > before)
    differ = 0
    for k in rng.permutation(len(blobs)).tolist():
        try:
            got = checks.verdict(k)
        except scan_check.CheckDropped:
            differ += k not in dropped
            continue
        differ += got != answers[k] or k in dropped
    if rng.random() < 0.5:
        checks.close()  # else freed when collected
    return differ, len(dropped), 0


def fuzz(library: str, seconds: float) -> int:
    lib = scan_check.load(Path(library))
    rng = np.random.default_rng(1)
    photos, answers, n, batches, differ, drops, kept = bases(), {}, 0, 0, 0, 0, 0
    recent: list[tuple[bytes, str | None]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        blob = mutate(photos[n % len(photos)], n % 5, rng)
        for threads in (1, 4, 8, 16):
            why = scan_check.reason_for(lib.kimi_scan_check(blob, len(blob), threads, 0))
            answers[why or "passed"] = answers.get(why or "passed", 0) + 1
        recent.append((blob, why))
        n += 1
        if len(recent) == 16:  # two batches of 8 at once, from two threads (they share the pool)
            halves = [recent[:8], recent[8:]]
            with ThreadPoolExecutor(2) as pool:
                results = list(pool.map(lambda h: batch_differs(lib, [b for b, _ in h[1]], [a for _, a in h[1]], h[0]),
                                        [(n * 2 + k, half) for k, half in enumerate(halves)]))
            differ += sum(r[0] for r in results)
            drops += sum(r[1] for r in results)
            kept += sum(r[2] for r in results)
            batches, recent = batches + 2, []
    while scan_check.sweep_retired():  # every batch kept aside is freed once its checks end
        time.sleep(0.01)
    print(f"{n} inputs, each on 1, 4, 8 and 16 threads, and {batches} batches of 8, two at a time from two threads "
          f"({drops} checks dropped before they ran, {kept} batches collected while a check ran): "
          f"no sanitizer report, {differ} batch verdicts differ; answers: "
          + ", ".join(f"{k} {v}" for k, v in sorted(answers.items())))
    return 1 if differ else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--sanitizer", choices=("address", "thread"), default="address",
                    help="address: AddressSanitizer and UBSan (memory errors); thread: ThreadSanitizer (data "
                         "races in the pool and the batches)")
    ap.add_argument("--library", help=argparse.SUPPRESS)  # the sanitized build, in the second process
    args = ap.parse_args(argv)
    if args.library:
        return fuzz(args.library, args.seconds)
    with tempfile.TemporaryDirectory() as tmp:
        library = Path(tmp) / f"scan_check_{args.sanitizer}.so"
        flags, names = {"address": ("address,undefined", ("libasan.so", "libubsan.so")),
                        "thread": ("thread", ("libtsan.so",))}[args.sanitizer]
        scan_check.compile_library(scan_check.SOURCE, library,
                                   ("-O1", "-g", f"-fsanitize={flags}", "-fno-omit-frame-pointer"))
        cc = scan_check._compiler()
        runtimes = [subprocess.run([*cc, f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()
                    for name in names]
        env = dict(os.environ, LD_PRELOAD=":".join(runtimes), ASAN_OPTIONS="detect_leaks=0",
                   UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1", TSAN_OPTIONS="halt_on_error=1")
        return subprocess.run([sys.executable, "-m", "lab.tools.scan_check_fuzz", "--seconds", str(args.seconds),
                               "--library", str(library)], env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    raise SystemExit(main())
