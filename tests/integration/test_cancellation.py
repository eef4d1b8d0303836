"""Cancelled work stops: a client that gives up on a heavy request does not keep the encoder busy."""


import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like
from server_state import eventually, inference_count, metric_sum, settled, upstream_crash_tolerated

HEAVY = 8  # 8 x 1792^2 = the max_patches limit (8 x 16384 patches)


@pytest.fixture(scope="module")
def heavy():
    return [encode(photo_like(1792, 1792, seed=i), "JPEG", quality=90) for i in range(HEAVY)]


def _cancelled(server, model) -> float:
    return metric_sum(server, "kimi_vision_request_failures_total", model=model, kind="cancelled")


def _stopped(server) -> float:
    """Requests stopped for their client: at preprocessing (its deadline passed there, or a direct call's
    cancel) or at the encoder (before its forward)."""
    return _cancelled(server, "kimi_preprocess") + _cancelled(server, "moonvit3d")


def test_a_request_cancelled_by_its_deadline_skips_the_encoder(server, heavy):
    before = settled(lambda: _stopped(server))
    forwards = settled(lambda: inference_count(server, "moonvit3d"))
    with upstream_crash_tolerated(server):
        client = KimiVisionClient(server.grpc_url)
        try:
            with pytest.raises(InferenceServerException, match="Deadline"):
                client.infer(chat_prompt_ids(HEAVY), heavy, timeout_s=0.5)
            # The next request is served; the heavy one was stopped before the encoder ran it.
            small = client.infer(chat_prompt_ids(1), [encode(photo_like(64, 64, seed=2), "PNG")])
            assert small.image_embeds.shape[0] == small.token_counts.sum()
        finally:
            client.close()
        assert eventually(lambda: _stopped(server), lambda v: v == before + 1) == before + 1
        assert settled(lambda: inference_count(server, "moonvit3d")) == forwards + 1  # the small request alone


def test_preprocessing_called_directly_stops_between_images(server, heavy):
    before = settled(lambda: _cancelled(server, "kimi_preprocess"))
    with upstream_crash_tolerated(server):
        c = grpcclient.InferenceServerClient(server.grpc_url)
        x = grpcclient.InferInput("IMAGES", [HEAVY], "BYTES")
        x.set_data_from_numpy(np.array(heavy, dtype=np.object_))
        with pytest.raises(InferenceServerException, match="Deadline"):
            c.infer("kimi_preprocess", [x], client_timeout=0.3)
        c.close()
        # The stub notices at its next check between images; give it the time one image takes at most.
        cancelled = eventually(lambda: _cancelled(server, "kimi_preprocess"), lambda v: v != before, timeout_s=30,
                               every_s=0.2)
        assert cancelled == before + 1


def test_a_deadline_stops_preprocessing_inside_the_ensemble_between_images(server, heavy):
    """tritonserver 2.51 does not tell an ensemble's running step that its client gave up, but the client's
    deadline travels as a request parameter to every step (contract.DEADLINE_PARAMETER): kimi_preprocess,
    already running, stops at its next media, and the request never reaches the encoder."""
    before = settled(lambda: _cancelled(server, "kimi_preprocess"))
    forwards = settled(lambda: inference_count(server, "moonvit3d"))
    distinct = [encode(photo_like(1792, 1792, seed=200 + i), "JPEG", quality=90) for i in range(HEAVY)]  # not cached
    with upstream_crash_tolerated(server):
        client = KimiVisionClient(server.grpc_url)
        try:
            with pytest.raises(InferenceServerException, match="Deadline"):
                client.infer(chat_prompt_ids(HEAVY), distinct, timeout_s=0.3)
        finally:
            client.close()
        assert eventually(lambda: _cancelled(server, "kimi_preprocess"), lambda v: v == before + 1,
                          timeout_s=60) == before + 1
        assert settled(lambda: inference_count(server, "moonvit3d")) == forwards
