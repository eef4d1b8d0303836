"""Decode encoded images exactly as the checkpoint processor does: `Image.open(...).convert("RGB")`.

No EXIF transpose, alpha dropped without compositing, palette/L/CMYK/16-bit converted by Pillow's own
`convert("RGB")` (docs/kimi_k25.md#decode-and-mode-conversion). An image is opened once (`open_image`
reads the header: size and format, no pixels) and decoded later from the same handle (`decode_rgb`).
Every failure is a RequestError naming the image's index, and a size limit names the image's own
value next to the limit.
"""

from __future__ import annotations

import io
import threading
import warnings

from PIL import Image

from backends.errors import RequestError

# Pillow's bomb guard and warning filters are process-wide, and images are opened on several threads
# (Preprocessor), possibly for Preprocessors with different limits: set and use them under a lock.
# Image.open reads only the header, so the lock is held briefly; decoding runs outside it.
_BOMB_GUARD = threading.Lock()


def _pixel_error(index: int, size: tuple[int, int], max_pixels: int) -> RequestError:
    w, h = size
    return RequestError(f"image {index}: {w}x{h} = {w * h} pixels exceeds the limit max_image_pixels={max_pixels}",
                        "pixel_limit")


def open_image(data: bytes, index: int, max_pixels: int) -> Image.Image:
    """The image's handle after reading its header. Pillow's own bomb guard stays on, set to our limit,
    so that a bomb is refused from its header, before any pixel is decoded."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
        raise RequestError(f"image {index}: empty or missing image bytes", "undecodable_image")
    with _BOMB_GUARD:
        previous = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = max_pixels
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(bytes(data)))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            # Read the header once more with the guard off, only to name the image's own size.
            Image.MAX_IMAGE_PIXELS = None
            raise _pixel_error(index, Image.open(io.BytesIO(bytes(data))).size, max_pixels) from None
        except Exception as exc:  # Pillow raises many types for garbage input
            raise RequestError(f"image {index}: not a decodable image ({type(exc).__name__}: {exc})",
                               "undecodable_image") from None
        finally:
            Image.MAX_IMAGE_PIXELS = previous
    if img.size[0] * img.size[1] > max_pixels:
        raise _pixel_error(index, img.size, max_pixels)
    return img


def decode_rgb(img: Image.Image, index: int) -> Image.Image:
    """Fully decode an opened image to RGB (the first frame of an animation). Thread-safe per image:
    Pillow releases the GIL while it decodes."""
    try:
        img.load()
        return img.convert("RGB")
    except Exception as exc:
        raise RequestError(f"image {index}: decoding failed ({type(exc).__name__}: {exc})",
                           "undecodable_image") from None
