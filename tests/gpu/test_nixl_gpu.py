"""The NIXL pull between GPUs of one host (docs/llm_handoff.md#pulling-the-embeddings-with-nixl): the GPU
deployment's encoder registers its arena in GPU memory, a consumer READs a request's rows into a torch
tensor on its own GPU (UCX's CUDA IPC, no host copy), and they are the response's IMAGE_EMBEDS bit for
bit; the server frees them once read. Skipped without CUDA (tests/gpu/conftest.py) or NIXL."""

import numpy as np
import pytest
import torch

from backends.deploy.launcher import deployment_server
from backends.deploy.repository import Deployment
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like, text_card
from contract import nixl_descriptor
from tests.integration.server_state import eventually, metric_sum


@pytest.fixture(scope="module")
def nixl_gpu_server():
    try:
        nixl_descriptor.load_nixl_api()
    except ImportError as exc:
        pytest.skip(f"NIXL is not installed: {exc}")
    dep = Deployment(device="gpu", gpus=1, cache_bytes=0, nixl_bytes=256 << 20)
    server = deployment_server(dep, "gpu-nixl").start()
    yield server
    server.stop()


def test_rows_pulled_into_a_gpu_tensor_equal_the_response_bit_for_bit(nixl_gpu_server):
    from clients.nixl_pull import NixlPuller

    blobs = [encode(photo_like(1024, 1024, seed=3), "JPEG", quality=90), encode(text_card(), "PNG")]
    ids = chat_prompt_ids(2)
    client = KimiVisionClient(nixl_gpu_server.grpc_url, embeds_dtype="bf16")
    try:
        plain = client.infer(ids, blobs)
        with NixlPuller() as puller:
            for _ in range(3):  # the first pull also meets the server's agent
                r = client.infer(ids, blobs, nixl=True)
                d = nixl_descriptor.decode(r.nixl_descriptor)
                assert (d.mem, d.dtype, d.shape) == ("VRAM", "BF16", plain.image_embeds.shape)
                pulled = puller.pull(r, device="cuda:0")
                assert pulled.is_cuda and pulled.dtype == torch.bfloat16
                np.testing.assert_array_equal(pulled.view(torch.int16).cpu().numpy().view(np.uint16), plain.image_embeds)
            # Into one buffer registered once (what an LLM keeps), filled from its start.
            buffer = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda:0")
            puller.register(buffer)
            view = puller.pull(client.infer(ids, blobs, nixl=True), buffer)
            assert view.data_ptr() == buffer.data_ptr()
            np.testing.assert_array_equal(view.view(torch.int16).cpu().numpy().view(np.uint16), plain.image_embeds)
    finally:
        client.close()
    held = lambda: metric_sum(nixl_gpu_server, "kimi_vision_nixl_descriptors", model="moonvit3d")  # noqa: E731
    assert eventually(held, lambda v: v == 0) == 0
    assert metric_sum(nixl_gpu_server, "kimi_vision_nixl_reads_total", model="moonvit3d") == 4
