"""The encoder's embedding cache: media key -> its rows of IMAGE_EMBEDS, least recently used out, under a
byte budget. The rows live where the encoder's output does (GPU memory on a GPU deployment).

A row block is stored as the encoder computed it the first time, as a copy of its own (a view into a
batch's output would keep the whole batch alive), so a hit gives those bits again. Only rows of a
forward that succeeded are put; a failed or cancelled request never reaches `put`. A block larger than
the whole budget is not kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch


class EmbeddingCache:
    def __init__(self, budget_bytes: int, on_evict: Callable[[bytes], None] | None = None,
                 on_put: Callable[[bytes], None] | None = None):
        self.budget = max(0, int(budget_bytes))
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0
        self._on_evict, self._on_put = on_evict, on_put
        self._lock = threading.Lock()  # the metrics thread reads the counters; the request thread writes

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: bytes) -> bool:
        return key in self._rows

    def get(self, key: bytes) -> torch.Tensor | None:
        """The rows first computed for `key` (now the most recently used), or None; counted."""
        with self._lock:
            rows = self._rows.get(key)
            if rows is None:
                self.misses += 1
                return None
            self._rows.move_to_end(key)
            self.hits += 1
            return rows

    def put(self, key: bytes, rows: torch.Tensor) -> None:
        """Keep a copy of `rows` for `key`, evicting the least recently used blocks to stay in budget."""
        size = rows.numel() * rows.element_size()
        if not self.enabled or size > self.budget or key in self._rows:
            return
        evicted = []
        with self._lock:
            while self.bytes + size > self.budget and self._rows:
                old, block = self._rows.popitem(last=False)
                self.bytes -= block.numel() * block.element_size()
                self.evictions += 1
                evicted.append(old)
            self._rows[key] = rows.clone()
            self.bytes += size
        for old in evicted:
            if self._on_evict is not None:
                self._on_evict(old)
        if self._on_put is not None:
            self._on_put(key)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "bytes": self.bytes,
                    "entries": len(self._rows)}
