"""CUDA graph replays of the encoder equal eager forwards bit for bit, for every grid list, after
evictions of graphs and of cached tables, and with new pixel content on every call."""

import numpy as np
import pytest
import torch

from backends.config import EncoderConfig
from backends.encoder.graphs import GraphedEncoder
from backends.weights.demo import demo_model

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
    return demo_model(CFG).to(DEV, torch.bfloat16)


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
    graphed = GraphedEncoder(model, max_graphs=1)
    pos_cache = model.vision_tower.patch_embed.pos_emb._resized
    old_limit = pos_cache.max_bytes
    pos_cache.max_bytes = 1  # every resized position table is dropped from the cache at once
    try:
        for seed in range(8):
            grids = GRID_LISTS[seed % 2]
            x = pixels(grids, 100 + seed)
            assert torch.equal(graphed(x, grids), model(x, grids)), (seed, grids)
        assert graphed.captures >= 2 and len(graphed.graphs) == 1
    finally:
        pos_cache.max_bytes = old_limit


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
