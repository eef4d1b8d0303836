"""A small least-recently-used cache bounded by bytes, for per-grid tables (RoPE rotations, resized
position embeddings). Real traffic has many distinct grid sizes; a count bound alone could pin
gigabytes (a 128x128-grid position table is 75 MB in fp32)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch


class TensorCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[Hashable, torch.Tensor] = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        table = self._items.get(key)
        if table is not None:
            self._items.move_to_end(key)
            return table
        table = make()
        size = table.numel() * table.element_size()
        if size <= self.max_bytes:
            while self.bytes + size > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()
            self._items[key] = table
            self.bytes += size
        return table

    def __len__(self) -> int:
        return len(self._items)
