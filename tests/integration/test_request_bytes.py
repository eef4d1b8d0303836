"""Byte limits on a real server (#37 item 6): an image over max_image_bytes and a request over
max_request_bytes are refused with the limit named, over gRPC and HTTP, by either ensemble; and a flood
of large bad requests leaves the server's memory where it was.

What "where it was" can mean on tritonserver 2.51 (docs/operations.md#memory): the heap (anonymous
memory of the server and its stubs) comes back, thanks to the launcher's jemalloc and its unpooled gRPC
requests; the Python backend's /dev/shm region of kimi_preprocess keeps the largest IMAGES it was
handed, two requests' worth, because tritonserver copies a request's inputs there before any of our
code runs and its regions never shrink. So the flood is measured twice: the first from a cold server
(heap within 10%; /dev/shm up by at most those two requests), the second from where the first left it
(heap plus /dev/shm within 10%: nothing accumulates however many requests come).
"""

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from backends.config import Limits
from backends.deploy.launcher import deployment_server
from backends.deploy.repository import Deployment
from backends.deploy.supervisor import process_tree
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like
from server_state import eventually, metric_sum

MIB = 1 << 20
LIMITS = Limits(max_image_bytes=8 * MIB, max_request_bytes=32 * MIB)
# The flood: 12 entries of 4 MiB garbage (48 MiB, over max_request_bytes), two at a time, twice.
FLOOD_REQUESTS, FLOOD_ENTRIES, FLOOD_ENTRY_BYTES, FLOOD_AT_ONCE = 8, 12, 4 * MIB, 2
FLOOD_BYTES = FLOOD_ENTRIES * FLOOD_ENTRY_BYTES


@pytest.fixture(scope="module")
def limited():
    with deployment_server(Deployment(device="cpu", limits=LIMITS), "request-bytes") as srv:
        yield srv


def _request(protocol: str, url: str, model: str, blobs: list[bytes]):
    """One raw request (no client-side checks), the batched ensemble's with its batch dimension."""
    tc = grpcclient if protocol == "grpc" else httpclient
    ids = chat_prompt_ids(len(blobs))
    images = np.array(blobs, dtype=object)
    if model.endswith("_batched"):
        ids, images = ids[None], images[None]
    a = tc.InferInput("INPUT_IDS", list(ids.shape), "INT64")
    a.set_data_from_numpy(ids)
    b = tc.InferInput("IMAGES", list(images.shape), "BYTES")
    b.set_data_from_numpy(images)
    client = tc.InferenceServerClient(url)
    try:
        client.infer(model, [a, b])
    finally:
        client.close()


def _refused(protocol: str, url: str, model: str, blobs: list[bytes]) -> str:
    with pytest.raises(Exception) as info:
        _request(protocol, url, model, blobs)
    return str(info.value)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_an_image_over_max_image_bytes_is_refused_naming_it(limited, protocol):
    url = limited.grpc_url if protocol == "grpc" else limited.http_url
    good = encode(photo_like(64, 48, seed=3), "JPEG")
    big = os.urandom(8 * MIB + 1)
    for model in ("kimi_k25_vision", "kimi_k25_vision_batched"):
        message = _refused(protocol, url, model, [good, big])
        assert f"in ensemble '{model}', image 1: {8 * MIB + 1} bytes exceeds the limit max_image_bytes={8 * MIB}" in message
    # kimi_placeholder called with IMAGES reads headers only, and refuses the same way.
    message = _refused(protocol, url, "kimi_placeholder", [good, big])
    assert f"image 1: {8 * MIB + 1} bytes exceeds the limit max_image_bytes={8 * MIB}" in message


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_request_over_max_request_bytes_is_refused_naming_it(limited, protocol):
    url = limited.grpc_url if protocol == "grpc" else limited.http_url
    before = metric_sum(limited, "kimi_vision_rejections_total", model="kimi_preprocess", reason="request_bytes_limit")
    blobs = [os.urandom(7 * MIB) for _ in range(5)]  # each within max_image_bytes, 35 MiB in all
    message = _refused(protocol, url, "kimi_k25_vision", blobs)
    assert (f"in ensemble 'kimi_k25_vision', the request's 5 images are {35 * MIB} bytes in all, exceeding the "
            f"limit max_request_bytes={32 * MIB}") in message
    assert eventually(lambda: metric_sum(limited, "kimi_vision_rejections_total", model="kimi_preprocess",
                                         reason="request_bytes_limit"), lambda v: v == before + 1) == before + 1
    # A request at the limits is served.
    photo = encode(photo_like(320, 240, seed=5), "JPEG")
    client = KimiVisionClient(limited.grpc_url)
    try:
        assert client.infer(chat_prompt_ids(2), [photo, photo]).token_counts.tolist()
    finally:
        client.close()


def _memory(srv) -> dict[str, float]:
    """MiB: the anonymous memory (heap) of tritonserver and its stubs, and the /dev/shm its regions use
    (allocated pages, not the files' sizes)."""
    heap = 0
    for pid in process_tree(srv.server.proc.pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        heap += sum(int(line.split()[1]) for line in status.splitlines() if line.startswith("RssAnon:"))
    shm = sum(f.stat().st_blocks * 512 for f in Path("/dev/shm").glob(f"{srv.server.shm_prefix}*"))
    return {"heap": heap / 1024, "shm": shm / MIB}


def _flood(url: str) -> list[str]:
    blob = os.urandom(FLOOD_ENTRY_BYTES)
    with ThreadPoolExecutor(FLOOD_AT_ONCE) as pool:
        return list(pool.map(lambda _: _refused("grpc", url, "kimi_k25_vision", [blob] * FLOOD_ENTRIES),
                             range(FLOOD_REQUESTS)))


def _settled(srv, target: float, key=lambda m: m["heap"], timeout_s: float = 20.0) -> dict[str, float]:
    """Memory once `key` of it is at most `target` and has stopped falling (jemalloc gives freed pages
    back within about a second), or as it is after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        now = _memory(srv)
        if time.monotonic() > deadline or (key(now) <= target and last is not None and key(now) >= key(last) - 2):
            return now
        last = now
        time.sleep(1.0)


def test_a_flood_of_large_bad_requests_leaves_memory_where_it_was(limited, capsys):
    photo = encode(photo_like(320, 240, seed=7), "JPEG")
    client = KimiVisionClient(limited.grpc_url)
    try:
        for _ in range(3):  # the steps' own first-request allocations, before anything is measured
            client.infer(chat_prompt_ids(2), [photo, photo])
        time.sleep(2)
        cold = _memory(limited)
        messages = _flood(limited.grpc_url)
        expected = (f"the request's {FLOOD_ENTRIES} images are {FLOOD_BYTES} bytes in all, exceeding the limit "
                    f"max_request_bytes={32 * MIB}")
        assert all(expected in m for m in messages), messages
        first = _settled(limited, cold["heap"] * 1.10)
        assert first["heap"] <= cold["heap"] * 1.10, (cold, first, limited.server.allocator.note())
        # The 2.51 high-water mark: kimi_preprocess's region keeps two requests' IMAGES, not the flood's.
        assert first["shm"] <= cold["shm"] + FLOOD_AT_ONCE * (FLOOD_BYTES / MIB) + 8, (cold, first)
        _flood(limited.grpc_url)
        total = first["heap"] + first["shm"]
        second = _settled(limited, total * 1.10, key=lambda m: m["heap"] + m["shm"])
        assert second["heap"] + second["shm"] <= total * 1.10, (first, second, limited.server.allocator.note())
        assert client.infer(chat_prompt_ids(2), [photo, photo]).token_counts.tolist()  # still serving
    finally:
        client.close()
    with capsys.disabled():
        print(f"\nflood of {2 * FLOOD_REQUESTS} x {FLOOD_BYTES // MIB} MiB ({limited.server.allocator.name}): "
              f"heap {cold['heap']:.0f} -> {first['heap']:.0f} -> {second['heap']:.0f} MiB, "
              f"/dev/shm {cold['shm']:.0f} -> {first['shm']:.0f} -> {second['shm']:.0f} MiB")
