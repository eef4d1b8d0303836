"""How long the JPEG scan check takes, per thread count, on the stage table's JPEGs (CPU only).

    python -m tools.scan_check_probe [--phases]
    python -m tools.scan_check_probe --agreement 12
    python -m tools.scan_check_probe --overlap

Prints, per case and per thread count, the best of 5 checks (ms), and Pillow's decode of the same
files on one core for scale. --phases builds a copy of scan_check.c that also prints, per several-thread
check, the time of its two decoding phases together and of the walk (stderr). --agreement N checks N
large photos (1-2.8 MP, four qualities, three samplings, some gray) and 60 damaged copies of each on
1 and on 2, 3, 5, 8 and 16 threads, and counts verdicts that differ (there must be none). --overlap
starts a request's checks, keeps this thread busy in Python for a while (as the request's thread is,
reading headers and launching the GPU decode), then waits for the verdicts: with the checks queued
on the C library's threads (scan_check.Checks, served) and, for comparison, submitted one by one to
Python threads (host_threads.pool(), as served until the batches came), whose workers need the GIL
to start and to end a check. Prints the median wait after the busy time and the median time from
the start to the last verdict. The busy loop never lets go of the GIL, so below Python's switch
interval (5 ms) a Python thread cannot even start its check: the worst case for that way, which a
request's thread (whose torch and ctypes calls let go of the GIL now and then) is not always in;
8 ms shows one switch."""

from __future__ import annotations

import argparse
import ctypes
import io
import statistics
import tempfile
import time
from pathlib import Path

from PIL import Image

from backends.preprocess import host_threads, scan_check
from bench.cases import case_jpegs
from bench.gpu_timing import spin
from clients.samples import encode, photo_like
from oracles.jpeg_corpus import damaged

_TIMED = [  # (anchor in scan_check.c, text put after it)
    ("#include <math.h>\n", "#include <stdio.h>\n#include <time.h>\nstatic double now_ms(void) { struct timespec ts; "
                             "clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6; }\n"),
    ("  int verdict = -1;\n", "  double t0 = now_ms(), t2 = 0;\n"),
    ("  run_phase(tr, 1, threads - 1, 2, jobs, &tr[0]);\n", "  t2 = now_ms();\n"),
    ("done:\n", "  if (t2 > 0) fprintf(stderr, \"threads %d: phases %.2f ms, walk %.2f ms\\n\", threads, t2 - t0, now_ms() - t2);\n"),
]


def timed_library(folder: Path) -> ctypes.CDLL:
    source = scan_check.SOURCE.read_text()
    for anchor, text in _TIMED:
        if anchor not in source:
            raise SystemExit(f"scan_check.c changed: {anchor.strip()!r} not found; update _TIMED")
        source = source.replace(anchor, anchor + text, 1)
    (folder / "timed.c").write_text(source)
    scan_check.compile_library(folder / "timed.c", folder / "timed.so")  # as the served library is built
    return scan_check.load(folder / "timed.so")


def agreement(seeds: int) -> int:
    """Files whose verdict on several threads differs from the one-thread verdict."""
    files = refused = differ = 0
    walks, fallbacks = scan_check.parallel_counts()
    for seed in range(seeds):
        w, h = [(1600, 1200), (2000, 900), (1024, 1024), (1400, 1400)][seed % 4]
        img = Image.fromarray(photo_like(w, h, seed=seed))
        if seed % 5 == 4:
            img = img.convert("L")
        photo = encode(img, "JPEG", quality=[60, 80, 90, 97][seed % 4], subsampling=seed % 3)
        for label, blob in [("as written", photo)] + damaged(photo, 100 + seed, 60):
            one = scan_check.check(blob, threads=1)
            for threads in (2, 3, 5, 8, 16):
                if scan_check.check(blob, threads=threads) != one:
                    differ += 1
                    print(f"differs: photo {seed}, {label}, {threads} threads")
            files += 1
            refused += one is not None
    now_walks, now_fallbacks = scan_check.parallel_counts()
    print(f"{files} files ({refused} refused), each on 1 and on 2, 3, 5, 8, 16 threads: {differ} verdicts differ; "
          f"{now_walks - walks} checks answered by the threads, {now_fallbacks - fallbacks} fell back to one")
    return differ


def overlap(busy_ms=(0.0, 1.0, 2.0, 4.0, 8.0), rounds: int = 30) -> None:
    pool = host_threads.pool()

    def batch(blobs):
        checks = scan_check.Checks(blobs)
        return [checks.pending(k) for k in range(len(blobs))]

    def python_threads(blobs):
        return [pool.submit(scan_check.check, b) for b in blobs]

    print(f"host threads {scan_check.THREADS}; medians of {rounds}")
    print("| case | busy ms | started by | wait after busy ms | start to last verdict ms |")
    print("|---|---|---|---|---|")
    for case in ("1x3000^2", "1x1024^2", "8x448^2"):
        blobs = case_jpegs(case)
        for busy in busy_ms:
            for label, start in (("scan_check.Checks", batch), ("Python threads", python_threads)):
                waits, totals = [], []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    pending = start(blobs)
                    spin(busy / 1e3)
                    t1 = time.perf_counter()
                    verdicts = [v.result() for v in pending]
                    t2 = time.perf_counter()
                    assert not any(verdicts), verdicts
                    waits.append((t2 - t1) * 1e3)
                    totals.append((t2 - t0) * 1e3)
                print(f"| {case} | {busy:g} | {label} | {statistics.median(waits):.2f} | "
                      f"{statistics.median(totals):.2f} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", action="store_true")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--agreement", type=int, default=0, metavar="N")
    ap.add_argument("--overlap", action="store_true")
    args = ap.parse_args(argv)
    if args.overlap:
        overlap()
        return 0
    if args.agreement:
        return 1 if agreement(args.agreement) else 0
    with tempfile.TemporaryDirectory() as tmp:
        check = scan_check.library().kimi_scan_check
        if args.phases:
            check = timed_library(Path(tmp)).kimi_scan_check
        print("| case | file bytes | threads | check ms (best of 5) | Pillow decode ms (1 core) |")
        print("|---|---|---|---|---|")
        for case in ("1x3000^2", "1x1024^2", "8x448^2"):
            blobs = case_jpegs(case)
            t = time.perf_counter()
            for b in blobs:
                Image.open(io.BytesIO(b)).convert("RGB")
            pillow = (time.perf_counter() - t) * 1e3
            for threads in map(int, args.threads.split(",")):
                best = float("inf")
                for _ in range(5):
                    t = time.perf_counter()
                    codes = [check(b, len(b), threads, 0) for b in blobs]
                    best = min(best, (time.perf_counter() - t) * 1e3)
                assert not any(codes), codes
                print(f"| {case} | {sum(map(len, blobs))} | {threads} | {best:.2f} | {pillow:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
