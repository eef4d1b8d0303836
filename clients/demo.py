"""`make run`: start tritonserver on the embedded default, send one sample request through the
ensemble, print the answer, stop the server. `--url HOST:PORT` sends the same request to a server that
is already running (gRPC), e.g. the container `make image-test` starts, and prints the same answer.

The one client module that starts a server (through the launcher); the client library itself
(kimi_client.py) never imports the server's packages."""

from __future__ import annotations

import argparse
import os
import sys
import time

from backends.deploy.launcher import deployment_server, resolve_device
from backends.deploy.repository import Deployment
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import sample_images


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    ap.add_argument("--checkpoint", default=os.environ.get("KIMI_VISION_CHECKPOINT", ""))
    ap.add_argument("--url", help="a running server's gRPC address (host:port): send the request there, start none")
    args = ap.parse_args(argv)
    if args.url:
        print(f"server: {args.url}")
        send_sample(args.url)
        return 0
    device = resolve_device(args.device)
    dep = Deployment(device=device, checkpoint=args.checkpoint)
    try:
        dep.vision  # the checkpoint's config, read now: a wrong path is one line, not a traceback
    except (OSError, ValueError) as exc:
        print(f"error: CHECKPOINT={args.checkpoint}: {exc}", file=sys.stderr)
        return 2
    what = f"checkpoint {args.checkpoint}" if args.checkpoint else "the embedded demo model (seeded random weights, untrained)"
    print(f"starting tritonserver ({device}) with {what} ...", flush=True)
    t0 = time.monotonic()
    server = deployment_server(dep, f"run-{device}")
    with server:
        print(f"ready in {time.monotonic() - t0:.1f}s (log: {os.path.relpath(server.log_path)})")
        send_sample(server.grpc_url)
    return 0


def send_sample(grpc_url: str) -> None:
    """The sample request (two images) over gRPC; prints the answer's summary, its checksum last."""
    images = sample_images()
    ids = chat_prompt_ids(len(images))
    client = KimiVisionClient(grpc_url, protocol="grpc")
    try:
        t1 = time.monotonic()
        result = client.infer(ids, images)
        elapsed = time.monotonic() - t1
    finally:
        client.close()
    print(f"request: {len(ids)} prompt ids, {len(images)} images (640x480 JPEG, 300x200 PNG) over gRPC, "
          f"answered in {elapsed * 1000:.0f} ms")
    print(result.summary())


if __name__ == "__main__":
    raise SystemExit(main())
