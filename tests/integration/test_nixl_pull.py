"""The embeddings pulled with NIXL from a real server (docs/llm_handoff.md#pulling-the-embeddings-with-nixl),
over UCX's TCP transport as between two hosts without RDMA: a request asks for a descriptor, a consumer
in another process READs the rows, and they are the response's IMAGE_EMBEDS bit for bit; the server frees
them once read, or unread when their lifetime ends, and a request that does not fit the arena is refused
naming the budget. Skipped where NIXL is not installed."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from backends.deploy.launcher import deployment_server
from backends.deploy.repository import Deployment
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like
from contract import EXPANDED_IDS, IMAGE_EMBEDS, IMAGE_TOKEN_COUNTS, nixl_descriptor
from server_state import eventually, metric_sum, settled

try:
    nixl_descriptor.load_nixl_api()
except ImportError as exc:
    pytest.skip(f"NIXL is not installed: {exc}", allow_module_level=True)

from clients.nixl_pull import NixlExpired, NixlPuller  # noqa: E402

CONSUMER = Path(__file__).with_name("nixl_consumer.py")
ROW = 256 * 4  # the demo model's FP32 rows
BUDGET = 128 * ROW  # two 48-token requests unread at once, not three
LIFETIME_MS = 6000  # time for a consumer process to start (2 busy cores) and read
UCX = {"UCX_TLS": "tcp"}  # UCX's TCP transport: what two hosts without an RDMA NIC use


@pytest.fixture(scope="module")
def nixl_server():
    srv = deployment_server(Deployment(device="cpu", nixl_bytes=BUDGET, nixl_lifetime_ms=LIFETIME_MS), "nixl", env=UCX)
    with srv:
        yield srv


@pytest.fixture
def puller(monkeypatch):
    for k, v in UCX.items():
        monkeypatch.setenv(k, v)  # read when the agent is made
    with NixlPuller() as p:
        yield p


def _held(server) -> tuple[float, float]:
    return (metric_sum(server, "kimi_vision_nixl_descriptors", model="moonvit3d"),
            metric_sum(server, "kimi_vision_nixl_bytes", model="moonvit3d"))


def _freed(server) -> tuple[float, float]:
    return (metric_sum(server, "kimi_vision_nixl_reads_total", model="moonvit3d"),
            metric_sum(server, "kimi_vision_nixl_expired_total", model="moonvit3d"))


def _tokens48(seed: int) -> bytes:
    return encode(photo_like(200, 160, seed=seed), "PNG")  # 8 x 6 merged patches: 48 rows, 48 KiB


def test_a_consumer_process_pulls_the_response_rows_bit_for_bit_and_the_server_frees_them(nixl_server, tmp_path):
    blobs = [encode(photo_like(130, 90, seed=1), "JPEG", quality=90), encode(photo_like(70, 120, seed=2), "PNG")]
    ids = chat_prompt_ids(2)
    reads, _ = settled(lambda: _freed(nixl_server))
    plain_client, batched_client = KimiVisionClient(nixl_server.grpc_url), KimiVisionClient(nixl_server.grpc_url, batched=True)
    try:
        plain = plain_client.infer(ids, blobs)
        got = {"plain": plain_client.infer(ids, blobs, nixl=True),
               "batched": batched_client.infer(ids, blobs, nixl=True),
               "http": KimiVisionClient(nixl_server.http_url, protocol="http").infer(ids, blobs, nixl=True),
               "text-only": plain_client.infer([1, 2, 3], [], nixl=True)}
    finally:
        plain_client.close()
        batched_client.close()
    for r in got.values():
        assert r.image_embeds is None and len(r.nixl_descriptor) < 1024  # a descriptor, not 20 KiB of rows
    assert got["plain"].expanded_ids.tolist() == plain.expanded_ids.tolist()
    assert got["plain"].token_counts.tolist() == plain.token_counts.tolist()
    assert eventually(lambda: _held(nixl_server), lambda v: v[0] == 3) == (3, 3 * plain.image_embeds.nbytes)
    args = []
    for name, r in got.items():
        (tmp_path / f"{name}.knx").write_bytes(r.nixl_descriptor)
        args += [str(tmp_path / f"{name}.knx"), str(tmp_path / f"{name}.npy")]
    done = subprocess.run([sys.executable, str(CONSUMER), *args], env={**_env(), **UCX}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("plain", "batched", "http"):
        pulled = np.load(tmp_path / f"{name}.npy")
        assert pulled.dtype == np.float32 and pulled.shape == plain.image_embeds.shape
        assert np.array_equal(pulled, plain.image_embeds), name
    assert np.load(tmp_path / "text-only.npy").shape == (0, 256)
    assert eventually(lambda: _held(nixl_server), lambda v: v == (0, 0)) == (0, 0)  # read: freed at once
    assert eventually(lambda: _freed(nixl_server)[0], lambda v: v == reads + 3) == reads + 3


def test_unread_rows_are_freed_when_their_lifetime_ends(nixl_server, puller):
    _, expired = settled(lambda: _freed(nixl_server))
    client = KimiVisionClient(nixl_server.grpc_url)
    try:
        r = client.infer(chat_prompt_ids(1), [_tokens48(3)], nixl=True)
    finally:
        client.close()
    assert eventually(lambda: _held(nixl_server), lambda v: v[0] == 1) == (1, 48 * ROW)
    time.sleep(LIFETIME_MS / 1000)
    assert eventually(lambda: _held(nixl_server), lambda v: v == (0, 0)) == (0, 0)
    assert eventually(lambda: _freed(nixl_server)[1], lambda v: v == expired + 1) == expired + 1
    with pytest.raises(NixlExpired, match="lifetime"):
        puller.pull(r)  # refused by the consumer: the slot may hold another request's rows by now


def test_a_request_that_does_not_fit_the_arena_is_refused_naming_the_budget(nixl_server, puller):
    client = KimiVisionClient(nixl_server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match=rf"more than the NIXL arena holds \(nixl_bytes={BUDGET}\)"):
            client.infer(chat_prompt_ids(1), [encode(photo_like(400, 300, seed=4), "PNG")], nixl=True)
        first, second = (client.infer(chat_prompt_ids(1), [_tokens48(5 + i)], nixl=True) for i in range(2))
        with pytest.raises(InferenceServerException, match=rf"no room .* NIXL arena \(nixl_bytes={BUDGET}\): 2 "
                                                           r"descriptor\(s\) not yet read"):
            client.infer(chat_prompt_ids(1), [_tokens48(7)], nixl=True)
        # The same request without a descriptor is served as ever, and other requests are unaffected.
        assert client.infer(chat_prompt_ids(1), [_tokens48(7)]).image_embeds.shape == (48, 256)
        puller.release(first)  # given up unread: room again at once
        assert eventually(lambda: _held(nixl_server)[0], lambda v: v == 1) == 1
        third = client.infer(chat_prompt_ids(1), [_tokens48(7)], nixl=True)
        plain = client.infer(chat_prompt_ids(1), [_tokens48(7)], outputs=[IMAGE_EMBEDS, EXPANDED_IDS, IMAGE_TOKEN_COUNTS])
        assert np.array_equal(puller.pull(third), plain.image_embeds)
        puller.release(second)
    finally:
        client.close()
    assert eventually(lambda: _held(nixl_server), lambda v: v == (0, 0)) == (0, 0)


def test_a_bad_parameter_is_the_requests_own_error(nixl_server):
    import tritonclient.grpc as tc

    raw = tc.InferenceServerClient(nixl_server.grpc_url)
    ids = tc.InferInput("INPUT_IDS", [3], "INT64")
    ids.set_data_from_numpy(np.array([1, 2, 3], np.int64))
    images = tc.InferInput("IMAGES", [0], "BYTES")
    images.set_data_from_numpy(np.array([], dtype=np.object_))
    try:
        with pytest.raises(InferenceServerException, match="kimi_embeds_nixl='maybe': expected true or false"):
            raw.infer("kimi_k25_vision", [ids, images], parameters={"kimi_embeds_nixl": "maybe"},
                      outputs=[tc.InferRequestedOutput("IMAGE_EMBEDS_NIXL")])
    finally:
        raw.close()


def _env() -> dict:
    import os

    return dict(os.environ)


def test_the_cli_pulls_with_nixl_and_prints_the_same_answer(nixl_server, tmp_path):
    image = tmp_path / "a.png"
    image.write_bytes(encode(photo_like(150, 110, seed=9), "PNG"))
    root = Path(__file__).resolve().parents[2]

    def cli(*extra):
        done = subprocess.run([sys.executable, "-m", "clients.infer", "--url", nixl_server.grpc_url, "--image", str(image),
                               *extra], cwd=root, env={**_env(), **UCX}, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return [line for line in done.stdout.splitlines() if not line.startswith("20")]  # NIXL's own log lines

    assert cli("--nixl") == cli()
