"""The GPU deployment on a real tritonserver: tensors stay on the GPU between steps, results equal the
in-process GPU pipeline, CUDA shared memory works, and the placement check catches a too-small pool."""

import numpy as np
import pytest
import torch

from backends.config import DEMO_CONFIG
from backends.deploy.repository import Deployment
from backends.deploy.launcher import TritonServer, deployment_server
from backends.preprocess import Preprocessor
from backends.checkpoint.seeded import seeded_model
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like, text_card

# What Triton logs when an intermediate tensor does not fit its CUDA pool: the next step then
# silently receives zeros (docs/triton_runtime.md#gpu-tensors-between-steps).
PLACEMENT_FAILURES = ("failed to copy data", "falling back to pinned system memory")


def placement_problems(server: TritonServer) -> list[str]:
    return [line for line in server.log_tail(10**7).splitlines() if any(p in line for p in PLACEMENT_FAILURES)]


def start(name: str, pool: int | None = None, cache_bytes: int = 0) -> TritonServer:
    # every visible GPU, a pool on each; the embedding cache off unless asked for, so that a request sent
    # again runs the encoder again (the graph replays below)
    dep = Deployment(device="gpu", gpus=torch.cuda.device_count(), cache_bytes=cache_bytes)
    return deployment_server(dep, name, cuda_pools={g: pool for g in range(dep.gpus)} if pool else dep.cuda_pools()).start()


def images():
    return [encode(photo_like(3000, 2000, seed=1), "JPEG", quality=90), encode(text_card(), "PNG"),
            encode(photo_like(640, 480, seed=2), "PNG")]


def in_process(blobs):
    pv, grids, _ = Preprocessor(DEMO_CONFIG.media, device="cuda", out_dtype=torch.bfloat16)(blobs)
    model = seeded_model(DEMO_CONFIG.encoder).to("cuda", torch.bfloat16)
    return model(pv, grids).float().cpu().numpy()


@pytest.fixture(scope="module")
def gpu_server():
    server = start("gpu-test")
    yield server
    server.stop()


def test_gpu_ensemble_matches_in_process_and_stays_on_the_gpu(gpu_server):
    blobs = images()
    client = KimiVisionClient(gpu_server.grpc_url)
    r = client.infer(chat_prompt_ids(3), blobs)
    client.close()
    ref = in_process(blobs)
    assert r.image_embeds.shape == ref.shape
    err = np.abs(r.image_embeds - ref).max() / np.abs(ref).max()
    assert err < 1e-2, f"relative error {err:.3e} over {ref.shape[0]} rows"
    assert placement_problems(gpu_server) == []


def test_cuda_shared_memory_output(gpu_server):
    blobs = images()[1:]
    client = KimiVisionClient(gpu_server.grpc_url)
    plain = client.infer(chat_prompt_ids(2), blobs)
    shm = client.infer(chat_prompt_ids(2), blobs, shm="cuda")
    client.close()
    assert shm.cuda_embeds.is_cuda and shm.cuda_embeds.dtype == torch.bfloat16
    np.testing.assert_array_equal(shm.image_embeds, plain.image_embeds)


def test_one_registered_cuda_region_serves_several_requests(gpu_server):
    """Embeddings into one registered CUDA region, the images in the request body or in one registered
    host region (ImagesRegion): the same values either way."""
    from clients.kimi_client import CudaOutputRegion, ImagesRegion

    client = KimiVisionClient(gpu_server.grpc_url)
    try:
        with CudaOutputRegion(client, 64 << 20) as region, ImagesRegion(client) as inputs:
            for blobs in (images()[1:], images()[2:]):
                plain = client.infer(chat_prompt_ids(len(blobs)), blobs)
                for images_region in (None, inputs):
                    got = client.infer_into(region, chat_prompt_ids(len(blobs)), blobs, images_region=images_region)
                    assert got.image_embeds is None and got.cuda_embeds.is_cuda
                    np.testing.assert_array_equal(got.cuda_embeds.float().cpu().numpy(), plain.image_embeds)
    finally:
        client.close()


def test_graph_replays_give_the_eager_bits_on_a_served_gpu(gpu_server):
    """moonvit3d captures a CUDA graph on a grid list's second sighting and replays it after: the same
    bits every time, through either ensemble. Two small images that no other test sends (a JPEG on the
    GPU decoder and a PNG) go six times through each; the three large images (18,756 patches, above the
    graphs' 16,384-patch bound) stay eager and must agree too."""
    small = [encode(photo_like(336, 252, seed=11), "JPEG", quality=85), encode(photo_like(196, 140, seed=12), "PNG")]
    plain, batched = KimiVisionClient(gpu_server.grpc_url), KimiVisionClient(gpu_server.grpc_url, batched=True)
    try:
        for blobs in (images(), small):
            ids = chat_prompt_ids(len(blobs))
            first = plain.infer(ids, blobs)
            for _ in range(6):
                for client in (plain, batched):
                    r = client.infer(ids, blobs)
                    np.testing.assert_array_equal(r.image_embeds, first.image_embeds)
                    assert r.expanded_ids.tolist() == first.expanded_ids.tolist()
    finally:
        plain.close()
        batched.close()
    assert placement_problems(gpu_server) == []


def test_text_only_on_gpu(gpu_server):
    client = KimiVisionClient(gpu_server.grpc_url)
    r = client.infer(np.array([1, 2, 3]), [])
    client.close()
    assert r.expanded_ids.tolist() == [1, 2, 3] and r.image_embeds.shape == (0, DEMO_CONFIG.encoder.text_hidden_size)


def test_placement_check_catches_a_too_small_pool():
    """The same request with a 1 MiB pool: the 3000x2000 image's patches (~9 MB in BF16) cannot stay on
    the GPU. The placement check (or the result) must notice; otherwise the check above proves nothing."""
    server = start("gpu-small-pool", 1 << 20)
    try:
        blobs = images()
        client = KimiVisionClient(server.grpc_url)
        try:
            r = client.infer(chat_prompt_ids(3), blobs)
            wrong = not np.allclose(r.image_embeds, in_process(blobs), rtol=1e-2, atol=1e-2)
        except Exception:  # noqa: BLE001 - an error is also a detected failure
            wrong = True
        client.close()
        problems = placement_problems(server)
        assert problems or wrong, "a 1 MiB pool went unnoticed"
    finally:
        server.stop()


def test_the_embedding_cache_answers_a_repeated_request_with_the_first_bits_on_the_gpu():
    """With the cache on (its GPU default), the second sight of a request's images is a hit: the same
    bits as the first, neither decoded (the GPU JPEG route included) nor encoded again."""
    from backends.deploy.supervisor import scrape

    def metric(server, name, **labels):
        return sum(v for n, got, v in scrape(server.metrics_url)
                   if n == name and all(got.get(k) == want for k, want in labels.items()))

    server = start("gpu-cache", cache_bytes=Deployment(device="gpu").cache_bytes)
    try:
        blobs = images()
        client = KimiVisionClient(server.grpc_url)
        first = client.infer(chat_prompt_ids(3), blobs)
        import time

        time.sleep(0.5)  # the stubs send their counts every 0.2 s
        decoded = metric(server, "kimi_vision_decodes_total", model="kimi_preprocess")
        again = client.infer(chat_prompt_ids(3), blobs)
        shm = client.infer(chat_prompt_ids(3), blobs, shm="cuda")
        client.close()
        np.testing.assert_array_equal(again.image_embeds, first.image_embeds)
        np.testing.assert_array_equal(shm.image_embeds, first.image_embeds)
        time.sleep(0.5)
        assert metric(server, "kimi_vision_cache_hits_total", model="moonvit3d") == 6
        assert metric(server, "kimi_vision_decodes_total", model="kimi_preprocess") == decoded
        assert placement_problems(server) == []
    finally:
        server.stop()

