"""The checkpoint processor's pixel path, restated independently with Pillow + numpy on the CPU.

`Image.open(...).convert("RGB")`, the navit resize with Pillow BICUBIC, zero padding in uint8, then
`(x/255).astype(float32) - mean` and `* 1/std` in float32, and the (t, gh, gw, C, p, p) patch order
(docs/kimi_k25.md#decode-and-mode-conversion, #normalization, #patch-layout). Our preprocessing must
equal it bit for bit.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from backends.config import MediaConfig
from backends.preprocess.resize_rule import navit_resize


def reference_pixels(blob: bytes, media: MediaConfig = MediaConfig()) -> tuple[np.ndarray, list[int]]:
    """One image -> (pixel_values (gh*gw, 3, p, p) float32, grid_thw [1, gh, gw])."""
    img = Image.open(io.BytesIO(blob)).convert("RGB")
    plan = navit_resize(img.width, img.height, media)
    if (plan.width, plan.height) != img.size:
        img = img.resize((plan.width, plan.height), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(img)
    arr = np.pad(arr, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)), mode="constant", constant_values=0)
    x = (arr / 255.0).astype(np.float32)
    x -= np.asarray(media.image_mean)
    x *= 1.0 / np.asarray(media.image_std)
    p = media.patch_size
    h, w = x.shape[:2]
    x = x[None].reshape(1, h // p, p, w // p, p, 3).transpose(0, 1, 3, 5, 2, 4).reshape(-1, 3, p, p)
    return x, [1, h // p, w // p]
