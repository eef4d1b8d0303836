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
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from backends.encoder.cache import hold_tables_for_graph
from backends.encoder.metadata import ForwardMetadata, as_grid_list, check_pixels

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


class GraphedEncoder:
    """Callable like the model: (pixel_values, grid_thws) -> embeddings; eager where graphs do not apply."""

    def __init__(self, model, *, max_graphs: int = 16, max_patches: int = 16384):
        self.model = model
        self.max_graphs = max_graphs
        self.max_patches = max_patches
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

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors the captured graphs keep alive: static input and output, metadata, tables.
        Bounded by max_graphs; the soak tells this from a leak (lab/bench/soak.py)."""
        held = []
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
        # One stream for every capture: torch keeps a cuBLAS workspace (~32 MiB on an H200) for each
        # stream a matmul ever ran on, and a new torch.cuda.Stream() per capture cycles through torch's
        # pool of 32 streams, so allocated memory grew by a workspace per capture up to ~1 GiB.
        if self._side is None:
            self._side = torch.cuda.Stream(device=model.device)
            # Its own capture stream too (torch.cuda.graph's default is one stream for the whole process):
            # torch hands cuBLAS a workspace per (handle, stream), and a graph keeps the one of the stream
            # it was captured on, so two encoders in one process never share one.
            self._capture_stream = torch.cuda.Stream(device=model.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):
            model(static, meta)
        torch.cuda.current_stream(model.device).wait_stream(side)
        if self.pool is None or not self.graphs:
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
