"""The checkpoint processor's pixel path, restated independently with Pillow + numpy on the CPU.

`Image.open(...).convert("RGB")`, the navit resize with Pillow BICUBIC, zero padding in uint8, then
`(x/255).astype(float32) - mean` and `* 1/std` in float32, and the (t, gh, gw, C, p, p) patch order
(docs/kimi_k25.md#decode-and-mode-conversion, #normalization, #patch-layout). Our preprocessing must
equal it bit for bit. The resize arithmetic is restated here too (docs/kimi_k25.md#resize-rule), so
that a slip in our rule is not copied into the reference that should catch it.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class ReleasedMedia:
    """The released `media_proc_cfg` (docs/kimi_k25.md#media-config). Any object with these attributes
    will do (our MediaConfig has them), so a checkpoint's own values can be passed in."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    in_patch_limit_each_frame: int = 4096
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)


def navit_size(width: int, height: int, media=ReleasedMedia(), patch_limit: int | None = None) -> tuple[int, int, int, int]:
    """`navit_resize_image` for a W x H image -> (new_w, new_h, pad_w, pad_h), pixels.

    Straight from the rule in docs/kimi_k25.md#resize-rule: the patch budget is checked on
    floor-divided patch counts, each side is capped at `patch_limit_on_one_side` patches, the scale
    never exceeds 1 and `int()` truncates; then bottom/right zeros up to a multiple of patch * merge.
    `patch_limit` replaces `in_patch_limit` (a video chunk passes `in_patch_limit_each_frame`).
    """
    p = media.patch_size
    budget = media.in_patch_limit if patch_limit is None else patch_limit
    side_cap = media.patch_limit_on_one_side * p  # 7168 px for K2.5
    patches = max(1, width // p) * max(1, height // p)
    scale = min(1.0, math.sqrt(budget / patches), side_cap / width, side_cap / height)
    new_w = min(max(1, int(width * scale)), side_cap)
    new_h = min(max(1, int(height * scale)), side_cap)
    unit = p * media.merge_kernel_size  # 28: a merged token's side, so the patch grid is even
    pad_w, pad_h = -new_w % unit, -new_h % unit
    # The checkpoint asserts this; with the side cap a multiple of `unit` it cannot fail.
    assert (new_w + pad_w) // p <= media.patch_limit_on_one_side and (new_h + pad_h) // p <= media.patch_limit_on_one_side
    return new_w, new_h, pad_w, pad_h


def reference_pixels(blob: bytes, media=ReleasedMedia()) -> tuple[np.ndarray, list[int]]:
    """One image -> (pixel_values (gh*gw, 3, p, p) float32, grid_thw [1, gh, gw])."""
    img = Image.open(io.BytesIO(blob)).convert("RGB")
    new_w, new_h, pad_w, pad_h = navit_size(img.width, img.height, media)
    if (new_w, new_h) != img.size:
        img = img.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(img)
    # Padding is uint8 zeros before normalization, so it ends at -mean/std, not at 0.
    arr = np.pad(arr, ((0, pad_h), (0, pad_w), (0, 0)), mode="constant", constant_values=0)
    x = (arr / 255.0).astype(np.float32)
    x -= np.asarray(media.image_mean)
    x *= 1.0 / np.asarray(media.image_std)
    p = media.patch_size
    h, w = x.shape[:2]
    x = x[None].reshape(1, h // p, p, w // p, p, 3).transpose(0, 1, 3, 5, 2, 4).reshape(-1, 3, p, p)
    return x, [1, h // p, w // p]
