"""The ensemble on a real tritonserver, over gRPC and HTTP, through our client library."""

import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backends.config import DEMO_CONFIG
from backends.deploy.first_requests import warm_up
from backends.deploy.repository import Deployment
from backends.deploy.supervisor import scrape_text
from backends.preprocess import Preprocessor
from backends.preprocess.resize_rule import navit_resize
from backends.checkpoint.seeded import seeded_model
from clients.kimi_client import MEDIA_PAD, KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like, sample_images, text_card
from server_state import counts, eventually, inference_count, settled
from tests import readme_answer

ROOT = Path(__file__).resolve().parents[2]

SIZES = [(640, 480), (300, 200), (1100, 90)]


def images():
    return [encode(photo_like(640, 480, seed=1), "JPEG", quality=90), encode(text_card(300, 200), "PNG"),
            encode(photo_like(1100, 90, seed=2), "WEBP")]


def expected(blobs, ids):
    """Independent pieces: token counts from the rule on the known sizes, ids by a plain loop,
    embeddings from the same model run in-process (the math itself is pinned by the unit tests)."""
    counts = [navit_resize(w, h, DEMO_CONFIG.media).num_tokens for w, h in SIZES[: len(blobs)]]
    expanded, i = [], 0
    for tok in ids.tolist():
        if tok == MEDIA_PAD:
            expanded += [MEDIA_PAD] * counts[i]
            i += 1
        else:
            expanded.append(tok)
    pv, grids, _ = Preprocessor(DEMO_CONFIG.media)(blobs)
    embeds = seeded_model(DEMO_CONFIG.encoder)(pv, grids)
    return counts, expanded, grids, embeds.numpy()


@pytest.fixture(scope="module")
def reference():
    blobs = images()
    ids = chat_prompt_ids(len(blobs), text_ids=[11, 12, 13])
    return blobs, ids, expected(blobs, ids)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_several_images_of_different_sizes(server, reference, protocol):
    blobs, ids, (counts, expanded, grids, embeds) = reference
    url = server.grpc_url if protocol == "grpc" else server.http_url
    client = KimiVisionClient(url, protocol=protocol)
    r = client.infer(ids, blobs)
    client.close()
    assert r.token_counts.tolist() == counts
    assert r.expanded_ids.tolist() == expanded
    assert r.grid_thws.tolist() == grids.tolist()
    assert r.image_embeds.shape == (sum(counts), DEMO_CONFIG.encoder.text_hidden_size)
    np.testing.assert_allclose(r.image_embeds, embeds, rtol=1e-5, atol=1e-6)


def test_system_shared_memory_gives_the_same_answer(server, reference):
    blobs, ids, (counts, expanded, _, embeds) = reference
    client = KimiVisionClient(server.grpc_url, protocol="grpc")
    r = client.infer(ids, blobs, shm="system")
    client.close()
    assert r.expanded_ids.tolist() == expanded
    np.testing.assert_allclose(r.image_embeds, embeds, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_placeholder_count_mismatch_is_refused_before_the_encoder(server, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    client = KimiVisionClient(url, protocol=protocol)
    models = ("moonvit3d", "kimi_placeholder")  # kimi_preprocess refuses it (tests/unit: before reading an image)
    before = settled(lambda: [inference_count(server, m) for m in models])
    refused_before = settled(lambda: inference_count(server, "kimi_preprocess"))
    ids = np.array([1, MEDIA_PAD, 2, MEDIA_PAD, 3], np.int64)  # two placeholders, one image
    with pytest.raises(InferenceServerException) as err:
        client.infer(ids, images()[:1])
    client.close()
    assert "has 2 <|media_pad|> placeholder token(s)" in str(err.value)
    assert "but 1 image(s)" in str(err.value)
    # Once the refusing step's count has moved, the later steps' would have too had they run.
    assert eventually(lambda: inference_count(server, "kimi_preprocess"), lambda n: n > refused_before) > refused_before
    assert [inference_count(server, m) for m in models] == before


def test_bad_prompt_and_bad_image_together_get_one_clear_error(server):
    """Both wrong at once: with the encoder and the expansion side by side, only the first step may
    refuse a request (tritonserver 2.51 never answers one whose parallel steps both fail)."""
    client = KimiVisionClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match=r"has 0 <\|media_pad\|> placeholder token.s. .id 163605. but 1 image"):
        client.infer(np.array([1, 2, 3], np.int64), [b"not an image at all"], timeout_s=60)
    client.close()


def test_placeholder_is_usable_on_its_own_with_images_or_counts(server, reference):
    blobs, ids, (counts, expanded, _, _) = reference
    c = grpcclient.InferenceServerClient(server.grpc_url)

    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    ids_in = tensor("INPUT_IDS", np.asarray(ids, np.int64), "INT64")
    from_images = c.infer("kimi_placeholder", [ids_in, tensor("IMAGES", np.array(blobs, dtype=object), "BYTES")])
    from_counts = c.infer("kimi_placeholder", [ids_in, tensor("IMAGE_TOKEN_COUNTS", np.array(counts, np.int64), "INT64")])
    with pytest.raises(InferenceServerException, match=r"has 3 <\|media_pad\|> placeholder token.s. .id 163605. but 2 image"):
        c.infer("kimi_placeholder", [ids_in, tensor("IMAGE_TOKEN_COUNTS", np.array(counts[:2], np.int64), "INT64")])
    c.close()
    for r in (from_images, from_counts):
        assert r.as_numpy("EXPANDED_IDS").tolist() == expanded
        assert r.as_numpy("IMAGE_TOKEN_COUNTS").tolist() == counts


def test_text_only_request_passes_ids_through(server):
    client = KimiVisionClient(server.grpc_url)
    ids = np.array([163587, 5, 6, 7, 163586], np.int64)
    r = client.infer(ids, [])
    client.close()
    assert r.expanded_ids.tolist() == ids.tolist()
    assert r.image_embeds.shape == (0, DEMO_CONFIG.encoder.text_hidden_size)
    assert r.grid_thws.shape == (0, 3) and r.token_counts.shape == (0,)


def test_garbage_image_is_a_clear_error_and_the_next_request_succeeds(server, reference):
    blobs, ids, (counts, expanded, _, embeds) = reference
    client = KimiVisionClient(server.grpc_url)
    bad = [blobs[0], b"\x89PNG\r\n\x1a\n this is not really a png"]
    with pytest.raises(InferenceServerException, match="image 1: not a decodable image"):
        client.infer(chat_prompt_ids(2), bad)
    r = client.infer(ids, blobs)
    client.close()
    np.testing.assert_allclose(r.image_embeds, embeds, rtol=1e-5, atol=1e-6)


def test_two_concurrent_clients(server, reference):
    blobs, ids, (counts, expanded, _, embeds) = reference
    errors, done = [], []

    def worker(protocol, n):
        url = server.grpc_url if protocol == "grpc" else server.http_url
        client = KimiVisionClient(url, protocol=protocol)
        try:
            for k in range(n):
                subset = blobs[: 1 + k % len(blobs)]
                r = client.infer(chat_prompt_ids(len(subset)), subset)
                rows = sum(counts[: len(subset)])
                np.testing.assert_allclose(r.image_embeds, embeds[:rows], rtol=1e-5, atol=1e-6)
                done.append(protocol)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(p, 4)) for p in ("grpc", "http")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert sorted(done) == ["grpc"] * 4 + ["http"] * 4


def test_failures_are_counted_in_our_metric(server):
    client = KimiVisionClient(server.grpc_url)
    with pytest.raises(InferenceServerException):
        client.infer(np.array([1, 2], np.int64), [b"x"])
    client.close()
    def failure_lines():
        lines = scrape_text(server.metrics_url).splitlines()
        return [l for l in lines if l.startswith("kimi_vision_request_failures_total")]

    def counted(lines):
        return any('model="kimi_preprocess"' in l and 'kind="invalid_input"' in l for l in lines)

    lines = eventually(failure_lines, counted)
    assert counted(lines), lines


def test_preprocess_is_usable_on_its_own(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    blob = encode(photo_like(100, 60), "PNG")
    inp = grpcclient.InferInput("IMAGES", [1], "BYTES")
    inp.set_data_from_numpy(np.array([blob], dtype=object))
    r = c.infer("kimi_preprocess", [inp])
    c.close()
    pv, grids, _ = Preprocessor(DEMO_CONFIG.media)([blob])
    assert r.as_numpy("GRID_THWS").tolist() == grids.tolist()
    assert np.array_equal(r.as_numpy("PIXEL_VALUES"), pv.numpy())


def test_video_chunk_and_image_through_the_ensemble(server):
    frames = [encode(photo_like(600, 400, seed=s), "JPEG") for s in range(4)]
    still = encode(text_card(300, 200), "PNG")
    blobs = frames + [still]
    client = KimiVisionClient(server.grpc_url)
    r = client.infer(chat_prompt_ids(2), blobs, media_frames=[4, 0])
    client.close()
    pv, grids, plans = Preprocessor(DEMO_CONFIG.media)(blobs, media_frames=[4, 0])
    embeds = seeded_model(DEMO_CONFIG.encoder)(pv, grids).numpy()
    assert r.grid_thws.tolist() == grids.tolist() and grids[0, 0] == 4
    assert r.token_counts.tolist() == [m.plan.num_tokens for m in plans]
    np.testing.assert_allclose(r.image_embeds, embeds, rtol=1e-5, atol=1e-6)


def test_bad_media_frames_is_a_clear_error(server):
    client = KimiVisionClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="MEDIA_FRAMES"):
        client.infer(chat_prompt_ids(1), images()[:2], media_frames=[3])
    client.close()


def encoder_counts(server):
    return counts(server, "moonvit3d")


def encoder_counts_since(server, before, inferences):
    """(inferences, executions) of moonvit3d since `before`, read once `inferences` have been counted:
    the statistics can lag the ensemble's answer (seen on a loaded 2-core machine)."""
    def since():
        return tuple(a - b for a, b in zip(encoder_counts(server), before))
    return eventually(since, lambda got: got[0] >= inferences)


def run_concurrently(fns):
    results = [None] * len(fns)

    def call(i):
        try:
            results[i] = fns[i]()
        except Exception as exc:  # noqa: BLE001 - returned to the test
            results[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


def test_batched_ensemble_runs_concurrent_requests_together(server, reference):
    blobs, _, (counts, _, _, embeds) = reference
    before = settled(lambda: encoder_counts(server))

    def one(k):
        def call():
            client = KimiVisionClient(server.grpc_url, batched=True)
            try:
                subset = blobs[: 1 + k % len(blobs)]
                return len(subset), client.infer(chat_prompt_ids(len(subset)), subset)
            finally:
                client.close()
        return call

    results = run_concurrently([one(k) for k in range(8)])
    for res in results:
        assert not isinstance(res, Exception), res
        n, r = res
        assert r.token_counts.tolist() == counts[:n]
        np.testing.assert_allclose(r.image_embeds, embeds[: sum(counts[:n])], rtol=1e-5, atol=1e-6)
    inferences, executions = encoder_counts_since(server, before, 8)
    assert inferences == 8
    assert executions < inferences, "the dynamic batcher never put two requests into one encoder forward"


def test_a_bad_request_in_an_encoder_batch_fails_alone(server):
    pv, grids, _ = Preprocessor(DEMO_CONFIG.media)([encode(photo_like(200, 150, seed=s), "PNG") for s in range(2)])
    model = seeded_model(DEMO_CONFIG.encoder)
    before = settled(lambda: encoder_counts(server))

    def call(pixels, grid):
        def run():
            c = grpcclient.InferenceServerClient(server.grpc_url)
            try:
                a = grpcclient.InferInput("PIXEL_VALUES", [1, *pixels.shape], "FP32")
                a.set_data_from_numpy(pixels[None])
                b = grpcclient.InferInput("GRID_THWS", [1, *grid.shape], "INT64")
                b.set_data_from_numpy(grid[None])
                return c.infer("moonvit3d", [a, b]).as_numpy("IMAGE_EMBEDS")[0]
            finally:
                c.close()
        return run

    good = pv.numpy()
    bad_pixels = good[:-4]  # 4 patches short of what GRID_THWS describes
    fns = [call(good, grids) for _ in range(5)]
    fns.insert(2, call(bad_pixels, grids))
    results = run_concurrently(fns)
    assert isinstance(results[2], InferenceServerException)
    assert "GRID_THWS describes" in str(results[2]) and "PIXEL_VALUES has" in str(results[2])
    expected = model(pv, grids).numpy()
    for i, res in enumerate(results):
        if i != 2:
            assert not isinstance(res, Exception), res
            np.testing.assert_allclose(res, expected, rtol=1e-5, atol=1e-6)
    inferences, executions = encoder_counts_since(server, before, len(fns))  # Triton counts the refused one too
    assert executions < inferences, "no batch was formed, so isolation inside a batch was not exercised"


@pytest.mark.parametrize("protocol,shm", [("grpc", "none"), ("http", "system")])
def test_cli_prints_the_answer(server, tmp_path, capsys, protocol, shm):
    from clients import infer

    paths = []
    for i, blob in enumerate(sample_images()):  # make run's two images
        paths += ["--image", str(tmp_path / f"img{i}")]
        (tmp_path / f"img{i}").write_bytes(blob)
    url = server.grpc_url if protocol == "grpc" else server.http_url
    assert infer.main([*paths, "--protocol", protocol, "--url", url, "--shm", shm]) == 0
    out = capsys.readouterr().out
    assert "media 0 (image): grid_thw (1, 36, 46) -> 414 tokens" in out
    assert "media 1 (image): grid_thw (1, 16, 22) -> 88 tokens" in out
    # The same two images as `make run`: the answer README.md shows (and `make image-test` checks the
    # container against) must be this server's, so a change of the numbers fails here first; the rule
    # for CPUs whose kernels add in another order is tests/readme_answer.py's.
    assert readme_answer.mismatch(out, (ROOT / "README.md").read_text()) is None, out
    assert infer.main(["--ids", "1,2", *paths, "--url", server.grpc_url]) == 1  # 1:1 error, no traceback
    assert "request failed:" in capsys.readouterr().err


def test_mistakes_at_the_client_come_back_with_what_to_do(server):
    """An unknown model names the service's ensembles; gRPC sent to the HTTP port says so; Pillow's
    object repr stays out of an undecodable image's message."""
    blobs = [encode(photo_like(32, 32, seed=4), "PNG")]
    typo = KimiVisionClient(server.grpc_url, model="kimi_k25_visoin")
    wrong_port = KimiVisionClient(server.http_url)  # gRPC to the HTTP port
    plain = KimiVisionClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match="ensembles are kimi_k25_vision and kimi_k25_vision_batched"):
            typo.infer(chat_prompt_ids(1), blobs)
        with pytest.raises(InferenceServerException, match="gRPC port"):
            wrong_port.infer(chat_prompt_ids(1), blobs, timeout_s=10)
        with pytest.raises(InferenceServerException, match="not a decodable image") as refused:
            plain.infer(chat_prompt_ids(1), [b"\x00garbage bytes, not an image"])
        assert "object at 0x" not in str(refused.value)
    finally:
        for c in (typo, wrong_port, plain):
            c.close()


def test_the_first_requests_a_gpu_server_sends_itself_pass_through_both_ensembles(server):
    """first_requests.warm_up, which a GPU deployment runs before it reports ready, against this server: each
    of its requests answered (its reason, the stubs' first GPU hand-off, is timed by lab/bench/mixed_sizes.py)."""
    line = warm_up(server.grpc_url, Deployment(device="gpu"))
    assert line.startswith("sent 8 requests") and "failed" not in line, line
    stopping = warm_up(server.grpc_url, Deployment(device="gpu"), should_stop=lambda: True)
    assert stopping.startswith("stopped after 0 requests"), stopping
