"""Hunts a stall of the fused pipeline: many requests at once for a long time, stacks on the first stall.

Written for the pipeline's hang on the H200 (kimi_k25_vision_fused stopped answering at concurrency 16
with no error), since traced to nvJPEG's hardware decode and mended (docs/triton_runtime.md, "The
hang, found and mended"); it stays as the check for the next one. This serves the fused model
(pipeline on) and keeps `--concurrency` client threads sending the same request, each with its own
deadline, for `--seconds`. The first request past its deadline stops
the hunt and leaves, beside the server's log:
- every thread's Python stack of each fused stub (SIGUSR1; the adapter registers faulthandler on it),
  in the server's log;
- the native stacks of the server and all its stubs (backends/deploy/native_stacks.py: gdb, or the
  threads' states from /proc without it);
- after `--watchdog-wait` seconds, the pipeline's own watchdog report (GPU only, 30 s) in that log.
It then copies that log to `--out`. Exit status 0: no stall in the whole run; 1: a stall, reported.

    python -m tools.hang_hunt --device cpu --images 8x64 --seconds 600            # the demo model
    python -m tools.hang_hunt --checkpoint /tmp/kimi-random --images 8x448 --out $OUT/hunt   # the GPU
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time
from pathlib import Path

from backends.deploy import native_stacks
from backends.deploy.launcher import deployment_server
from backends.deploy.repository import Deployment
from bench.perf import request_images
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from contract import FUSED
from tools.lanes_probe import dump_fused_stacks


class Hunt:
    """The client threads' shared state: requests answered, and the first one that missed its deadline."""

    def __init__(self, deadline: float):
        self.stop = threading.Event()
        self.answered = 0
        self.first_failure: str | None = None
        self._lock = threading.Lock()
        self._end = deadline

    def run_client(self, url: str, ids, blobs, timeout_s: float) -> None:
        client = KimiVisionClient(url, model=FUSED)
        try:
            while not self.stop.is_set() and time.monotonic() < self._end:
                t0 = time.monotonic()
                try:
                    client.infer(ids, blobs, timeout_s=timeout_s)
                except Exception as exc:  # noqa: BLE001 - the hunt's finding: the first one stops it
                    self.fail(f"after {time.monotonic() - t0:.1f} s: {str(exc)[:300]}")
                    return
                with self._lock:
                    self.answered += 1
        finally:
            client.close()

    def fail(self, what: str) -> None:
        with self._lock:
            if self.first_failure is None:
                self.first_failure = what
        self.stop.set()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="", help="default: the embedded demo model")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    ap.add_argument("--lanes", type=int, default=2, help="encoder lanes (GPU)")
    ap.add_argument("--images", default="8x448", help="per request: N x SIDE JPEGs, e.g. 8x448, or SIDE (as bench.perf --images)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=300.0, help="how long to hunt without a stall")
    ap.add_argument("--timeout", type=float, default=20.0, help="each request's deadline, seconds")
    ap.add_argument("--watchdog-wait", type=float, default=35.0,
                    help="seconds to wait after a stall for the pipeline watchdog's report (30 s on the GPU)")
    ap.add_argument("--out", default="", help="folder for the server's log and the native stacks")
    args = ap.parse_args(argv)
    if args.concurrency < 1 or args.seconds <= 0 or args.timeout <= 0:
        raise SystemExit("--concurrency, --seconds and --timeout must be above 0")
    blobs = request_images(args.images)
    ids = chat_prompt_ids(len(blobs))
    out = Path(args.out) if args.out else None
    dep = Deployment(device=args.device, checkpoint=args.checkpoint, fused=True, fused_pipeline=True,
                     fused_lanes=args.lanes)
    with deployment_server(dep, "hang-hunt") as server:
        warm = KimiVisionClient(server.grpc_url, model=FUSED)
        try:  # the first answers build caches and CUDA graphs: not part of the hunt's deadlines
            for _ in range(3):
                warm.infer(ids, blobs, timeout_s=300)
        finally:
            warm.close()
        hunt = Hunt(time.monotonic() + args.seconds)
        t0 = time.monotonic()
        threads = [threading.Thread(target=hunt.run_client, args=(server.grpc_url, ids, blobs, args.timeout),
                                    daemon=True) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.monotonic() - t0
        print(f"{args.images} at concurrency {args.concurrency} ({args.device}): {hunt.answered} requests answered "
              f"in {took:.0f} s ({hunt.answered / took:.1f}/s)", flush=True)
        if hunt.first_failure is None:
            print("no stall", flush=True)
            return 0
        print(f"stall: the first request past its deadline failed {hunt.first_failure}", flush=True)
        print(f"Python stacks of {dump_fused_stacks(server.proc.pid)} fused stub(s) written to the server's log",
              flush=True)
        native_path = (out or server.log_path.parent) / "native_stacks.txt"
        native_path.parent.mkdir(parents=True, exist_ok=True)
        native_stacks.dump(native_stacks.server_and_stubs(server.proc.pid), native_path)
        print(f"native stacks of the server and its stubs written to {native_path}", flush=True)
        if args.device == "gpu":  # the pipeline's watchdog (GPU only) reports after its own 30 s
            time.sleep(args.watchdog_wait)
        if out is not None:
            shutil.copy(server.log_path, out / "server.log")
            print(f"server log copied to {out / 'server.log'}", flush=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
