"""Which requests and tritonserver settings deliver BYTES inputs intact to our Python models on this
host? (On the shared H200 host the 2.51 stub for Python 3.12 received a 1.7 MB JPEG as 0xA9 bytes.)

Each probe gets a fresh server (a crashed stub would poison later probes): text-only, a small PNG
(under the 1 MiB default shared-memory chunk) and the 3000x2000 JPEG, sent to kimi_placeholder
directly, then the large JPEG through the ensemble under flag variants. The first variant whose
ensemble call succeeds is written to --write-args (for KIMI_TRITONSERVER_ARGS).
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


def placeholder_direct(server, blobs: list[bytes]) -> str:
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        ids = grpcclient.InferInput("INPUT_IDS", [2 + len(blobs)], "INT64")
        ids.set_data_from_numpy(np.array([1] + [163605] * len(blobs) + [2], np.int64))
        img = grpcclient.InferInput("IMAGES", [len(blobs)], "BYTES")
        img.set_data_from_numpy(np.array(blobs, dtype=object).reshape(-1))
        r = c.infer("kimi_placeholder", [ids, img])
        return f"ok {r.as_numpy('IMAGE_TOKEN_COUNTS').tolist()}"
    except Exception as exc:  # noqa: BLE001
        return f"ERR {str(exc)[:100]}"
    finally:
        c.close()


def ensemble(server, blobs: list[bytes]) -> str:
    client = KimiVisionClient(server.grpc_url)
    try:
        return f"ok {client.infer(chat_prompt_ids(len(blobs)), blobs).image_embeds.shape}"
    except Exception as exc:  # noqa: BLE001
        return f"ERR {str(exc)[:100]}"
    finally:
        client.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write-args", type=Path, default=Path("/tmp/extra_args"))
    args = ap.parse_args(argv)
    dep = Deployment(device="gpu")
    small = encode(photo_like(64, 64, seed=2), "PNG")
    big = encode(photo_like(3000, 2000, seed=1), "JPEG", quality=90)
    for label, blobs in (("text-only", []), ("small PNG", [small]), ("large JPEG", [big])):
        with deployment_server(dep, "diag-probe") as server:
            print(f"DIAG probe={label!r} direct={placeholder_direct(server, blobs)}", flush=True)
    chosen = None
    for i, variant in enumerate(VARIANTS):
        with deployment_server(dep, f"diag{i}", extra_args=tuple(variant.split())) as server:
            result = ensemble(server, [big])
        print(f"DIAG variant={variant or 'default'!r} ensemble={result}", flush=True)
        if result.startswith("ok"):
            chosen = variant
            break
    args.write_args.write_text(chosen or "")
    print(f"DIAG chosen={chosen!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
