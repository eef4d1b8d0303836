"""Any subset of the outputs, over both protocols and both ensembles; and shared-memory regions that
the server no longer holds once the client is done, whatever happened to the request."""

import itertools

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from clients.kimi_client import OUTPUTS, KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like, text_card
from server_state import eventually, inference_count, settled, wait_ready

SUBSETS = [list(c) for n in range(1, len(OUTPUTS) + 1) for c in itertools.combinations(OUTPUTS, n)]
FIELDS = {"EXPANDED_IDS": "expanded_ids", "IMAGE_EMBEDS": "image_embeds", "GRID_THWS": "grid_thws",
          "IMAGE_TOKEN_COUNTS": "token_counts"}


@pytest.fixture(scope="module")
def request_and_full_answer(server):
    assert wait_ready(server), "the shared server is not serving"  # set up before conftest's per-test wait
    blobs = [encode(photo_like(200, 150, seed=4), "JPEG", quality=90), encode(text_card(120, 90), "PNG")]
    ids = chat_prompt_ids(len(blobs))
    client = KimiVisionClient(server.grpc_url)
    full = client.infer(ids, blobs)
    client.close()
    return ids, blobs, full


@pytest.mark.parametrize("batched", [False, True], ids=["plain", "batched"])
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_every_subset_of_the_outputs(server, request_and_full_answer, protocol, batched):
    assert len(SUBSETS) == 15
    ids, blobs, full = request_and_full_answer
    # The ensemble itself for every subset (the client would send ids/counts alone to kimi_placeholder).
    client = KimiVisionClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol,
                              batched=batched, model="kimi_k25_vision_batched" if batched else "kimi_k25_vision")
    try:
        for subset in SUBSETS:
            got = client.infer(ids, blobs, outputs=subset)
            for name, field in FIELDS.items():
                value = getattr(got, field)
                if name in subset:
                    np.testing.assert_array_equal(value, getattr(full, field), err_msg=f"{subset}: {name}")
                else:
                    assert value is None, f"{subset}: {name} was not asked for"
    finally:
        client.close()


@pytest.mark.parametrize("batched", [False, True], ids=["plain", "batched"])
def test_ids_and_counts_alone_read_only_headers(server, request_and_full_answer, batched):
    """The client asks kimi_placeholder for them (headers only: preprocessing never runs); the ensemble
    answers the same subsets too (test_every_subset_of_the_outputs)."""
    ids, blobs, full = request_and_full_answer
    preprocess = "kimi_preprocess_batched" if batched else "kimi_preprocess"
    placeholder = "kimi_placeholder_batched" if batched else "kimi_placeholder"
    client = KimiVisionClient(server.grpc_url, batched=batched)
    before = settled(lambda: inference_count(server, preprocess))
    answered_before = settled(lambda: inference_count(server, placeholder))
    got = client.infer(ids, blobs, outputs=["EXPANDED_IDS", "IMAGE_TOKEN_COUNTS"])
    client.close()
    # Read once the answering model's count has moved: preprocessing's would have moved by then too.
    assert eventually(lambda: inference_count(server, placeholder), lambda n: n > answered_before) > answered_before
    assert inference_count(server, preprocess) == before, "ids and counts alone decoded the images"
    np.testing.assert_array_equal(got.expanded_ids, full.expanded_ids)
    np.testing.assert_array_equal(got.token_counts, full.token_counts)


def _registered(client: KimiVisionClient) -> list:
    status = client.client.get_system_shared_memory_status()
    if isinstance(status, list):  # HTTP: a list of regions
        return status
    return list(status.regions)  # gRPC: a protobuf map


def _registered_names(client: KimiVisionClient) -> list[str]:
    return [r["name"] if isinstance(r, dict) else r for r in _registered(client)]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_system_shared_memory_regions_are_pooled_and_released_on_close(server, request_and_full_answer, protocol):
    """shm="system" registers its two regions (images, embeddings) at the first request and reuses them:
    every later call, failed ones included, leaves exactly those registered; close() leaves none."""
    ids, blobs, full = request_and_full_answer
    client = KimiVisionClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol)
    watcher = KimiVisionClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol)
    try:
        pooled = None
        for i in range(30):
            if i % 5 == 4:  # failed requests too: a 1:1 mismatch
                with pytest.raises(InferenceServerException):
                    client.infer(ids[:-5], blobs, shm="system")
            else:
                r = client.infer(ids, blobs, shm="system", outputs=["IMAGE_EMBEDS", "IMAGE_TOKEN_COUNTS"])
                np.testing.assert_array_equal(r.image_embeds, full.image_embeds)
            names = sorted(_registered_names(client))
            pooled = pooled or names
            assert len(names) == 2 and names == pooled, f"call {i}: {names} against {pooled}"
    finally:
        client.close()
    try:
        assert _registered(watcher) == []  # nothing left once the client is closed
    finally:
        watcher.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_embeddings_region_is_sized_to_the_request(server, request_and_full_answer, protocol):
    """embeds_bytes sizes the shared-memory region from the request's token counts (kimi_placeholder,
    headers only) and the ensemble config's row: exactly the bytes the embeddings take on this (FP32)
    deployment, enough for the call, and a request the server refuses fails there (what clients.infer
    does when no --output-capacity-mib is given)."""
    ids, blobs, full = request_and_full_answer
    client = KimiVisionClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol)
    try:
        assert client.embeds_bytes(ids, blobs) == full.image_embeds.astype(np.float32).nbytes
        r = client.infer(ids, blobs, shm="system", output_capacity=client.embeds_bytes(ids, blobs))
        np.testing.assert_array_equal(r.image_embeds, full.image_embeds)
        with pytest.raises(InferenceServerException):
            client.embeds_bytes(ids[:-5], blobs)  # the 1:1 rule, from kimi_placeholder
    finally:
        client.close()


@pytest.mark.parametrize("batched", [False, True], ids=["plain", "batched"])
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_an_images_region_carries_the_images_across_requests_and_grows(server, request_and_full_answer, protocol, batched):
    """ImagesRegion: registered once, rewritten by every request (same answers as the images in the
    request body), replaced by a larger one when a request does not fit, and gone once closed; a
    failed request leaves it usable, and a request without images leaves it alone."""
    from clients.kimi_client import ImagesRegion

    ids, blobs, full = request_and_full_answer
    client = KimiVisionClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol,
                              batched=batched)
    other = KimiVisionClient(server.grpc_url)
    region = ImagesRegion(client, capacity=1024)  # smaller than one of the images
    try:
        assert _registered_names(client) == [region.name]
        first = region.name
        got = client.infer(ids, blobs, images_region=region)
        assert region.name != first and region.capacity >= sum(map(len, blobs)) + 4 * len(blobs)
        assert _registered_names(client) == [region.name]  # the small one was unregistered
        for name, field in FIELDS.items():
            np.testing.assert_array_equal(getattr(got, field), getattr(full, field), err_msg=name)
        grown = region.name
        one = [blobs[1]]
        single = client.infer(chat_prompt_ids(1), one)
        np.testing.assert_array_equal(client.infer(chat_prompt_ids(1), one, images_region=region).image_embeds,
                                      single.image_embeds)  # fewer bytes than before: same region, rewritten
        with pytest.raises(InferenceServerException):
            client.infer(ids[:-5], blobs, images_region=region)  # the 1:1 rule
        np.testing.assert_array_equal(client.infer(ids, blobs, images_region=region).image_embeds, full.image_embeds)
        text_only = client.infer(chat_prompt_ids(0), [], images_region=region)
        assert text_only.image_embeds.shape[0] == 0
        assert region.name == grown
        with pytest.raises(ValueError, match="another client"):
            other.infer(ids, blobs, images_region=region)
        with pytest.raises(ValueError, match="region of its own"):
            client.infer(ids, blobs, shm="system", images_region=region)
        region.close()
        assert _registered(client) == []
        with pytest.raises(ValueError, match="is closed"):
            client.infer(ids, blobs, images_region=region)
    finally:
        region.close()
        other.close()
        client.close()
