"""MoonViT3d pieces against direct re-statements of the reference (docs/kimi_k25.md#encoder), and the batching step."""

import numpy as np
import pytest
import torch

from backends.config import DEMO_CONFIG, EncoderConfig
from backends.encoder.metadata import build_metadata, rope_angles_table
from backends.encoder.moonvit3d import KimiVisionModel, tpool_patch_merge
from backends.errors import RequestError
from backends.serving.steps import EncoderRequest, EncoderStep
from backends.checkpoint.seeded import seeded_model

CFG = DEMO_CONFIG.encoder


def reference_rope_table(dim=72, max_h=512, max_w=512, theta=10000):
    """The reference's full (512, 512, dim/2) table, built the way Rope2DPosEmb builds it."""
    n = max_h * max_w
    flat = torch.arange(0, n).float()
    x_pos, y_pos = flat % max_w, flat // max_w
    dim_range = torch.arange(0, dim, 4)[: dim // 4].float()
    freqs = 1.0 / (theta ** (dim_range / dim))
    x_cis = torch.polar(torch.ones(n, dim // 4), torch.outer(x_pos, freqs).float())
    y_cis = torch.polar(torch.ones(n, dim // 4), torch.outer(y_pos, freqs).float())
    return torch.cat([x_cis.unsqueeze(-1), y_cis.unsqueeze(-1)], dim=-1).reshape(max_h, max_w, -1)


@pytest.mark.parametrize("h,w", [(1, 1), (16, 22), (74, 74), (2, 512)])
def test_rope_table_slices_equal_the_reference_bit_for_bit(h, w):
    full = reference_rope_table()
    ours = rope_angles_table(EncoderConfig(), h, w)
    assert torch.equal(ours, full[:h, :w].reshape(-1, 36))


def test_rope_rejects_grids_beyond_the_table():
    with pytest.raises(ValueError, match="exceeds the RoPE table"):
        rope_angles_table(EncoderConfig(), 513, 4)


def test_tpool_merge_matches_reference_permute_then_mean():
    grids = [(1, 4, 6), (3, 2, 4), (1, 2, 2)]
    meta = build_metadata(CFG, grids, "cpu")
    x = torch.randn(meta.num_patches, 8)
    ours = tpool_patch_merge(x, meta, (2, 2))
    ref, start = [], 0
    for t, h, w in grids:
        seg = x[start:start + t * h * w]
        start += t * h * w
        ref.append(seg.view(t, h // 2, 2, w // 2, 2, 8).permute(0, 1, 3, 2, 4, 5).mean(dim=0).reshape(-1, 4, 8))
    assert torch.equal(ours, torch.cat(ref))
    # t = 1: the merged token (0, 0) is exactly the 2x2 block of patches (0,0),(0,1),(1,0),(1,1).
    assert torch.equal(ours[0], torch.stack([x[0], x[1], x[6], x[7]]))


def test_tower_runs_on_meta_device_so_it_never_reads_the_device():
    # Any .item()/.tolist()/.cpu() on a meta tensor raises: this proves all shape metadata is host-side.
    model = KimiVisionModel(CFG).to("meta")
    grids = np.array([[1, 4, 6], [2, 8, 8], [1, 16, 22]])
    n = int(np.prod(grids, axis=1).sum())
    out = model(torch.empty(n, 3, 14, 14, device="meta"), grids)
    assert out.device.type == "meta"
    assert tuple(out.shape) == ((4 * 6 + 8 * 8 + 16 * 22) // 4, CFG.text_hidden_size)


def test_grid_thws_on_a_device_is_refused():
    with pytest.raises(ValueError, match="host"):
        build_metadata(CFG, torch.ones(1, 3, dtype=torch.int64, device="meta"), "cpu")


def _request(grids, seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(np.prod(np.asarray(grids), axis=1).sum())
    return EncoderRequest(torch.randn(n, 3, 14, 14, generator=gen), np.asarray(grids, dtype=np.int64))


def test_joint_forward_equals_separate_forwards():
    model = seeded_model(CFG)
    step = EncoderStep(model)
    reqs = [_request([[1, 4, 6], [1, 8, 8]], 0), _request([[1, 2, 2]], 1), _request([[2, 4, 4]], 2)]
    joint = step.run_batch(reqs)
    for req, got in zip(reqs, joint):
        alone = model(req.pixel_values, req.grid_thws)
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-6)


def test_a_bad_request_fails_alone():
    step = EncoderStep(seeded_model(CFG))
    good = _request([[1, 4, 6]], 0)
    mismatched = EncoderRequest(torch.zeros(5, 3, 14, 14), np.array([[1, 4, 6]]))
    odd_grid = EncoderRequest(torch.zeros(9, 3, 14, 14), np.array([[1, 3, 3]]))
    results = step.run_batch([mismatched, good, odd_grid])
    assert isinstance(results[0], RequestError) and "describes 24 patches but PIXEL_VALUES has 5" in str(results[0])
    assert isinstance(results[2], RequestError) and "merge kernel" in str(results[2])
    assert isinstance(results[1], torch.Tensor) and results[1].shape == (6, CFG.text_hidden_size)


def test_empty_request_gives_zero_rows():
    out = seeded_model(CFG)(torch.empty(0, 3, 14, 14), np.zeros((0, 3), np.int64))
    assert tuple(out.shape) == (0, CFG.text_hidden_size)


def test_table_cache_is_bounded_by_bytes_and_keeps_recent_tables():
    from backends.encoder.cache import TensorCache

    cache = TensorCache(max_bytes=3 * 400)  # room for three 100-float tables
    made = []

    def table(k):
        made.append(k)
        return torch.full((100,), float(k))

    for k in (1, 2, 3):
        cache.get(k, lambda k=k: table(k))
    cache.get(1, lambda: table(1))  # hit: 1 becomes the most recent
    cache.get(4, lambda: table(4))  # evicts 2, the least recent
    assert made == [1, 2, 3, 4] and len(cache) == 3 and cache.bytes == 1200
    cache.get(2, lambda: table(2))
    assert made[-1] == 2  # rebuilt after eviction
    big = cache.get(9, lambda: torch.zeros(1000))  # larger than the bound: returned, not kept
    assert big.numel() == 1000 and cache.bytes <= 1200


def test_tables_handed_out_during_a_capture_are_held_by_it():
    """A CUDA graph reads cached tables by address on every replay: whatever a cache hands out while a
    graph is captured goes into the graph's hold list, hits and misses alike."""
    from backends.encoder.cache import TensorCache, hold_tables_for_graph

    cache = TensorCache(max_bytes=1 << 20)
    before = cache.get("a", lambda: torch.ones(4))
    with hold_tables_for_graph() as held:
        hit = cache.get("a", lambda: torch.zeros(4))
        miss = cache.get("b", lambda: torch.zeros(4))
    cache.get("c", lambda: torch.zeros(4))  # outside: not held
    assert hit is before and len(held) == 2 and held[0] is hit and held[1] is miss


def test_graphed_encoder_runs_eagerly_off_cuda():
    from backends.encoder.graphs import GraphedEncoder

    model = seeded_model(CFG)
    graphed = GraphedEncoder(model)
    grids = np.array([[1, 4, 6]])
    x = torch.randn(24, 3, 14, 14)
    for _ in range(3):
        assert torch.equal(graphed(x, grids), model(x, grids))
    assert graphed.captures == 0 and graphed.replays == 0


def test_encoder_step_uses_graphs_only_on_cuda_when_asked():
    model = seeded_model(CFG)
    assert EncoderStep(model, cuda_graphs=8).forward is model  # CPU: eager whatever the setting


class _CudaLookingModel:
    """Claims a CUDA device so that GraphedEncoder tries graphs; computes on the CPU."""

    device = torch.device("cuda")
    dtype = torch.float32

    cfg = EncoderConfig()

    def __init__(self):
        self.calls = 0

    def __call__(self, pixel_values, grids):
        self.calls += 1
        if pixel_values.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError("pixel count does not match the grids")
        return pixel_values.flatten(1).sum(1, keepdim=True)


def test_a_failed_graph_capture_runs_eagerly_and_is_not_retried(monkeypatch):
    from backends.encoder.graphs import GraphedEncoder

    model = _CudaLookingModel()
    graphed = GraphedEncoder(model)
    attempts = []

    def failing_capture(pixel_values, grids):
        attempts.append(grids)
        raise RuntimeError("out of memory in the graph pool")

    monkeypatch.setattr(graphed, "_capture", failing_capture)
    grids = [(1, 4, 6)]
    x = torch.randn(24, 3, 14, 14)
    for _ in range(4):
        assert torch.equal(graphed(x, grids), model(x, grids))
    assert len(attempts) == 1 and graphed.replays == 0


def test_a_graphed_call_with_the_wrong_pixel_count_fails_like_the_model():
    # A graph exists for these grids; one patch must not be broadcast into its 24-patch static input.
    from types import SimpleNamespace

    from backends.encoder.graphs import GraphedEncoder, _Captured

    graphed = GraphedEncoder(_CudaLookingModel())
    grids = [(1, 4, 6)]
    graph = SimpleNamespace(replay=lambda: None)
    graphed.graphs[tuple(grids)] = _Captured(graph, torch.zeros(24, 3, 14, 14), torch.zeros(24, 1), None, [])
    with pytest.raises(ValueError, match="describes 24 patches but PIXEL_VALUES has 1"):
        graphed(torch.randn(1, 3, 14, 14), grids)
    with pytest.raises(ValueError, match=r"PIXEL_VALUES must have shape \[N, 3, 14, 14\]"):
        graphed(torch.randn(24, 1, 14, 14), grids)
    assert graphed.replays == 0


def test_held_bytes_counts_each_storage_once():
    from backends.encoder.cache import held_bytes

    table = torch.zeros(100)  # 400 bytes
    other = torch.zeros(10, dtype=torch.float64)  # 80 bytes
    # A view of a table, and a table held twice (by a cache and a graph), count once.
    assert held_bytes([table, table[10:20], table, other]) == 480
    assert held_bytes([table], device=torch.device("meta")) == 0  # only the asked device's


def test_encoder_step_reports_what_its_caches_hold(monkeypatch):
    """moonvit3d's `cached` gauge: the per-grid tables, plus what graphs keep alive, each storage once;
    counted after a batch, and only again when a capture or a new table may have changed it."""
    from types import SimpleNamespace

    import backends.serving.steps as steps
    from backends.encoder.cache import cached_tensors, held_bytes
    from backends.encoder.graphs import GraphedEncoder, _Captured

    model = seeded_model(CFG)
    step = EncoderStep(model)
    assert step.cached_bytes() == 0  # nothing counted before the first batch
    step.run_batch([EncoderRequest(torch.randn(60, 3, 14, 14), np.array([[1, 6, 10]]))])
    tables = held_bytes(cached_tensors(), device=model.device)
    assert step.cached_bytes() == tables > 0  # this grid's RoPE and position tables among them

    counts = []
    monkeypatch.setattr(steps, "held_bytes", lambda *a, **k: counts.append(1) or held_bytes(*a, **k))
    step.run_batch([EncoderRequest(torch.randn(60, 3, 14, 14), np.array([[1, 6, 10]]))])
    assert counts == []  # same grid: no new table, no capture, no recount

    graphed = GraphedEncoder(_CudaLookingModel())
    shared = next(iter(cached_tensors()))  # a table the graph read: held by the cache and the graph
    meta = SimpleNamespace(cu_seqlens=torch.zeros(2, dtype=torch.int32), rope=torch.zeros(24, 4))
    graphed.graphs[((1, 4, 6),)] = _Captured(None, torch.zeros(24, 3, 14, 14), torch.zeros(6, 8), meta, [shared])
    graphed.captures = graphed.changes = 1
    step.forward = step._graphed = graphed
    step.run_batch([])
    assert counts == [1]
    graph_bytes = (24 * 3 * 14 * 14 + 6 * 8 + 24 * 4 + 2) * 4
    assert step.cached_bytes() == tables + graph_bytes


def test_cudnn_first_is_asked_only_where_torch_can_be_asked():
    """sdpa_kernel's set_priority exists from torch 2.7; the container's torch 2.5.1 lacks it, and
    passing it there would fail every forward on the GPU."""
    from torch.nn.attention import sdpa_kernel

    from backends.encoder.attention import _priority_kwargs

    assert _priority_kwargs(sdpa_kernel) == {"set_priority": True}  # this environment's torch
    assert _priority_kwargs(lambda backends: None) == {}  # torch 2.5's signature: sdpa_kernel(backends)
