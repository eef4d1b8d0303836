"""How long the cache key's hash takes for one large encoded image, SHA-256 against BLAKE2b, in one run
(backends/cache/keys.py says why it is SHA-256: it runs on every request's path, hits included).

    python -m lab.bench.key_hash [--mb 1.3] [--repeats 200] [--section key_hash]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import time

from lab.bench.results_page import report


def _median_ms(fn, data: bytes, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(data).digest()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=1.3, help="the image's size in MB (1.3: a 4032x3024 JPEG)")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--section", default="")
    args = ap.parse_args()
    data = os.urandom(int(args.mb * 1e6))  # a JPEG's entropy-coded bytes look random to a hash
    sha = _median_ms(hashlib.sha256, data, args.repeats)
    blake = _median_ms(hashlib.blake2b, data, args.repeats)
    cpu = platform.processor() or platform.machine()
    lines = [f"python -m lab.bench.key_hash --mb {args.mb} --repeats {args.repeats}  ({cpu}, {os.cpu_count()} cores)",
             "",
             f"{args.mb} MB, median of {args.repeats}: SHA-256 {sha:.2f} ms, BLAKE2b {blake:.2f} ms "
             f"(BLAKE2b / SHA-256 = {blake / sha:.2f})"]
    report("\n".join(lines), "cpu", args.section)


if __name__ == "__main__":
    main()
