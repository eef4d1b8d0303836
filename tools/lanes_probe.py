"""Are kimi_k25_vision_fused's answers under load the bits of one request at a time, at real size?

The GPU test (tests/gpu/test_gpu_server.py) checks the fused model's lanes with the demo model, whose
matrices are too small for cuBLAS to use its workspace; two lanes' graph replays that shared one
workspace would go unseen there. This serves the real-size random checkpoint with the fused model
(pipeline on, `--lanes` encoder lanes), sends each case six times one at a time (each lane captures and
replays its graphs) and compares with the plain ensemble's answer, then `--concurrency` at once for
`--rounds` rounds (the lanes' replays side by side) and compares every answer with the first.

    python -m tools.lanes_probe --checkpoint /tmp/kimi-random [--lanes 2] [--concurrency 16] [--rounds 3]
    python -m tools.lanes_probe --device cpu --concurrency 8 --rounds 2   # the demo model on the CPU
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from backends.deploy.launcher import deployment_server
from backends.deploy.repository import Deployment
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like
from contract import FUSED

CASES = {
    "1 x 1024^2": [encode(photo_like(1024, 1024, seed=1), "JPEG", quality=90)],
    "8 x 448^2": [encode(photo_like(448, 448, seed=10 + i), "JPEG", quality=90) for i in range(8)],
}


def _once(url: str, model: str, ids, blobs) -> np.ndarray:
    client = KimiVisionClient(url, model=model)
    try:
        return client.infer(ids, blobs).image_embeds
    finally:
        client.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="", help="default: the embedded demo model")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="gpu",
                    help="cpu: the pipeline's threads and answers without lanes (a smoke run)")
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    dep = Deployment(device=args.device, checkpoint=args.checkpoint, fused=True, fused_pipeline=True,
                     fused_lanes=args.lanes)
    lanes = f"{args.lanes} lane(s)" if args.device == "gpu" else "CPU, no lanes"
    bad = 0
    with deployment_server(dep, "lanes-probe") as server:
        for name, blobs in CASES.items():
            ids = chat_prompt_ids(len(blobs))
            ensemble = _once(server.grpc_url, "kimi_k25_vision", ids, blobs)
            alone = [_once(server.grpc_url, FUSED, ids, blobs) for _ in range(6)]
            same_alone = sum(np.array_equal(a, ensemble) for a in alone)
            with ThreadPoolExecutor(args.concurrency) as pool:
                burst = list(pool.map(lambda _: _once(server.grpc_url, FUSED, ids, blobs),
                                      range(args.concurrency * args.rounds)))
            same_burst = sum(np.array_equal(b, alone[0]) for b in burst)
            worst = max(float(np.abs(b.astype(np.float64) - alone[0]).max()) for b in burst)
            print(f"{name}, {lanes}: one at a time {same_alone} of {len(alone)} equal to the ensemble's "
                  f"answer; at concurrency {args.concurrency} {same_burst} of {len(burst)} equal to one at a time "
                  f"(largest difference {worst:g})", flush=True)
            bad += (len(alone) - same_alone) + (len(burst) - same_burst)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
