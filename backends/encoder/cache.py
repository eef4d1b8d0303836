"""A small least-recently-used cache bounded by bytes, for per-grid tables (RoPE rotations, resized
position embeddings). Real traffic has many distinct grid sizes; a count bound alone could pin
gigabytes (a 128x128-grid position table is 75 MB in fp32)."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager

import torch

# Tables handed out while a CUDA graph is captured: the graph reads them at their address on every
# replay, so the graph must hold them even after the cache evicts them (see hold_tables_for_graph).
# Per thread: a capture collects what its own forward asks for.
_local = threading.local()
# Every cache made, for cached_tensors() (weak: a cache goes when its model goes).
_CACHES: weakref.WeakSet = weakref.WeakSet()
# Bumped whenever any cache keeps a new table (evictions only happen then): lets an owner recount
# what the caches hold only when it may have changed (cache_version).
_version = 0


def _graph_holds() -> list[list[torch.Tensor]]:
    if not hasattr(_local, "holds"):
        _local.holds = []
    return _local.holds


@contextmanager
def hold_tables_for_graph():
    """Collects every table any TensorCache hands out inside the block; keep the list with the graph."""
    held: list[torch.Tensor] = []
    _graph_holds().append(held)
    try:
        yield held
    finally:
        _graph_holds().pop()


class TensorCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        _CACHES.add(self)

    def tensors(self) -> list[torch.Tensor]:
        """The tables kept now."""
        return list(self._items.values())

    def get(self, key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        table = self._items.get(key)
        if table is not None:
            self._items.move_to_end(key)
        else:
            table = self._make(key, make)
        holds = _graph_holds()
        if holds:
            holds[-1].append(table)
        return table

    def _make(self, key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        table = make()
        size = table.numel() * table.element_size()
        # A table made while a CUDA graph is being captured is not computed until the graph replays
        # (and lives in the graph's private memory): never keep it for eager callers.
        capturing = table.is_cuda and torch.cuda.is_current_stream_capturing()
        if size <= self.max_bytes and not capturing:
            _bump_version()
            while self.bytes + size > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()
            self._items[key] = table
            self.bytes += size
        return table

    def __len__(self) -> int:
        return len(self._items)


def _bump_version() -> None:
    global _version
    _version += 1


def cache_version() -> int:
    """Changes whenever some TensorCache's contents may have changed."""
    return _version


def cached_tensors() -> Iterator[torch.Tensor]:
    """The tables every TensorCache in this process keeps."""
    for cache in list(_CACHES):
        yield from cache.tensors()


def held_bytes(tensors: Iterable[torch.Tensor], device: torch.device | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (on `device`, if given): a table held by a cache
    and a graph at once, or two views of one buffer, count once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if device is not None and t.device != device:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
