"""Requests of our own through the GPU ensembles once tritonserver is ready, before the launcher says so.

Why (docs/triton_runtime.md#the-first-request-of-a-stub): the Python backend shares tritonserver's
CUDA pool with a stub lazily, at that stub's first request that hands it GPU tensors: the stub then
maps the whole pool (4 GiB for the default GPU deployment), which cost the first request 100-125 ms in
each of kimi_preprocess and moonvit3d on an H100, however well the models warmed up inside their own
processes. tritonserver's `model_warmup` cannot do it for us: it sends its inputs from host memory, so
the encoder's stub would still map the pool at a user's request. So the launcher sends each ensemble
one small image per preprocessing instance, all at once (an idle instance takes each; twice, in case
one instance took two), and only then reports ready; a model reloaded after its stub died gets the same.

A failed warm-up request is logged in one line and does not stop the server: the requests are ours,
and the models answered their own start-up checks already.
"""

from __future__ import annotations

import concurrent.futures
import io
import itertools
import secrets
import time

import numpy as np

import contract
from backends.deploy.repository import Deployment
from backends.errors import first_line

ROUNDS = 2
# Image numbers: never the same image twice in this process (a reload's warm-up after the start-up's
# included), and from a random start, so a server's cache never holds them from an earlier launch.
_NUMBERS = itertools.count(secrets.randbits(20))


def _image(n: int) -> bytes:
    """The n-th 448x448 JPEG (256 tokens): small, through the GPU decode and the encoder like any photo.
    Each request sends another one: a repeated image would be answered by the embedding cache, and would
    hand the encoder no pixels on the GPU. (They stay in the cache like any image, 3.7 MB each.) n's three
    low bytes shift the three channels: 2^24 distinct images."""
    from PIL import Image

    y, x = np.mgrid[0:448, 0:448]
    rgb = np.stack([(x * 3 + y * 5 + n) % 256, (x * 7 + 40 + (n >> 8)) % 256, (y * 11 + x + (n >> 16)) % 256],
                   -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _inputs(grpcclient, image: bytes, batched: bool) -> list:
    ids = np.asarray(contract.chat_prompt_ids(1), dtype=np.int64)
    images = np.array([image], dtype=np.object_)
    if batched:  # a batch dimension of 1 in front of every tensor
        ids, images = ids[None], images[None]
    out = []
    for name, value, dtype in ((contract.INPUT_IDS, ids, "INT64"), (contract.IMAGES, images, "BYTES")):
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        out.append(tensor)
    return out


def warm_up(grpc_url: str, dep: Deployment, timeout_s: float = 60.0, should_stop=None) -> str:
    """Sends the requests; returns a line for the log (what was sent, how long it took, any failure).
    `should_stop()` is asked before each round: a stop waits for at most one round's requests."""
    import tritonclient.grpc as grpcclient

    if dep.device != "gpu":
        return ""
    per_round = dep.gpus * max(dep.preprocess_instances, dep.encoder_instances)
    t0 = time.monotonic()
    failures: list[str] = []
    sent = 0
    with grpcclient.InferenceServerClient(grpc_url) as client, \
            concurrent.futures.ThreadPoolExecutor(per_round) as pool:
        for ensemble, batched in ((contract.ENSEMBLE, False), (contract.BATCHED_ENSEMBLE, True)):
            for _ in range(ROUNDS):
                if should_stop is not None and should_stop():
                    return f"stopped after {sent} requests of our own (the server is stopping)"
                images = [_image(next(_NUMBERS)) for _ in range(per_round)]
                sent += len(images)

                def one(image):
                    client.infer(ensemble, _inputs(grpcclient, image, batched),
                                 outputs=[grpcclient.InferRequestedOutput(contract.IMAGE_TOKEN_COUNTS),
                                          grpcclient.InferRequestedOutput(contract.IMAGE_EMBEDS)],
                                 client_timeout=timeout_s)

                for done in [pool.submit(one, image) for image in images]:
                    try:
                        done.result()
                    except Exception as exc:  # noqa: BLE001 - ours, not a user's: say so and serve on
                        failures.append(f"{ensemble}: {first_line(exc)}")
    line = f"sent {sent} requests of our own through both ensembles in {time.monotonic() - t0:.2f} s"
    if failures:
        line += f"; {len(failures)} failed (first: {failures[0]})"
    return line
