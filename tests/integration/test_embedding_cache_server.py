"""The embedding cache on a real server: a media sent again is answered from the cache, bit for bit the
first answer, without being decoded or encoded again; changed bytes never hit; concurrent clients get
one entry per media; a small budget holds under a flood of distinct images."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from backends.deploy.launcher import deployment_server
from backends.deploy.repository import Deployment
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like
from server_state import eventually, metric_sum, settled


def _ask(url, blobs, **kw):
    client = KimiVisionClient(url, **kw)
    try:
        return client.infer(chat_prompt_ids(len(blobs)), blobs)
    finally:
        client.close()


def _cache(server) -> tuple[float, float]:
    return (metric_sum(server, "kimi_vision_cache_hits_total", model="moonvit3d"),
            metric_sum(server, "kimi_vision_cache_misses_total", model="moonvit3d"))


def _decoded(server) -> float:
    return metric_sum(server, "kimi_vision_decodes_total", model="kimi_preprocess")


def test_a_media_sent_again_is_answered_from_the_cache_without_decoding_bit_for_bit(server):
    blobs = [encode(photo_like(333, 222, seed=41), "JPEG", quality=90), encode(photo_like(140, 90, seed=42), "PNG")]
    first = _ask(server.grpc_url, blobs)
    hits, misses = settled(lambda: _cache(server))
    decoded = settled(lambda: _decoded(server))
    again = _ask(server.grpc_url, blobs)
    np.testing.assert_array_equal(again.image_embeds, first.image_embeds)
    assert again.expanded_ids.tolist() == first.expanded_ids.tolist()
    assert again.token_counts.tolist() == first.token_counts.tolist()
    assert eventually(lambda: _cache(server), lambda v: v == (hits + 2, misses)) == (hits + 2, misses)
    assert settled(lambda: _decoded(server)) == decoded  # preprocessing decoded neither image again
    # The batched ensemble reaches the same encoder and its cache.
    batched = _ask(server.grpc_url, blobs, batched=True)
    np.testing.assert_array_equal(batched.image_embeds, first.image_embeds)
    # Changed bytes never hit: one byte of the PNG's pixel data is another image.
    changed = bytearray(blobs[1])
    changed[len(changed) // 2] ^= 0x01
    hits, misses = settled(lambda: _cache(server))
    try:
        _ask(server.grpc_url, [bytes(changed)])
    except Exception:  # noqa: BLE001 - a flipped byte may break the PNG's checksum: refused, not cached
        pass
    assert settled(lambda: _cache(server))[0] == hits


def test_concurrent_clients_share_one_entry_per_media(server):
    same = encode(photo_like(257, 193, seed=51), "JPEG", quality=85)
    different = [encode(photo_like(96 + 8 * i, 80, seed=60 + i), "PNG") for i in range(8)]
    jobs = [[same]] * 8 + [[b] for b in different]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda blobs: _ask(server.grpc_url, blobs).image_embeds, jobs))
    for got in answers[1:8]:
        np.testing.assert_array_equal(got, answers[0])  # one media, one set of rows
    for blobs, got in zip(jobs[8:], answers[8:]):
        np.testing.assert_array_equal(_ask(server.grpc_url, blobs).image_embeds, got)  # a hit: the first rows
    np.testing.assert_array_equal(_ask(server.grpc_url, [same]).image_embeds, answers[0])


def test_a_small_budget_holds_under_a_flood_of_distinct_images():
    budget = 120 << 10  # a few of the demo model's row blocks (1 KiB per token)
    srv = deployment_server(Deployment(device="cpu", cache_bytes=budget), "cache-budget")
    with srv:
        for i in range(24):
            _ask(srv.grpc_url, [encode(photo_like(160 + 4 * i, 120, seed=100 + i), "PNG")])
        held = eventually(lambda: metric_sum(srv, "kimi_vision_cache_bytes", model="moonvit3d"), lambda v: v > 0)
        assert 0 < held <= budget
        assert eventually(lambda: metric_sum(srv, "kimi_vision_cache_evictions_total", model="moonvit3d"),
                          lambda v: v > 0) > 0
    off = deployment_server(Deployment(device="cpu", cache_bytes=0), "cache-off")
    with off:
        blob = [encode(photo_like(150, 100, seed=7), "PNG")]
        a, b = _ask(off.grpc_url, blob), _ask(off.grpc_url, blob)
        np.testing.assert_array_equal(a.image_embeds, b.image_embeds)
        assert metric_sum(off, "kimi_vision_cache_hits_total") == 0


def test_hits_answer_every_output_subset_and_shared_memory_path_like_the_first_answer(server):
    from contract import EXPANDED_IDS, IMAGE_EMBEDS, IMAGE_TOKEN_COUNTS

    blobs = [encode(photo_like(210, 150, seed=71), "PNG"), encode(photo_like(90, 300, seed=72), "JPEG", quality=80)]
    ids = chat_prompt_ids(2)
    client = KimiVisionClient(server.grpc_url, model="kimi_k25_vision")  # subsets through the ensemble too
    try:
        first = client.infer(ids, blobs)
        for outputs in ([IMAGE_EMBEDS], [EXPANDED_IDS, IMAGE_TOKEN_COUNTS], [IMAGE_TOKEN_COUNTS, IMAGE_EMBEDS]):
            got = client.infer(ids, blobs, outputs=outputs)
            if IMAGE_EMBEDS in outputs:
                np.testing.assert_array_equal(got.image_embeds, first.image_embeds)
            if EXPANDED_IDS in outputs:
                assert got.expanded_ids.tolist() == first.expanded_ids.tolist()
            assert got.token_counts is None or got.token_counts.tolist() == first.token_counts.tolist()
        shm = client.infer(ids, blobs, shm="system")
        np.testing.assert_array_equal(shm.image_embeds, first.image_embeds)
        assert shm.token_counts.tolist() == first.token_counts.tolist()
    finally:
        client.close()


def test_a_refused_request_leaves_nothing_in_the_cache(server):
    held = settled(lambda: metric_sum(server, "kimi_vision_cache_bytes", model="moonvit3d"))
    misses = settled(lambda: _cache(server)[1])
    client = KimiVisionClient(server.grpc_url)
    try:
        for bad in ([b"\xff\xd8 not a jpeg"], [encode(photo_like(64, 64, seed=81), "PNG")] * 2):
            try:
                client.infer(chat_prompt_ids(1), bad)  # garbage; two images for one placeholder
            except Exception:  # noqa: BLE001 - refused, as it must be
                pass
            else:
                raise AssertionError("a bad request was answered")
    finally:
        client.close()
    assert settled(lambda: metric_sum(server, "kimi_vision_cache_bytes", model="moonvit3d")) == held
    assert settled(lambda: _cache(server)[1]) == misses  # never reached the encoder's lookups
