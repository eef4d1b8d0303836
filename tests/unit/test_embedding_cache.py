"""The embedding cache (backends/cache): keys that change with everything that changes the rows, a byte
budget with least-recently-used eviction, the keys published for preprocessing, and the encoder step
that serves hits, encodes misses once and assembles rows in prompt order, bit for bit as a miss."""

from pathlib import Path

import numpy as np
import pytest
import torch

from backends.cache.index import KeyTable, KeyTables, server_prefix
from backends.cache.keys import context, media_key
from backends.cache.store import EmbeddingCache
from backends.checkpoint.seeded import seeded_model
from backends.config import DEMO_CONFIG
from backends.errors import RequestError
from backends.serving.steps import EncoderRequest, EncoderStep, PreprocessStep
from clients.samples import encode, photo_like
from contract import GRID_THWS, MEDIA_CACHED, MEDIA_KEYS, PIXEL_VALUES

CTX = context("demo", DEMO_CONFIG.to_json(), "torch.float32")
A = encode(photo_like(300, 200, seed=1), "PNG")
B = encode(photo_like(120, 90, seed=2), "JPEG", quality=90)
C = encode(photo_like(64, 64, seed=3), "PNG")


def test_keys_change_with_the_bytes_the_kind_the_framing_and_the_context():
    key = media_key(CTX, [A], False)
    assert key == media_key(CTX, [bytes(A)], False) and len(key) == 32
    changed = bytearray(A)
    changed[-5] ^= 1
    assert media_key(CTX, [bytes(changed)], False) != key  # one bit of the file
    assert media_key(CTX, [A], True) != key  # the same bytes as a one-frame chunk
    assert media_key(CTX, [A, B], True) != media_key(CTX, [A + B], True)  # where the frames split
    for other in (context("/models/other", DEMO_CONFIG.to_json(), "torch.float32"),
                  context("demo", DEMO_CONFIG.to_json(), "torch.bfloat16"),
                  context("demo", DEMO_CONFIG.to_json().replace('"in_patch_limit": 16384', '"in_patch_limit": 4096'),
                          "torch.float32")):
        assert media_key(other, [A], False) != key


def test_the_least_recently_used_block_goes_first_and_the_budget_holds():
    evicted = []
    cache = EmbeddingCache(3 * 400, on_evict=evicted.append)  # three blocks of 100 float32 values
    blocks = {k: torch.full((10, 10), float(i)) for i, k in enumerate([b"a", b"b", b"c", b"d"])}
    for k in (b"a", b"b", b"c"):
        cache.put(k, blocks[k])
    assert cache.get(b"a") is not None  # a is now the most recently used: b goes first
    cache.put(b"d", blocks[b"d"])
    assert evicted == [b"b"] and b"b" not in cache and len(cache) == 3 and cache.bytes == 1200
    cache.put(b"huge", torch.zeros(1000))  # larger than the whole budget: not kept, nothing evicted
    assert b"huge" not in cache and evicted == [b"b"]
    for i in range(100):  # a flood of distinct blocks never takes it past its budget
        cache.put(bytes([i]) * 32, torch.zeros(50))
        assert cache.bytes <= cache.budget
    assert cache.counts()["evictions"] > 1 and cache.counts()["hits"] == 1


def test_a_hit_gives_the_first_rows_even_if_their_source_changes_later():
    cache = EmbeddingCache(1 << 20)
    rows = torch.arange(6.0).reshape(2, 3)
    cache.put(b"k", rows)
    rows += 100  # e.g. the batch's output buffer, reused
    assert torch.equal(cache.get(b"k"), torch.arange(6.0).reshape(2, 3))
    assert cache.get(b"missing") is None and cache.counts()["misses"] == 1
    assert not EmbeddingCache(0).enabled


def test_published_keys_are_seen_by_preprocessing_only_where_every_encoder_holds_them(tmp_path):
    clock = [0.0]
    one, two = KeyTable(tmp_path / "kimi_x_cache_moonvit3d_0_0"), KeyTable(tmp_path / "kimi_x_cache_moonvit3d_1_0")
    tables = KeyTables("kimi_x_", shm=tmp_path, clock=lambda: clock[0])
    ka, kb = media_key(CTX, [A], False), media_key(CTX, [B], False)
    one.add(ka)
    two.add(ka)
    one.add(kb)
    assert tables.held(ka) and not tables.held(kb)  # kb: the second encoder does not hold it
    two.close()  # an instance gone: its table with it
    clock[0] += 2
    assert tables.held(kb)
    one.remove(kb)
    assert not tables.held(kb) and tables.held(ka)
    one.close()
    clock[0] += 2
    assert not tables.held(ka)  # no encoder: nothing is held
    assert KeyTables("kimi_other_", shm=tmp_path).held(ka) is False


def test_the_server_prefix_comes_from_the_stubs_own_region_name(tmp_path):
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"\0".join([b"/x/triton_python_backend_stub", b"/r/m/1/model.py",
                                    b"kimi_2a1f44005528_91500143-dafd-4c27-b041-fc8229a2413f", b"1048576"]))
    assert server_prefix(cmdline) == "kimi_2a1f44005528_"
    cmdline.write_bytes(b"python\0-m\0pytest")
    assert server_prefix(cmdline) is None


@pytest.fixture(scope="module")
def model():
    return seeded_model(DEMO_CONFIG.encoder)


def _pre(held=None):
    return PreprocessStep(DEMO_CONFIG, cache_context=CTX, held=held)


def _request(out, fallback=None) -> EncoderRequest:
    return EncoderRequest(out[PIXEL_VALUES], out[GRID_THWS], keys=[k.tobytes() for k in out[MEDIA_KEYS]],
                          cached=out[MEDIA_CACHED], fallback=fallback)


def _solo(model, blobs):
    """Each media encoded on its own, no cache: the rows a miss must give."""
    step = EncoderStep(model)
    return torch.cat([step.run_batch([EncoderRequest(*PreprocessStep(DEMO_CONFIG).pre([b])[:2])])[0] for b in blobs])


def test_a_hit_equals_the_miss_bit_for_bit_and_mixed_requests_keep_prompt_order(model):
    step = EncoderStep(model, cache=EmbeddingCache(1 << 30))
    forwards = []
    step.forward = lambda pixels, grids: forwards.append(len(grids)) or model(pixels, grids)
    first = step.run_batch([_request(_pre()([A]))])[0]
    assert torch.equal(first, _solo(model, [A])) and forwards == [1]
    again = step.run_batch([_request(_pre()([A]))])[0]
    assert torch.equal(again, first) and forwards == [1]  # answered from the cache: no forward
    mixed = step.run_batch([_request(_pre()([B, A, C]))])[0]
    assert forwards == [1, 2]  # B and C encoded together, A's rows held
    # B and C as one forward of the two gives them, A's rows as first computed, in prompt order.
    joint = EncoderStep(model).run_batch([EncoderRequest(*PreprocessStep(DEMO_CONFIG).pre([B, C])[:2])])[0]
    n_b = _solo(model, [B]).shape[0]
    assert torch.equal(mixed, torch.cat([joint[:n_b], first, joint[n_b:]]))
    # A media's rows may differ in the last bits with what it was packed with (GEMMs over another
    # number of rows); docs/design.md#the-embedding-cache states how far.
    torch.testing.assert_close(mixed, _solo(model, [B, A, C]), rtol=1e-5, atol=1e-6)
    assert step.cache.counts()["hits"] == 2 and step.cache.counts()["misses"] == 3


def test_the_same_new_media_in_one_batch_is_encoded_once(model):
    step = EncoderStep(model, cache=EmbeddingCache(1 << 30))
    grids_seen = []
    step.forward = lambda pixels, grids: grids_seen.append(len(grids)) or model(pixels, grids)
    a, b = step.run_batch([_request(_pre()([A, B])), _request(_pre()([B]))])
    assert grids_seen == [2]  # A and B once, though B came twice
    n_a = _solo(model, [A]).shape[0]
    assert torch.equal(b, a[n_a:])  # the second request gets the very rows the first one's B got


def test_a_failed_forward_leaves_nothing_in_the_cache(model):
    step = EncoderStep(model, cache=EmbeddingCache(1 << 30))

    def broken(pixels, grids):
        raise RuntimeError("out of memory")

    step.forward = broken
    (result,) = step.run_batch([_request(_pre()([A]))])
    assert isinstance(result, RuntimeError) and len(step.cache) == 0
    step.forward = model
    assert torch.equal(step.run_batch([_request(_pre()([A]))])[0], _solo(model, [A]))


def test_preprocessing_leaves_held_media_undecoded_and_the_encoder_preprocesses_them_if_gone(model):
    key_a = media_key(CTX, [A], False)
    assert _pre(held=lambda key: key == key_a)([B, A])[MEDIA_CACHED].tolist() == [False, False]  # no encoder after
    out = _pre(held=lambda key: key == key_a)([B, A], encoder_follows=True)
    assert out[MEDIA_CACHED].tolist() == [False, True]
    b_patches = int(np.prod(out[GRID_THWS][0]))
    assert out[PIXEL_VALUES].shape[0] == b_patches  # A's patches left out; its grid is still there
    assert out[GRID_THWS].tolist() == _pre()([B, A])[GRID_THWS].tolist()
    step = EncoderStep(model, cache=EmbeddingCache(1 << 30))  # an encoder that does not hold A (evicted)
    with pytest.raises(RequestError, match="media 1 was sent without its patches"):
        raise step.run_batch([_request(out)])[0]
    asked = []

    def fallback(m):
        asked.append(m)
        return PreprocessStep(DEMO_CONFIG).pre([A])[0]

    rows = step.run_batch([_request(out, fallback)])[0]
    assert asked == [1]
    joint = EncoderStep(model).run_batch([EncoderRequest(*PreprocessStep(DEMO_CONFIG).pre([B, A])[:2])])[0]
    assert torch.equal(rows, joint)  # the same patches, the same forward as an uncached request


def test_a_chunk_and_an_image_of_the_same_bytes_never_share_an_entry(model):
    step = EncoderStep(model, cache=EmbeddingCache(1 << 30))
    image = step.run_batch([_request(_pre()([A]))])[0]
    chunk = step.run_batch([_request(_pre()([A], media_frames=np.array([1])))])[0]
    assert len(step.cache) == 2 and step.cache.counts()["hits"] == 0
    assert image.shape == chunk.shape  # a one-frame chunk of the same size: same rows count, its own entry


def test_without_keys_nothing_is_cached(model):
    step = EncoderStep(model, cache=EmbeddingCache(1 << 30))
    pixels, grids, _ = PreprocessStep(DEMO_CONFIG).pre([A])
    step.run_batch([EncoderRequest(pixels, grids)])
    assert len(step.cache) == 0


def test_text_only_has_no_rows(model):
    out = _pre()([])
    (rows,) = EncoderStep(model, cache=EmbeddingCache(1 << 20)).run_batch([_request(out)])
    assert rows.shape == (0, DEMO_CONFIG.encoder.text_hidden_size)


def test_the_budget_default_and_off(tmp_path):
    from backends.deploy.repository import Deployment, model_configs

    assert Deployment().cache_bytes == 1 << 30 and Deployment(device="gpu").cache_bytes == 4 << 30
    params = model_configs(Deployment(cache_bytes=0))["moonvit3d"].parameters
    assert params["cache_bytes"].string_value == "0"
    with pytest.raises(ValueError, match="cache_bytes"):
        Deployment(cache_bytes=-1)
    assert Path(tmp_path).exists()


def test_a_client_that_gave_up_costs_no_forward_but_a_whole_hit_is_answered(model):
    from backends.errors import RequestCancelled

    step = EncoderStep(model, cache=EmbeddingCache(1 << 30))
    asked = []

    def gave_up():
        asked.append(1)
        return True

    cancelled = _request(_pre()([A]))
    cancelled.cancelled = gave_up
    (result,) = step.run_batch([cancelled])
    assert isinstance(result, RequestCancelled) and len(step.cache) == 0 and asked == [1]
    step.run_batch([_request(_pre()([A]))])  # now held
    whole_hit = _request(_pre()([A]))
    whole_hit.cancelled = gave_up
    (rows,) = step.run_batch([whole_hit])
    assert isinstance(rows, torch.Tensor) and asked == [1]  # not even asked: nothing left to save


def test_a_changed_checkpoint_gives_other_keys(tmp_path):
    """Weights swapped in place, or another config: the checkpoint's identity, and so every key, changes
    (and a new server starts with an empty cache anyway)."""
    import os

    from backends.checkpoint import identity

    (tmp_path / "config.json").write_text('{"vision_config": {}}')
    shard = tmp_path / "model-00001.safetensors"
    shard.write_bytes(b"weights one")
    first = identity(str(tmp_path))
    assert identity(str(tmp_path)) == first and identity("") == "demo"
    shard.write_bytes(b"weights two, longer")  # new weights in place
    second = identity(str(tmp_path))
    os.utime(shard, ns=(0, 12345))  # same size, another time
    third = identity(str(tmp_path))
    (tmp_path / "config.json").write_text('{"vision_config": {"vt_hidden_size": 1}}')
    fourth = identity(str(tmp_path))
    assert len({first, second, third, fourth}) == 4
    keys = {media_key(context(i, DEMO_CONFIG.to_json(), "torch.bfloat16"), [A], False) for i in (first, second, third, fourth)}
    assert len(keys) == 4
