"""Requests of our own at start-up, so that a server's first requests run as fast as its later ones.

The first time a process runs a path, it pays for more than the work: Triton kernels compiled (the
patchify kernel), the caching allocator's first segments, nvJPEG's first buffers, the host threads'
pools, lazy imports. A model instance pays that once per path, and without a warm-up the first
requests of every instance pay it (each preprocessing instance is its own process). `warmup_requests`
covers the paths a request can take: a photo (4:2:0 JPEG), eight same-sized photos (batched decode
and patchify), a PNG (Pillow's path), and an image beyond the per-side limit (the bicubic resize).
Sizes are kept small: the warm-up is part of start-up.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from backends.config import MediaConfig


def _picture(w: int, h: int, rng: np.random.Generator) -> Image.Image:
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 3 + y * 5) % 256, (x * 7 + 40) % 256, (y * 11 + x) % 256], -1) + rng.integers(-20, 20, (h, w, 3))
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


def _encoded(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def warmup_requests(media: MediaConfig) -> list[list[bytes]]:
    """Each item is one request's images."""
    rng = np.random.default_rng(3)
    photo = _encoded(_picture(700, 500, rng), "JPEG", quality=90)  # 4:2:0, Pillow's default
    # One side past patch_limit_on_one_side patches: the plan resizes, at a small pixel count.
    wide = _encoded(_picture(media.patch_limit_on_one_side * media.patch_size + 2 * media.patch_size, 60, rng),
                    "JPEG", quality=90)
    batch = [_encoded(_picture(448, 448, rng), "JPEG", quality=90) for _ in range(8)]
    png = _encoded(_picture(300, 200, rng), "PNG")
    return [[photo], batch, [png], [wide]]
