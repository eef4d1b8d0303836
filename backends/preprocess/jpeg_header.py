"""A plain baseline JPEG's header, read without Pillow: what `Image.open` would report, for less time.

Why: a request's images are opened before anything else (size for the plan, the fields that route a
JPEG to the GPU), and Pillow's JPEG header parse is Python that reads a byte or two per call. For eight
448^2 photos it took 0.465 ms on the GPU machine, this walk over the same bytes 0.117 ms, of a
preprocessing that takes about 2 ms there (docs/findings.md#jpeg-headers-without-pillow).

The promise this module keeps: when `read` returns a header, Pillow's `Image.open` of the same bytes
succeeds and reports the same format, size, mode, bit depth, layers and the `info` fields the GPU route
reads (tests/unit/test_jpeg_header.py holds it to that across a corpus and damaged headers). So `read`
answers None, and the caller opens the file with Pillow as before, for anything it does not take in
full: not a JPEG, a marker other than the common ones (APPn, COM, DQT, DHT, DRI, one SOF0/SOF1, then
SOS), fill bytes or junk between segments, a segment running past the end, or a segment whose parse in
Pillow could raise (a short JFIF, Adobe or ICC segment, a bad quantization table) or do more work
(EXIF read for its resolution when JFIF gives none, an MPF index that may make it an MPO, a Photoshop
block). Progressive, lossless, CMYK and other bit depths are left to Pillow too: they go to Pillow's
decoder anyway, so its header parse costs nothing extra there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_SOF = (0xC0, 0xC1)  # baseline and extended sequential Huffman: what the GPU route takes
_SKIPPED = (0xC4, 0xDD, 0xFE)  # DHT, DRI, COM: Pillow reads past them (COM stored)


@dataclass(frozen=True)
class JpegHeader:
    """The part of Pillow's JpegImageFile the preprocessing reads, under the same names."""

    size: tuple[int, int]
    mode: str  # "L" or "RGB"
    layer: tuple[tuple[int, int, int, int], ...]  # (component id, h, v, quantization table), Pillow's order
    info: dict = field(default_factory=dict, compare=False)  # jfif, adobe, adobe_transform where present
    bits: int = 8
    format: str = "JPEG"

    @property
    def width(self) -> int:
        return self.size[0]

    @property
    def height(self) -> int:
        return self.size[1]


def _u16(b, p: int) -> int:
    return (b[p] << 8) | b[p + 1]


def _app(marker: int, b, start: int, end: int, state: dict) -> bool:
    """One APPn segment's payload b[start:end], as Pillow's APP handler reads it; False where Pillow
    could raise or would do more than store it."""
    n = end - start
    if marker == 0xE0 and b[start:start + 4] == b"JFIF":
        if n < 7:
            return False  # Pillow's version read needs 7 bytes
        state["jfif"] = _u16(b, start + 5)
        if n >= 12 and b[start + 7] in (1, 2):
            state["dpi"] = True  # Pillow then skips reading the EXIF block for a resolution
    elif marker == 0xE1 and b[start:start + 6] == b"Exif\0\0":
        state["exif"] = True
    elif marker == 0xE2 and b[start:start + 12] == b"ICC_PROFILE\0":
        if n < 14:
            return False  # Pillow indexes the chunk's sequence bytes
    elif marker == 0xE2 and b[start:start + 4] == b"MPF\0":
        return False  # a multi-picture index: Pillow may open it as an MPO
    elif marker == 0xED and b[start:start + 14] == b"Photoshop 3.0\0":
        return False  # parsed block by block in Pillow
    elif marker == 0xEE and b[start:start + 5] == b"Adobe":
        if n < 12:
            return False  # Pillow reads the version (7 bytes) and, if present, the transform: keep it simple
        state["adobe"] = _u16(b, start + 5)
        state["adobe_transform"] = b[start + 11]
    return True


def _dqt_ok(b, start: int, end: int) -> bool:
    """Every table of a DQT segment complete, as Pillow checks them."""
    p = start
    while p < end:
        length = 1 + (64 if b[p] >> 4 == 0 else 128)
        if end - p < length:
            return False
        p += length
    return True


def read(data) -> JpegHeader | None:
    """The header of a plain baseline 8-bit grayscale or three-component JPEG, or None (then ask
    Pillow: see the module's docstring for what this leaves to it)."""
    b = data
    n = len(b)
    if n < 4 or b[0] != 0xFF or b[1] != 0xD8 or b[2] != 0xFF:
        return None
    p, state, sof = 2, {}, None
    while True:
        if p + 4 > n or b[p] != 0xFF:
            return None
        marker, length = b[p + 1], _u16(b, p + 2)
        start, end = p + 4, p + 2 + length
        if length < 2 or end > n:
            return None
        if marker == 0xDA:  # start of scan: Pillow stops here
            break
        if 0xE0 <= marker <= 0xEF:
            if not _app(marker, b, start, end, state):
                return None
        elif marker == 0xDB:
            if not _dqt_ok(b, start, end):
                return None
        elif marker in _SOF:
            if sof is not None:
                return None  # a second frame header: Pillow would append its layers
            sof = (start, end)
        elif marker not in _SKIPPED:
            return None
        p = end
    if sof is None:
        return None
    start, end = sof
    if end - start < 6 or b[start] != 8:
        return None
    height, width, layers = _u16(b, start + 1), _u16(b, start + 3), b[start + 5]
    if layers not in (1, 3) or end - start != 6 + 3 * layers or width == 0 or height == 0:
        return None
    if "exif" in state and "dpi" not in state:
        return None  # Pillow reads the EXIF block for a resolution, and may raise there
    layer = tuple((b[q], b[q + 1] >> 4, b[q + 1] & 15, b[q + 2]) for q in range(start + 6, end, 3))
    info = {k: state[k] for k in ("jfif", "adobe", "adobe_transform") if k in state}
    return JpegHeader(size=(width, height), mode="L" if layers == 1 else "RGB", layer=layer, info=info)
