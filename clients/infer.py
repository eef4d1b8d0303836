"""Send a prompt and images through the kimi_k25_vision ensemble (or the model --model names) and print
what came back.

    python -m clients.infer --image a.jpg --image b.png                     # prompt built for you
    python -m clients.infer --ids 163602,163603,163605,163604,1,2 --image a.jpg --protocol http
    python -m clients.infer --image a.jpg --shm system                       # inputs/outputs via shm
    python -m clients.infer --image a.jpg --shm system --admin-key kimi-admin=<value>   # a keyed server
    python -m clients.infer --image f0.jpg --image f1.jpg --image cat.png --media-frames 2,0   # chunk + image
    python -m clients.infer --url vision-host:8001 --image a.jpg --nixl        # the embeddings pulled with NIXL
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from clients.kimi_client import KimiVisionClient, chat_prompt_ids


def parse_ids(text: str) -> np.ndarray:
    try:
        return np.asarray([int(t) for t in text.replace(" ", "").split(",") if t], dtype=np.int64)
    except ValueError:
        raise SystemExit(f"expected comma-separated integers, got {text!r}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", help="comma-separated prompt token ids with one <|media_pad|> (163605) per image; "
                                  "default: a minimal prompt with one placeholder per --image")
    ap.add_argument("--image", action="append", default=[], type=Path, help="encoded image file, in prompt order")
    ap.add_argument("--media-frames", help="comma-separated, one per media: 0 = image, t = video chunk of the next "
                                           "t --image frames (default: every --image is an image)")
    ap.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    ap.add_argument("--url", help="server address (default 127.0.0.1:8001 for gRPC, :8000 for HTTP)")
    ap.add_argument("--shm", choices=["none", "system", "cuda"], default="none")
    ap.add_argument("--nixl", action="store_true",
                    help="the response carries a NIXL descriptor instead of the embeddings, which this process then "
                         "READs from the server (clients/nixl_pull.py; the server's UCX port must be reachable)")
    ap.add_argument("--admin-key", default=os.environ.get("KIMI_ADMIN_KEY", ""),
                    help="<header>=<value>: the launcher's --admin-key, which a server started with one asks of "
                         "shared-memory requests (default: KIMI_ADMIN_KEY)")
    ap.add_argument("--output-capacity-mib", type=int, default=None,
                    help="the IMAGE_EMBEDS region with --shm system/cuda, MiB (default: sized to the request, "
                         "from its token counts, which kimi_placeholder answers from the images' headers)")
    ap.add_argument("--model", default=None,
                    help="the model to ask (default: the kimi_k25_vision ensemble; kimi_k25_vision_batched "
                         "takes the same request)")
    args = ap.parse_args(argv)
    url = args.url or ("127.0.0.1:8001" if args.protocol == "grpc" else "127.0.0.1:8000")
    try:
        images = [p.read_bytes() for p in args.image]
    except OSError as exc:  # a user's mistake: one line, not a traceback
        print(f"error: cannot read --image {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    frames = parse_ids(args.media_frames) if args.media_frames else None
    num_media = len(images) if frames is None else len(frames)
    ids = parse_ids(args.ids) if args.ids else chat_prompt_ids(num_media)
    client = KimiVisionClient(url, protocol=args.protocol, model=args.model, admin_key=args.admin_key)
    try:
        capacity = {}
        if args.output_capacity_mib is not None:
            capacity["output_capacity"] = args.output_capacity_mib << 20
        elif args.shm != "none":  # sized to this request: one more request, to kimi_placeholder
            capacity["output_capacity"] = max(1, client.embeds_bytes(ids, images, media_frames=frames))
        result = client.infer(ids, images, media_frames=frames, shm=args.shm, nixl=args.nixl, **capacity)
        if args.nixl:
            from clients.nixl_pull import NixlPuller

            with NixlPuller() as puller:
                result.image_embeds = puller.pull(result)
    except Exception as exc:  # noqa: BLE001 - print the server's message, not a traceback
        print(f"request failed: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(result.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
