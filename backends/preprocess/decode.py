"""Decode encoded images exactly as the checkpoint processor does: `Image.open(...).convert("RGB")`.

No EXIF transpose, alpha dropped without compositing, palette/L/CMYK/16-bit converted by Pillow's own
`convert("RGB")` (reference doc §1.3). Every failure is a RequestError naming the image's index.
"""

from __future__ import annotations

import io
import threading
import warnings

from PIL import Image

from backends.errors import RequestError

_PILLOW_DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS
_BOMB_GUARD = threading.Lock()


def _open(data: bytes, index: int, max_pixels: int) -> Image.Image:
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
        raise RequestError(f"image {index}: empty or missing image bytes")
    # Pillow's own bomb guard stays on, set to our limit, so that it refuses a bomb from the header
    # (before any pixel is decoded) and the error names our limit. The guard and the warnings filters
    # are process-wide and frames are decoded on several threads (pipeline.Preprocessor), possibly
    # for Preprocessors with different limits: set and use them under a lock. Image.open reads only
    # the header, so the lock is held briefly; the decode itself (decode_rgb) runs outside it.
    with _BOMB_GUARD:
        Image.MAX_IMAGE_PIXELS = max_pixels
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(bytes(data)))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise RequestError(f"image {index}: more pixels than the limit max_image_pixels={max_pixels}") from None
        except Exception as exc:  # Pillow raises many types for garbage input
            raise RequestError(f"image {index}: not a decodable image ({type(exc).__name__}: {exc})") from None
    w, h = img.size
    if w * h > max_pixels:
        raise RequestError(f"image {index}: {w}x{h} = {w * h} pixels exceeds the limit max_image_pixels={max_pixels}")
    return img


def image_size(data: bytes, index: int = 0, *, max_pixels: int = _PILLOW_DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """(width, height) from the header alone; the pixels are not decoded."""
    return _open(data, index, max_pixels).size


def decode_rgb(data: bytes, index: int = 0, *, max_pixels: int = _PILLOW_DEFAULT_MAX_PIXELS) -> Image.Image:
    """Fully decode to an RGB Pillow image (first frame for animations)."""
    img = _open(data, index, max_pixels)
    try:
        img.load()
        return img.convert("RGB")
    except Exception as exc:
        raise RequestError(f"image {index}: decoding failed ({type(exc).__name__}: {exc})") from None

