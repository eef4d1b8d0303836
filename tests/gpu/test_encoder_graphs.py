"""CUDA graph replays of the encoder equal eager forwards bit for bit, for every grid list, after
evictions of graphs and of cached tables, and with new pixel content on every call."""

import numpy as np
import pytest
import torch

from backends.config import EncoderConfig
from backends.encoder.graphs import GraphedEncoder
from backends.encoder.moonvit3d import Kernels
from backends.checkpoint.seeded import seeded_model

DEV = "cuda"
# Real width and heads (the fused RoPE and attention kernels at their real shapes), fewer layers.
CFG = EncoderConfig(num_layers=3)
GRID_LISTS = [
    [(1, 32, 32)],
    [(1, 20, 28), (1, 16, 16)],
    [(2, 12, 16)],  # a video chunk: time embedding, per-frame attention
]


@pytest.fixture(scope="module")
def model():
    return seeded_model(CFG).to(DEV, torch.bfloat16)


def pixels(grids, seed):
    n = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.rand(n, 3, 14, 14, generator=gen, device=DEV) * 2 - 1).to(torch.bfloat16)


def test_replays_equal_eager_for_each_grid_list_and_fresh_inputs(model):
    graphed = GraphedEncoder(model)
    seed = 0
    for _ in range(3):
        for grids in GRID_LISTS:
            seed += 1
            x = pixels(grids, seed)
            got = graphed(x, np.asarray(grids))
            assert torch.equal(got, model(x, grids)), grids
    assert graphed.captures == len(GRID_LISTS)  # captured on the second sighting, once
    assert graphed.replays == len(GRID_LISTS) * 2


def test_evicted_graphs_and_tables_stay_correct(model):
    """Graph evictions (max_graphs=1), and cached tables a graph read at capture that the cache later
    evicts: their memory is then handed out again and scribbled over; replays must not notice."""
    graphed = GraphedEncoder(model, max_graphs=1)
    pos = model.vision_tower.patch_embed.pos_emb
    cache = pos._resized
    one_table = pos.grid(32, 32).numel() * pos.weight.element_size()
    old_limit = cache.max_bytes
    cache.max_bytes = one_table  # room for one resized position table: each new grid evicts the other
    try:
        for seed in range(8):
            grids = GRID_LISTS[seed % 2]
            x = pixels(grids, 100 + seed)
            scribble = [torch.full((one_table // 2,), 7.0, dtype=torch.bfloat16, device=DEV) for _ in range(4)]
            assert torch.equal(graphed(x, grids), model(x, grids)), (seed, grids)
            del scribble
        assert graphed.captures >= 2 and len(graphed.graphs) == 1
    finally:
        cache.max_bytes = old_limit

    held = GraphedEncoder(model)  # both graphs kept; their tables evicted from the cache in turn
    cache.max_bytes = one_table
    try:
        for seed in range(6):
            grids = GRID_LISTS[seed % 2]
            x = pixels(grids, 200 + seed)
            assert torch.equal(held(x, grids), model(x, grids)), (seed, grids)
            scribble = [torch.full((one_table // 2,), -3.0, dtype=torch.bfloat16, device=DEV) for _ in range(4)]
            del scribble
        assert held.captures == 2 and held.replays == 4  # seen, seen, captured + replayed, then replayed
    finally:
        cache.max_bytes = old_limit


def test_large_batches_and_empty_input_run_eagerly(model):
    graphed = GraphedEncoder(model, max_patches=500)
    grids = [(1, 32, 32)]
    x = pixels(grids, 7)
    for _ in range(3):
        assert torch.equal(graphed(x, grids), model(x, grids))
    assert graphed.captures == 0
    empty = graphed(x[:0], np.zeros((0, 3), np.int64))
    assert empty.shape == (0, CFG.text_hidden_size)


def test_a_replay_does_not_sync_the_device(model):
    graphed = GraphedEncoder(model)
    grids = GRID_LISTS[1]
    x = pixels(grids, 3)
    graphed(x, grids)
    graphed(x, grids)  # captured
    torch.cuda.set_sync_debug_mode("error")
    try:
        graphed(x, grids)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_captures_beyond_the_graph_bound_keep_allocated_memory_flat(model, monkeypatch):
    """Memory the encoder keeps beyond what its caches report (EncoderStep.cached_bytes) must not grow
    with captures: each capture once warmed up on a new stream, and torch keeps a cuBLAS workspace
    per stream, so allocated memory grew ~32 MiB per capture up to torch's 32 pooled streams."""
    from backends.serving.steps import EncoderStep

    step = EncoderStep(model, cuda_graphs=2)
    graphed = step.forward
    made = []

    class CountingStream(torch.cuda.Stream):
        def __new__(cls, *args, **kwargs):
            # torch.cuda.current_stream() also builds a Stream object, around an existing stream id:
            # only a call without one makes a new stream (torch's Stream.__new__ tells them apart so)
            if "stream_id" not in kwargs:
                made.append(1)
            return super().__new__(cls, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Stream", CountingStream)

    def uncached():
        torch.cuda.synchronize()
        step.run_batch([])  # the count is refreshed after a batch
        return torch.cuda.memory_allocated() - step.cached_bytes()

    sizes = [(1, 2 * (4 + k), 8) for k in range(12)]
    for k, grids in enumerate(sizes[:2]):  # the first captures: the warm-up stream's one workspace
        for _ in range(2):
            graphed(pixels([grids], k), [grids])
    base = uncached()
    made.clear()
    for k, grids in enumerate(sizes[2:]):  # ten more captures, each evicting an older graph
        for _ in range(2):
            graphed(pixels([grids], 50 + k), [grids])
    assert graphed.captures == len(sizes) and len(graphed.graphs) == 2
    assert made == []  # no new stream (and so no new cuBLAS workspace) for the later captures
    assert uncached() - base < 16 << 20, (base, uncached())


def _bucket_backend():
    """Bucketed graphs are built for flash-attn-4 (serving uses them only with it); torch's varlen, the
    other single-launch kernel, invalidated a capture on an H100 (torch 2.11) and is not used for them."""
    from backends.encoder.attention import available_backends

    if "fa4" not in available_backends(torch.device(DEV), torch.bfloat16):
        pytest.skip("flash-attn-4 is not installed (bash lab/gpu.sh fa4, carrying .whl/fa4)")
    return "fa4"


BUCKET_CASES = [
    [(1, 32, 32)],  # 1,024 patches: a bucket's exact size, no padding rows
    [(1, 16, 16)],  # the smallest bucket exactly: every padding sequence empty
    [(1, 20, 28), (1, 16, 16)],  # 816 in the 832 bucket: 16 padding rows
    [(2, 12, 16)],  # a video chunk
    [(1, 58, 50)],  # 2,900 in a larger bucket
    [(1, 8, 8)] * 12 + [(1, 30, 42)],  # many media
]
# Under 128 rows cuBLAS picks other GEMM kernels than for the same rows inside a larger batch (measured
# on an H100: fc2, K=4304, differs for m <= 64), so a media this small, alone, is compared with its rows
# in an eager batch of a bucket's size (docs/encoder.md#cuda-graphs).
TINY = [(1, 2, 2)]  # 4 patches in the 256 bucket


def test_bucketed_replays_equal_eager_for_sizes_never_seen(model):
    """Every bucket captured up front; each grid list, seen for the first time, replays its bucket's graph
    (padded) and gives the eager forward's bits with the same attention backend."""
    backend = _bucket_backend()
    graphed = GraphedEncoder(model, max_patches=4096, bucket_backend=backend)
    line = graphed.capture_buckets()
    assert not graphed.buckets.failed, graphed.buckets.failed
    for seed, grids in enumerate(BUCKET_CASES * 2):  # twice: stale rows from a larger batch in the padding
        x = pixels(grids, 300 + seed)
        got = graphed(x, np.asarray(grids))
        want = model(x, grids, attn_backend=backend)
        assert torch.equal(got, want), grids
    assert graphed.buckets.replays == 2 * len(BUCKET_CASES)
    assert graphed.replays == 0 and not graphed.graphs  # no per-grid-list graph, no eager first sighting


def test_a_tiny_media_gets_the_rows_it_has_in_a_bucket_sized_batch(model):
    """4 patches replay in the 256-patch bucket: the tower's rows are those of an eager batch of 256 rows
    (the tiny media first, a filler after it), and the merge and projector run on its rows alone in both."""
    backend = _bucket_backend()
    graphed = GraphedEncoder(model, max_patches=1024, bucket_backend=backend)
    graphed.capture_buckets()
    filler = [(1, 14, 18)]  # 252 patches: 256 rows in all
    x, pad = pixels(TINY, 41), pixels(filler, 42)
    got = graphed(x, TINY)
    assert graphed.buckets.replays == 1
    with torch.inference_mode():
        grids = TINY + filler
        meta = model.metadata(grids)
        kernels = Kernels(meta.rope, model.device, model.dtype)
        tower = model.vision_tower(torch.cat([x, pad]), meta, kernels, attn_backend=backend)
        n = x.shape[0]
        host = type(meta)(grids=TINY, seq_lens=[n], max_seqlen=n, cu_seqlens=meta.cu_seqlens, rope=meta.rope)
        want = model.merge_and_project(tower[:n], host)
    assert torch.equal(got, want)


def test_batches_buckets_cannot_take_go_the_per_grid_list_way(model):
    from backends.encoder.graphs import MAX_MEDIA

    backend = _bucket_backend()
    graphed = GraphedEncoder(model, max_patches=2048, bucket_backend=backend)
    graphed.capture_buckets()
    many = [(1, 2, 2)] * (MAX_MEDIA + 1)  # more media than a bucket's cu_seqlens holds
    large = [(1, 48, 48)]  # beyond the largest bucket
    for grids in (many, large):
        x = pixels(grids, 9)
        for _ in range(3):
            assert torch.equal(graphed(x, grids), model(x, grids))
    assert graphed.buckets.replays == 0


def test_a_bucketed_replay_does_not_sync_the_device(model):
    graphed = GraphedEncoder(model, max_patches=1024, bucket_backend=_bucket_backend())
    graphed.capture_buckets()
    grids = GRID_LISTS[1]
    x = pixels(grids, 4)
    graphed(x, grids)  # the per-grid tables made once (a table's first upload is not the replay's)
    torch.cuda.set_sync_debug_mode("error")
    try:
        graphed(x, grids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
