"""Several same-shaped tensors that lie at one fixed distance from each other inside one storage, seen as
one batch without a copy: the frames the GPU decode's colour kernel writes (one tensor per run) are such
tensors, and a run of them goes through one kernel launch. (The decoder's own planes are laid out by
offsets, nvjpeg.DecodedPlanes.)"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def spacing(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """How many elements after `a` the view `b` starts, if both are views of one storage with the same
    shape, strides, dtype and device; else None (two allocations that merely touch are not one)."""
    if (a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype or a.device != b.device
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()):
        return None
    return b.storage_offset() - a.storage_offset()


def stacked(views: Sequence[torch.Tensor], step: int) -> torch.Tensor:
    """(n, *shape) view of `views`, which must each start `step` elements after the one before
    (spacing() says so); no copy."""
    first = views[0]
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), first.storage_offset())
