"""The navit resize rule of the checkpoint processor (docs/kimi_k25.md#resize-rule): pure arithmetic on (W, H).

Never upscales; caps the pre-merge patch count (`in_patch_limit`, computed on floor-divided patch
counts) and each side (`patch_limit_on_one_side` patches); `int()` truncates; then zero-pads
bottom/right to a multiple of patch*merge (28 px for K2.5).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from backends.config import MediaConfig


@dataclass(frozen=True)
class ResizePlan:
    """Where one image (or one video chunk's frames) goes: resized size, padding, patch grid."""

    src_width: int
    src_height: int
    width: int  # after resize, before padding
    height: int
    pad_width: int  # zero columns added on the right
    pad_height: int  # zero rows added at the bottom
    patch_size: int
    merge: int
    frames: int = 1

    @property
    def padded_width(self) -> int:
        return self.width + self.pad_width

    @property
    def padded_height(self) -> int:
        return self.height + self.pad_height

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """(t, patch rows, patch columns) as the encoder sees it."""
        return (self.frames, self.padded_height // self.patch_size, self.padded_width // self.patch_size)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def num_tokens(self) -> int:
        """LLM tokens after the 2x2 merge; frames of a chunk are pooled, so t does not count."""
        _, h, w = self.grid_thw
        return (h // self.merge) * (w // self.merge)

    @property
    def needs_resize(self) -> bool:
        return (self.width, self.height) != (self.src_width, self.src_height)


def navit_resize(width: int, height: int, media: MediaConfig, *, patch_limit: int | None = None,
                 frames: int = 1) -> ResizePlan:
    """Plan the resize of a W x H image. `patch_limit` overrides `in_patch_limit` (video frames)."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    ps = media.patch_size
    limit = media.in_patch_limit if patch_limit is None else patch_limit
    side_px = media.patch_limit_on_one_side * ps
    s1 = math.sqrt(limit / (max(1, width // ps) * max(1, height // ps)))
    scale = min(1.0, s1, side_px / width, side_px / height)
    new_w = min(max(1, int(width * scale)), side_px)
    new_h = min(max(1, int(height * scale)), side_px)
    factor = media.pad_multiple
    return ResizePlan(
        src_width=width, src_height=height, width=new_w, height=new_h,
        pad_width=(factor - new_w % factor) % factor, pad_height=(factor - new_h % factor) % factor,
        patch_size=ps, merge=media.merge_kernel_size, frames=frames,
    )


def largest_padded_patches(media: MediaConfig, patch_limit: int | None = None) -> int:
    """The most patches `navit_resize` can give one frame: every (W, H) with each side up to twice the
    per-side limit, evaluated with the rule's own arithmetic (vectorized; IEEE doubles as math.sqrt and
    int() use). Wider or taller images are scaled by the per-side limit to the same sizes as ones within
    it. Padding to 28 px is why this exceeds the patch budget: 1x3000^2 gives 130 x 130 = 16,900 patches
    for a budget of 16,384, and the largest is 36 x 496 = 17,856 (7081 x 489 px, K2.5's config)."""
    return _largest_padded_patches(media.patch_size, media.in_patch_limit if patch_limit is None else patch_limit,
                                   media.patch_limit_on_one_side, media.pad_multiple)


@functools.lru_cache(maxsize=8)
def _largest_padded_patches(ps: int, limit: int, side_patches: int, factor: int) -> int:
    import numpy as np

    side = side_patches * ps
    w = np.arange(1, 2 * side + 1, dtype=np.float64)
    fw = np.maximum(1, w // ps)
    best = 0
    for h in range(1, 2 * side + 1):  # the rule is symmetric in W and H: H <= W suffices
        ws, fws = w[h - 1:], fw[h - 1:]
        scale = np.minimum(np.minimum(1.0, np.sqrt(limit / (fws * max(1, h // ps)))), np.minimum(side / ws, side / h))
        nw = np.minimum(np.maximum(1, np.floor(ws * scale)), side)
        nh = np.minimum(np.maximum(1, np.floor(h * scale)), side)
        best = max(best, int(((np.ceil(nw / factor) * factor) * (np.ceil(nh / factor) * factor)).max()) // (ps * ps))
    return best
