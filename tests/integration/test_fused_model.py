"""kimi_k25_vision_fused on a real tritonserver: the ensemble's contract and answers from one model whose
instance runs the three steps in one process (the session's server renders it with its pipeline:
Deployment(fused=True, fused_pipeline=True); one test starts it without)."""

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from backends.config import DEMO_CONFIG
from backends.preprocess import Preprocessor
from backends.weights.seeded import seeded_model
from clients.kimi_client import MEDIA_PAD, KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like, text_card
from contract import FUSED
from server_state import eventually, inference_count, metric_sum, phase_seconds_after, settled
from test_ensemble_server import expected, images



@pytest.fixture(scope="module")
def reference():
    blobs = images()
    ids = chat_prompt_ids(len(blobs), text_ids=[11, 12, 13])
    return blobs, ids, expected(blobs, ids)


def _client(server, protocol="grpc"):
    return KimiVisionClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol, model=FUSED)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_same_answer_as_the_independent_pieces_and_the_ensemble(server, reference, protocol):
    blobs, ids, (counts_, expanded, grids, embeds) = reference
    client = _client(server, protocol)
    r = client.infer(ids, blobs)
    client.close()
    assert r.token_counts.tolist() == counts_
    assert r.expanded_ids.tolist() == expanded  # a plain loop over the ids (expected())
    assert r.grid_thws.tolist() == grids.tolist()
    np.testing.assert_allclose(r.image_embeds, embeds, rtol=1e-5, atol=1e-6)
    ensemble = KimiVisionClient(server.grpc_url)
    e = ensemble.infer(ids, blobs)
    ensemble.close()
    # The same code on the same device, in one process instead of three: the same bits.
    assert np.array_equal(r.image_embeds, e.image_embeds)
    assert np.array_equal(r.expanded_ids, e.expanded_ids)


def test_it_is_one_model_the_ensembles_steps_do_not_run(server, reference):
    blobs, ids, _ = reference
    steps = ("kimi_preprocess", "moonvit3d", "kimi_placeholder")
    before = settled(lambda: [inference_count(server, m) for m in steps])
    fused_before = settled(lambda: inference_count(server, FUSED))
    client = _client(server)
    client.infer(ids, blobs)
    client.close()
    assert eventually(lambda: inference_count(server, FUSED), lambda n: n > fused_before) == fused_before + 1
    assert [inference_count(server, m) for m in steps] == before


def fused_steps(server) -> float:
    return metric_sum(server, "kimi_vision_step_seconds_count", model=FUSED)


def forward_seconds_after(server, steps: float) -> float:
    return phase_seconds_after(server, FUSED, "forward launched", steps)


def test_without_embeds_the_encoder_does_not_run(server, reference):
    """Ids, grids and counts without IMAGE_EMBEDS: the full answer's, and the encoder's phase (counted
    by the stub with KIMI_PHASES=1) does not move until a request asks for the embeddings."""
    blobs, ids, (counts_, expanded, grids, _) = reference
    client = _client(server)
    client.infer(ids, blobs)  # the phase's series exists from here on
    steps = settled(lambda: fused_steps(server))
    before = forward_seconds_after(server, steps)
    r = client.infer(ids, blobs, outputs=["EXPANDED_IDS", "IMAGE_TOKEN_COUNTS", "GRID_THWS"])
    assert r.image_embeds is None and r.expanded_ids.tolist() == expanded and r.token_counts.tolist() == counts_
    assert r.grid_thws.tolist() == grids.tolist()
    assert forward_seconds_after(server, steps + 1) == before
    client.infer(chat_prompt_ids(1), blobs[:1], outputs=["IMAGE_EMBEDS"])
    client.close()
    assert forward_seconds_after(server, steps + 2) > before


def test_a_file_that_does_not_decode_is_refused_for_any_outputs_as_by_the_ensemble(server):
    """The ensemble decodes for every subset of its outputs (kimi_preprocess makes them all), so a file
    whose header reads but whose data is cut short fails even when only the ids are asked for."""
    cut = encode(photo_like(64, 48, seed=3), "PNG")
    cut = cut[: len(cut) // 2]
    for model in ("kimi_k25_vision", FUSED):
        client = KimiVisionClient(server.grpc_url, model=model)
        try:
            with pytest.raises(InferenceServerException, match="image 0: decoding failed"):
                client.infer(chat_prompt_ids(1), [cut], outputs=["EXPANDED_IDS"])
        finally:
            client.close()


def test_bad_requests_get_the_ensembles_errors_and_the_next_one_is_served(server, reference):
    blobs, ids, (_, _, _, embeds) = reference
    client = _client(server)
    with pytest.raises(InferenceServerException) as err:
        client.infer(np.array([1, MEDIA_PAD, 2, MEDIA_PAD, 3], np.int64), blobs[:1])
    assert "has 2 <|media_pad|> placeholder token(s)" in str(err.value) and "but 1 image(s)" in str(err.value)
    with pytest.raises(InferenceServerException, match="image 1: not a decodable image"):
        client.infer(chat_prompt_ids(2), [blobs[0], b"\x89PNG\r\n\x1a\n this is not really a png"])
    with pytest.raises(InferenceServerException, match="MEDIA_FRAMES"):
        client.infer(chat_prompt_ids(1), blobs[:2], media_frames=[3])
    r = client.infer(ids, blobs)
    client.close()
    np.testing.assert_allclose(r.image_embeds, embeds, rtol=1e-5, atol=1e-6)


def test_text_only_and_video_requests(server):
    client = _client(server)
    ids = np.array([163587, 5, 6, 7, 163586], np.int64)
    text = client.infer(ids, [])
    frames = [encode(photo_like(600, 400, seed=s), "JPEG") for s in range(4)]
    blobs = frames + [encode(text_card(300, 200), "PNG")]
    video = client.infer(chat_prompt_ids(2), blobs, media_frames=[4, 0])
    client.close()
    assert text.expanded_ids.tolist() == ids.tolist()
    assert text.image_embeds.shape == (0, DEMO_CONFIG.encoder.text_hidden_size)
    assert text.grid_thws.shape == (0, 3) and text.token_counts.shape == (0,)
    pv, grids, plans = Preprocessor(DEMO_CONFIG.media)(blobs, media_frames=[4, 0])
    assert video.grid_thws.tolist() == grids.tolist() and grids[0, 0] == 4
    assert video.token_counts.tolist() == [m.plan.num_tokens for m in plans]
    np.testing.assert_allclose(video.image_embeds, seeded_model(DEMO_CONFIG.encoder)(pv, grids).numpy(),
                               rtol=1e-5, atol=1e-6)


def test_the_cli_asks_the_fused_model_by_name(server, tmp_path, capsys):
    from clients import infer

    paths = []
    for i, blob in enumerate(images()[:2]):
        paths += ["--image", str(tmp_path / f"img{i}")]
        (tmp_path / f"img{i}").write_bytes(blob)
    before = settled(lambda: inference_count(server, FUSED))
    assert infer.main([*paths, "--url", server.grpc_url, "--model", FUSED, "--shm", "system"]) == 0
    out = capsys.readouterr().out
    assert "media 0 (image): grid_thw (1, 36, 46) -> 414 tokens" in out and "image embeds: shape (502, 256)" in out
    # two requests: the region's size (counts, from the model named), then the answer
    assert eventually(lambda: inference_count(server, FUSED), lambda n: n >= before + 2) == before + 2


def test_a_full_queue_refuses_clearly_and_the_rest_are_served():
    """Its own server, the pipeline on (the queue bound comes with it), room for one waiting request in the
    server's queue: of eight heavy requests sent at once, some are refused with tritonserver's queue error,
    at least the running one and the waiting one are answered (the pipeline takes in a few more; how many
    is its own business), whole, and the server serves on."""
    import threading

    from backends.deploy.launcher import deployment_server
    from backends.deploy.repository import Deployment

    blobs = [encode(photo_like(1024, 1024, seed=i), "JPEG", quality=90) for i in range(4)]
    with deployment_server(Deployment(device="cpu", fused=True, fused_pipeline=True, max_queue=1), "fused-queue") as server:
        results = []

        def one():
            client = _client(server)
            try:
                results.append(client.infer(chat_prompt_ids(4), blobs))
            except Exception as exc:  # noqa: BLE001 - sorted below
                results.append(exc)
            finally:
                client.close()

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        refused = [r for r in results if isinstance(r, Exception)]
        answered = [r for r in results if not isinstance(r, Exception)]
        assert len(results) == 8 and refused and len(answered) >= 2, results
        assert all("Exceeds maximum queue size" in str(e) for e in refused), refused
        assert all(r.image_embeds.shape[0] == r.token_counts.sum() for r in answered)
        client = _client(server)
        r = client.infer(chat_prompt_ids(1), blobs[:1])
        client.close()
        assert r.image_embeds.shape[0] == r.token_counts.sum()


def test_without_its_pipeline_the_same_answers_one_request_at_a_time(server, reference):
    """Deployment(fused_pipeline=False), the default: every request answered from execute, none through the
    response sender (its phase "send", the sender's, never counted there; it is on the session's server,
    whose pipeline is on); its answers are the pipelined model's bits."""
    from backends.deploy.launcher import deployment_server
    from backends.deploy.repository import Deployment

    blobs, ids, (counts_, expanded, grids, embeds) = reference
    piped = _client(server)
    p = piped.infer(ids, blobs)
    piped.close()
    assert phase_seconds_after(server, FUSED, "send", settled(lambda: fused_steps(server))) > 0
    with deployment_server(Deployment(device="cpu", fused=True), "fused-inline",
                           env={"KIMI_PHASES": "1"}) as inline:
        client = _client(inline)
        r = client.infer(ids, blobs)
        with pytest.raises(InferenceServerException, match="placeholder"):
            client.infer(chat_prompt_ids(1), blobs)  # a bad one, and the next is served
        again = client.infer(ids, blobs)
        client.close()
        assert phase_seconds_after(inline, FUSED, "forward launched", 3) > 0  # its phases are counted
        assert phase_seconds_after(inline, FUSED, "send", 3) == 0
    assert r.expanded_ids.tolist() == expanded and r.grid_thws.tolist() == grids.tolist()
    assert np.array_equal(r.image_embeds, p.image_embeds) and np.array_equal(again.image_embeds, p.image_embeds)
