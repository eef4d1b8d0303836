"""Decode encoded images exactly as the checkpoint processor does: `Image.open(...).convert("RGB")`.

No EXIF transpose, alpha dropped without compositing, palette/L/CMYK/16-bit converted by Pillow's own
`convert("RGB")` (docs/kimi_k25.md#decode-and-mode-conversion). An image is opened once (`open_image`
reads the header: size and format, no pixels) and decoded later from the same handle (`decode_rgb`).
A plain baseline JPEG's header is read by jpeg_header.py instead of Pillow (the same fields, about a quarter of
the time): its handle, a `HeaderOnly`, opens the file with Pillow
only if Pillow is to decode it. Every failure is a RequestError naming the image's index, and a size limit names the image's own
value next to the limit.
"""

from __future__ import annotations

import io
import re
import threading
import warnings

from PIL import Image

from backends.errors import RequestError
from backends.preprocess import jpeg_header

# Pillow's bomb guard and warning filters are process-wide, and images are opened on several threads
# (Preprocessor), possibly for Preprocessors with different limits: set and use them under a lock.
# Image.open reads only the header, so the lock is held briefly; decoding runs outside it.
_BOMB_GUARD = threading.Lock()


def _pixel_error(index: int, size: tuple[int, int], max_pixels: int) -> RequestError:
    w, h = size
    return RequestError(f"image {index}: {w}x{h} = {w * h} pixels exceeds the limit max_image_pixels={max_pixels}",
                        "pixel_limit")


class HeaderOnly:
    """A plain JPEG opened by jpeg_header: the fields of Pillow's handle that the preprocessing reads
    (format, size, mode, bits, layer, info), and Pillow's handle itself only when asked (`pillow`)."""

    def __init__(self, data: bytes, header: jpeg_header.JpegHeader):
        self.data, self.header = data, header
        self.format, self.size, self.mode = header.format, header.size, header.mode
        self.bits, self.layer, self.info = header.bits, header.layer, header.info

    def pillow(self) -> Image.Image:
        """Pillow's handle on the same bytes. jpeg_header took the file, so Pillow opens it too; its size
        was checked against the limit already, so Pillow's own bomb guard is off here."""
        with _BOMB_GUARD:
            previous = Image.MAX_IMAGE_PIXELS
            Image.MAX_IMAGE_PIXELS = None
            try:
                return Image.open(io.BytesIO(bytes(self.data)))
            finally:
                Image.MAX_IMAGE_PIXELS = previous


def open_image(data: bytes, index: int, max_pixels: int, fast: bool = True) -> Image.Image | HeaderOnly:
    """The image's handle after reading its header: a bomb is refused from its header, before any pixel
    is decoded. `fast` (tests compare both ways): a plain JPEG's header is read by jpeg_header, its size
    checked here against the limit, and a HeaderOnly returned; any other image is opened by Pillow with
    its own bomb guard set to our limit."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
        raise RequestError(f"image {index}: empty or missing image bytes", "undecodable_image")
    # bytes as they come (a memoryview, which may have any shape, as a flat copy)
    flat = data if isinstance(data, (bytes, bytearray)) else bytes(data)
    header = jpeg_header.read(flat) if fast else None
    if header is not None:
        if header.width * header.height > max_pixels:
            raise _pixel_error(index, header.size, max_pixels)
        return HeaderOnly(flat, header)
    with _BOMB_GUARD:
        previous = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = max_pixels
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(flat))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            # Read the header once more with the guard off, only to name the image's own size.
            Image.MAX_IMAGE_PIXELS = None
            raise _pixel_error(index, Image.open(io.BytesIO(flat)).size, max_pixels) from None
        except Exception as exc:  # Pillow raises many types for garbage input
            # Pillow names the file object it read ("<_io.BytesIO object at 0x...>"): noise to the client.
            why = re.sub(r"\s*<[^<>]* object at 0x[0-9a-fA-F]+>", "", str(exc)).strip()
            raise RequestError(f"image {index}: not a decodable image ({type(exc).__name__}: {why})",
                               "undecodable_image") from None
        finally:
            Image.MAX_IMAGE_PIXELS = previous
    if img.size[0] * img.size[1] > max_pixels:
        raise _pixel_error(index, img.size, max_pixels)
    return img


def decode_rgb(img: Image.Image | HeaderOnly, index: int) -> Image.Image:
    """Fully decode an opened image to RGB (the first frame of an animation). Thread-safe per image:
    Pillow releases the GIL while it decodes."""
    try:
        if isinstance(img, HeaderOnly):
            img = img.pillow()
        img.load()
        return img.convert("RGB")
    except Exception as exc:
        raise RequestError(f"image {index}: decoding failed ({type(exc).__name__}: {exc})",
                           "undecodable_image") from None
