"""CUDA graphs for the encoder forward, per exact list of grids.

A forward is ~560 kernel launches (27 layers of norms, GEMMs, RoPE, attention, GELU, residuals); for
one 1024^2 image the host needed about as long to launch them as the GPU needed to run them
(docs/encoder.md#cuda-graphs). Replaying a captured graph removes
the host cost. Shapes are fixed inside a graph, so graphs are keyed by the exact grid list: a list
seen for the second time is captured (one-off sizes never pay for a capture), up to `max_graphs`
graphs, least recently used first out, and only for batches up to `max_patches` patches (larger ones
are GPU-bound, and their activations would make each graph's memory large). All graphs share one
memory pool; they never run concurrently (one forward at a time per model instance).

Correctness rests on the forward doing no host work that depends on device values (it never syncs:
tests/gpu check it under set_sync_debug_mode("error")), on metadata being built outside the capture,
on per-grid caches refusing to keep tables made during a capture, and on each graph holding every
table it reads (TensorCache, hold_tables_for_graph), so an eviction cannot free memory a graph uses.

Bucketed graphs (where the attention backend is one varlen launch: flash-attn-4, or torch's varlen when
asked): one graph per patch-count bucket, all captured at start-up (`capture_buckets`), so that a size
never seen before replays at once instead of running eagerly, twice, and then paying a capture
(docs/encoder.md#cuda-graphs). A batch of L patches runs in the smallest bucket B >= L: its patches,
position embeddings and RoPE rotations are copied into the first L rows of static buffers shared by all
buckets, the B - L rows after them are padding split into short sequences of their own (so no real
patch attends to them, and attention over them costs next to nothing), and `cu_seqlens` lists the real
media, then the padding pieces, then empty sequences up to its fixed length. Every other op of the tower
works row by row (GEMMs, norms, GELU, RoPE), so the real rows come out as they would unpadded: the GPU
tests hold replays to the eager forward bit for bit (tests/gpu/test_encoder_graphs.py), which relies on
cuBLAS giving a row the same bits whatever the batch's row count from 128 rows up (measured:
lab/bench/batch_dependence.py; under 128 rows it picks other kernels, docs/encoder.md#cuda-graphs).
The merge and projector run eagerly on the real rows after the replay.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from backends.encoder.cache import hold_tables_for_graph
from backends.encoder.metadata import ForwardMetadata, as_grid_list, check_pixels, rope_parts
from backends.errors import first_line

log = logging.getLogger(__name__)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor  # the static input the graph reads
    out: torch.Tensor  # the static output it writes
    # Everything else the graph reads by address must outlive it: the metadata's device tensors
    # (cu_seqlens, RoPE table) and the cached tables the forward used (position embeddings).
    meta: ForwardMetadata
    tables: list[torch.Tensor]


# Padding rows run as PAD_SEQS sequences of their own (split evenly), so each is short: attention over
# them costs next to nothing. MAX_MEDIA media per bucketed forward; more go the per-grid-list way.
PAD_SEQS = 16
MAX_MEDIA = 32
# Start-up time the captures may take (an upper bound, not an estimate; the start-up log says what they
# took). Sizes beyond it run in the next larger captured bucket.
CAPTURE_BUDGET_S = 60.0


def bucket_sizes(max_patches: int, smallest: int = 256, ratio: float = 1.0625, granule: int = 64) -> list[int]:
    """Patch counts of the buckets: `smallest`, then each about `ratio` times the last (a multiple of
    `granule`), ending at `max_patches`. At 1.0625 a large batch pads at most 1/17 of its rows (about 3%
    on average; one 1024^2 image, 5,476 patches, runs in 5,632); 21,408 patches (the largest media,
    resize_rule.largest_padded_patches) take 57 buckets."""
    sizes, b = [], smallest
    while b < max_patches:
        sizes.append(b)
        b = max(b + granule, -(-int(b * ratio) // granule) * granule)
    return sizes + [max_patches]


def padded_cu_seqlens(seq_lens: list[int], bucket: int, num_seqs: int) -> np.ndarray:
    """(num_seqs + 1,) int32: the media's boundaries, then the padding rows up to `bucket` split evenly into
    the sequences left (empty ones where there are fewer rows than sequences)."""
    cu = np.empty(num_seqs + 1, dtype=np.int32)
    m = len(seq_lens)
    cu[0] = 0
    cu[1:m + 1] = np.cumsum(seq_lens)
    real, left = int(cu[m]), num_seqs - m
    cu[m + 1:] = real + (np.arange(1, left + 1) * (bucket - real)) // left
    return cu


def capture_order(sizes: list[int]) -> list[int]:
    """The order buckets are captured in: the largest first (its activations size the shared pool once),
    then coarse to fine (every 8th, every 4th, every 2nd, the rest), each pass largest first. A start-up
    budget that runs out leaves every batch a captured bucket above it, padded at most a few buckets
    further, instead of leaving the small sizes none."""
    desc = sorted(sizes, reverse=True)
    order, seen = [], set()
    for stride in (len(desc), 8, 4, 2, 1):
        for size in desc[::stride]:
            if size not in seen:
                seen.add(size)
                order.append(size)
    return order


@dataclass
class _Bucket:
    graph: torch.cuda.CUDAGraph
    meta: ForwardMetadata  # what the graph reads: the shared cu_seqlens and RoPE rows, max_seqlen = its size


class BucketedGraphs:
    """One CUDA graph of the tower (patch embedding to the final layer norm) per patch-count bucket, over
    static buffers shared by all buckets; see the module's docstring."""

    def __init__(self, model, backend: str, max_patches: int = 16384):
        self.model = model
        self.backend = backend
        self.sizes = bucket_sizes(max_patches)
        self.num_seqs = MAX_MEDIA + PAD_SEQS
        self.buckets: dict[int, _Bucket] = {}
        self.failed: dict[int, str] = {}  # bucket size -> why its capture failed (batches go to the next one)
        self.skipped: list[int] = []  # buckets the start-up budget left uncaptured
        self.replays = 0
        self.capture_s = 0.0
        self.pixels = self.pos = self.rope = self.out = self.cu_seqlens = None  # made at the first capture

    def _static_buffers(self) -> None:
        cfg, dev, dtype, top = self.model.cfg, self.model.device, self.model.dtype, max(self.sizes)
        p = cfg.patch_size
        # Finite content from the start: padding rows read whatever the last batch left there.
        self.pixels = torch.zeros((top, 3, p, p), dtype=dtype, device=dev)
        self.pos = torch.zeros((top, cfg.hidden_size), dtype=dtype, device=dev)
        self.rope = torch.ones((top, cfg.head_dim // 2), dtype=torch.complex64, device=dev)
        self.out = torch.empty((top, cfg.hidden_size), dtype=dtype, device=dev)
        self.cu_seqlens = torch.zeros(self.num_seqs + 1, dtype=torch.int32, device=dev)

    def bucket_for(self, grids: list[tuple[int, int, int]], patches: int) -> int | None:
        if not (0 < patches <= self.sizes[-1]) or len(grids) > MAX_MEDIA:
            return None
        for size in self.sizes[bisect.bisect_left(self.sizes, patches):]:
            if size in self.buckets:
                return size
        return None

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.pixels, self.pos, self.rope, self.out, self.cu_seqlens] if self.buckets else []

    @torch.inference_mode()
    def capture_all(self, pool, side: torch.cuda.Stream, capture_stream: torch.cuda.Stream,
                    budget_s: float = float("inf")) -> int:
        """Captures the buckets not captured yet in capture_order, until `budget_s` seconds have gone (the
        sizes left run in the next larger captured bucket); returns how many."""
        from backends.encoder.moonvit3d import Kernels

        t0, done = time.monotonic(), 0
        model, dev = self.model, self.model.device
        if self.pixels is None:
            self._static_buffers()
        for size in capture_order(self.sizes):
            if size in self.buckets or size in self.failed:
                continue
            if time.monotonic() - t0 > budget_s:
                self.skipped = [s for s in self.sizes if s not in self.buckets and s not in self.failed]
                log.warning("CUDA graph capture stopped at its start-up budget of %.0f s: %d buckets left uncaptured "
                            "(their batches run in the next larger bucket)", budget_s, len(self.skipped))
                break
            self.cu_seqlens.copy_(torch.from_numpy(padded_cu_seqlens([], size, self.num_seqs)))
            meta = ForwardMetadata(grids=[], seq_lens=[], max_seqlen=size, cu_seqlens=self.cu_seqlens,
                                   rope=self.rope[:size])
            tower = model.vision_tower

            def run():
                kernels = Kernels(meta.rope, dev, model.dtype)
                x = tower.patch_embed.project(self.pixels[:size]) + self.pos[:size]
                self.out[:size].copy_(tower.layers(x, meta, kernels, self.backend))

            graph = torch.cuda.CUDAGraph()
            try:
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):  # warm-up: kernels compiled, workspaces made, outside the capture
                    run()
                torch.cuda.current_stream(dev).wait_stream(side)
                with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
                    run()
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory; that bucket's batches run in the next larger one
                self.failed[size] = f"{type(exc).__name__}: {first_line(exc)}"
                log.warning("CUDA graph capture of the %d-patch bucket failed (%s); its batches run in the next "
                            "larger bucket", size, self.failed[size])
                continue
            self.buckets[size] = _Bucket(graph, meta)
            done += 1
        torch.cuda.synchronize(dev)
        self.capture_s += time.monotonic() - t0
        return done

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]], size: int) -> torch.Tensor:
        bucket = self.buckets[size]
        model, cfg, dev = self.model, self.model.cfg, self.model.device
        seq_lens = [t * h * w for t, h, w in grids]
        n = sum(seq_lens)
        self.pixels[:n].copy_(pixel_values)
        # Padding rows hold the last larger batch's pixels: zeroed, so that nothing a client sent (a NaN
        # sent straight to moonvit3d) can reach another request's rows through a kernel's padded tiles.
        self.pixels[n:size].zero_()
        for static, parts in ((self.pos, model.vision_tower.patch_embed.pos_emb.parts(grids, model.dtype)),
                              (self.rope, rope_parts(cfg, grids, dev))):
            if len(parts) == 1:
                static[:n].copy_(parts[0])
            else:
                torch.cat(parts, out=static[:n])
        cu = torch.from_numpy(padded_cu_seqlens(seq_lens, size, self.num_seqs)).pin_memory()
        self.cu_seqlens.copy_(cu, non_blocking=True)
        bucket.graph.replay()
        self.replays += 1
        # The merge and projector read host-side grids only: cu_seqlens and rope are not used there.
        host = ForwardMetadata(grids=list(grids), seq_lens=seq_lens, max_seqlen=max(seq_lens),
                               cu_seqlens=bucket.meta.cu_seqlens, rope=bucket.meta.rope)
        # New tensors: the next replay may overwrite self.out at once.
        return model.merge_and_project(self.out[:n], host)


class GraphedEncoder:
    """Callable like the model: (pixel_values, grid_thws) -> embeddings; eager where graphs do not apply."""

    def __init__(self, model, *, max_graphs: int = 16, max_patches: int = 16384, bucket_backend: str | None = None):
        self.model = model
        self.max_graphs = max_graphs
        self.max_patches = max_patches
        # Bucketed graphs need an attention backend that runs the packed batch in one varlen launch.
        # Where `bucket_backend` is None: flash-attn-4 if installed (docs/encoder.md#attention).
        if bucket_backend is None and model.device.type == "cuda":
            from backends.encoder.attention import available_backends

            bucket_backend = "fa4" if "fa4" in available_backends(model.device, model.dtype) else None
        self.buckets = (BucketedGraphs(model, bucket_backend, max_patches)
                        if bucket_backend and max_graphs > 0 and model.device.type == "cuda" else None)
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        # Grid lists seen before (bounded like graphs): True = capture on the next sighting without
        # a graph, False = their capture failed, stay eager.
        self.seen: OrderedDict[tuple, bool] = OrderedDict()
        self.pool = None
        self._side: torch.cuda.Stream | None = None  # the warm-up stream, made at the first capture
        self._capture_stream: torch.cuda.Stream | None = None  # the capture stream, made with it
        self.captures = 0
        self.changes = 0  # bumped whenever self.graphs gains or loses a graph (a failed capture evicts too)
        self.replays = 0

    def applies(self, num_patches: int) -> bool:
        return self.model.device.type == "cuda" and 0 < num_patches <= self.max_patches

    @torch.inference_mode()  # as the model's forward: the static input is captured as an inference tensor
    def __call__(self, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        grids = as_grid_list(grid_thws)
        check_pixels(self.model.cfg, tuple(pixel_values.shape), grids)
        if not self.applies(pixel_values.shape[0]):
            return self.model(pixel_values, grids)
        if self.buckets is not None and self.buckets.buckets:
            size = self.buckets.bucket_for(grids, pixel_values.shape[0])
            if size is not None:
                return self.buckets(pixel_values, grids, size)
        key = tuple(grids)
        captured = self.graphs.get(key)
        if captured is None:
            if key not in self.seen:
                self.seen[key] = True  # may be captured next time
                while len(self.seen) > 4 * self.max_graphs:
                    self.seen.popitem(last=False)
                return self.model(pixel_values, grids)
            if not self.seen[key]:  # its capture failed: eager, without retrying on every request
                return self.model(pixel_values, grids)
            try:
                captured = self._capture(pixel_values, grids)
            except Exception:  # noqa: BLE001 - e.g. out of memory in the graph pool; eager still works
                log.exception("CUDA graph capture failed for grids %s; running them eagerly", grids)
                self.seen[key] = False
                return self.model(pixel_values, grids)
        self.graphs.move_to_end(key)
        captured.pixels.copy_(pixel_values)
        captured.graph.replay()
        self.replays += 1
        # The static output is overwritten by the next replay: hand out a copy.
        return captured.out.clone()

    def capture_buckets(self, budget_s: float = CAPTURE_BUDGET_S) -> str:
        """Captures a graph per patch-count bucket (at start-up: no size costs a capture or an eager
        forward on a request's path), within `budget_s` seconds. Returns a line for the log."""
        if self.buckets is None:
            return "CUDA graphs per grid list seen twice (no single-launch varlen attention for buckets)"
        self._streams()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        n = self.buckets.capture_all(self.pool, self._side, self._capture_stream, budget_s)
        self.captures += n
        self.changes += n
        sizes = self.buckets.sizes
        failed = f", {len(self.buckets.failed)} failed" if self.buckets.failed else ""
        failed += f", {len(self.buckets.skipped)} left to the budget" if self.buckets.skipped else ""
        return (f"{len(self.buckets.buckets)} CUDA graphs captured{failed} ({self.buckets.backend} attention, patch "
                f"buckets {sizes[0]}..{sizes[-1]}) in {self.buckets.capture_s:.1f} s")

    def _streams(self) -> None:
        if self._side is None:
            # One warm-up stream for every capture: torch keeps a cuBLAS workspace (~32 MiB on an H200)
            # for each stream a matmul ever ran on, and a new torch.cuda.Stream() per capture cycles
            # through torch's pool of 32 streams, so allocated memory grew by a workspace per capture up
            # to ~1 GiB. Its own capture stream too (torch.cuda.graph's default is one stream for the
            # whole process): torch hands cuBLAS a workspace per (handle, stream), and a graph keeps the
            # one of the stream it was captured on, so two encoders in one process never share one.
            self._side = torch.cuda.Stream(device=self.model.device)
            self._capture_stream = torch.cuda.Stream(device=self.model.device)

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors the captured graphs keep alive: static input and output, metadata, tables.
        Bounded by max_graphs (and the buckets' shared buffers); the soak tells this from a leak
        (lab/bench/soak.py)."""
        held = self.buckets.held_tensors() if self.buckets is not None else []
        for c in self.graphs.values():
            held += [c.pixels, c.out, c.meta.cu_seqlens, c.meta.rope, *c.tables]
        return held

    def _capture(self, pixel_values: torch.Tensor, grids) -> _Captured:
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
            self.changes += 1
        model = self.model
        meta = model.metadata(grids)  # host work and its uploads happen outside the capture
        static = pixel_values.to(model.dtype).clone()
        # Warm up on a side stream (as torch.cuda.graphs recommends): caches filled, kernels compiled.
        self._streams()
        side = self._side
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):
            model(static, meta)
        torch.cuda.current_stream(model.device).wait_stream(side)
        if self.pool is None or not (self.graphs or (self.buckets is not None and self.buckets.buckets)):
            # A fresh pool once no graph holds the old one: torch releases a graph pool when its last
            # graph goes, and a capture into a released pool's id fails torch's internal assert
            # (use_count > 0; seen on the H200 with max_graphs=1, each capture evicting the last graph).
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with hold_tables_for_graph() as tables, torch.cuda.graph(graph, pool=self.pool, stream=self._capture_stream):
            out = model(static, meta)
        captured = _Captured(graph, static, out, meta, tables)
        self.graphs[tuple(grids)] = captured
        self.captures += 1
        self.changes += 1
        return captured
