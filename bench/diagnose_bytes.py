"""Which tritonserver settings deliver large BYTES inputs intact to our Python models on this host?

Sends one 3000x2000 JPEG request (a) through the ensemble and (b) straight to kimi_placeholder, with
the default flags and with variants; writes the first variant whose ensemble call succeeds to
--write-args (for KIMI_TRITONSERVER_ARGS).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from backends.deploy.repository import Deployment
from backends.deploy.server import deployment_server
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like

VARIANTS = ["", "--pinned-memory-pool-byte-size=0", "--backend-config=python,shm-default-byte-size=67108864"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write-args", type=Path, default=Path("/tmp/extra_args"))
    args = ap.parse_args(argv)
    blob = encode(photo_like(3000, 2000, seed=1), "JPEG", quality=90)
    chosen = None
    for variant in VARIANTS:
        server = deployment_server(Deployment(device="gpu"), f"diag{VARIANTS.index(variant)}",
                                   extra_args=tuple(variant.split()))
        with server:
            results = {}
            c = grpcclient.InferenceServerClient(server.grpc_url)
            ids = grpcclient.InferInput("INPUT_IDS", [3], "INT64")
            ids.set_data_from_numpy(np.array([1, 163605, 2], np.int64))
            img = grpcclient.InferInput("IMAGES", [1], "BYTES")
            img.set_data_from_numpy(np.array([blob], dtype=object))
            try:
                r = c.infer("kimi_placeholder", [ids, img])
                results["direct"] = f"ok {r.as_numpy('EXPANDED_IDS').shape}"
            except Exception as exc:  # noqa: BLE001
                results["direct"] = f"ERR {str(exc)[:120]}"
            c.close()
            client = KimiVisionClient(server.grpc_url)
            try:
                r = client.infer(chat_prompt_ids(1), [blob])
                results["ensemble"] = f"ok {r.image_embeds.shape}"
                chosen = variant if chosen is None else chosen
            except Exception as exc:  # noqa: BLE001
                results["ensemble"] = f"ERR {str(exc)[:120]}"
            client.close()
        print(f"DIAG variant={variant or 'default'!r} {results}", flush=True)
        if chosen is not None:
            break
    args.write_args.write_text(chosen or "")
    print(f"DIAG chosen={chosen!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
