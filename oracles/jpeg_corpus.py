"""Generated JPEGs for the exact-decode tests and benchmark: every sampling, qualities 30-100, sizes
that are not multiples of 8 or 16, restart markers, EXIF and ICC segments, grayscale; plus files the
GPU path must leave to Pillow (progressive, CMYK)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image


DATA = Path(__file__).with_name("data")


def photo(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    base = 128 + 90 * np.sin(x / (7 + seed % 13)) * np.cos(y / 11) + rng.normal(0, 12, (h, w))
    rgb = np.stack([base, np.roll(base, 3, 0) * 0.8 + 30, 255 - base], -1)
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


def _save(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


def corpus() -> list[tuple[str, bytes]]:
    """(label, JPEG bytes); the GPU path must equal Pillow on every one it takes."""
    out = []
    sizes = [(1, 1), (3, 2), (17, 9), (67, 45), (257, 131), (641, 479), (1001, 667)]
    for w, h in sizes:
        img = photo(w, h, seed=w + h)
        for sub, name in ((0, "444"), (1, "422"), (2, "420")):
            for q in (30, 75, 90, 100):
                out.append((f"{w}x{h} {name} q{q}", _save(img, quality=q, subsampling=sub)))
        out.append((f"{w}x{h} gray q85", _save(img.convert("L"), quality=85)))
    img = photo(333, 222, seed=3)
    out.append(("333x222 420 restart rows", _save(img, quality=90, subsampling=2, restart_marker_rows=1)))
    out.append(("333x222 422 restart blocks", _save(img, quality=90, subsampling=1, restart_marker_blocks=7)))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation "rotate 90": the reference ignores it, so must we
    out.append(("333x222 420 exif", _save(img, quality=90, subsampling=2, exif=exif.tobytes())))
    out.append(("333x222 444 icc", _save(img, quality=90, subsampling=0, icc_profile=b"\0" * 128 + b"fake icc")))
    out.append(("333x222 420 optimized", _save(img, quality=90, subsampling=2, optimize=True)))
    # 4:4:0 (h1v2): Pillow cannot write it; OpenCV wrote these once (lab/tools/make_440_jpegs.py).
    for q in (50, 95):
        out.append((f"259x97 440 q{q} (OpenCV)", (DATA / f"440_259x97_q{q}.jpg").read_bytes()))
    return out


def pillow_only() -> list[tuple[str, bytes, str]]:
    """(label, bytes, expected reason) that stay on Pillow."""
    img = photo(129, 65, seed=9)
    return [("progressive", _save(img, quality=90, progressive=True), "progressive"),
            ("cmyk", _save(img.convert("CMYK"), quality=90), "color_space")]


def header_segments(blob: bytes) -> list[tuple[int, int, int]]:
    """(offset of its 0xFF, marker, length field) of each marker segment from after SOI up to and
    including SOS, walked by their lengths: what the tests edit a header with. A search for the bytes
    FF DA could stop inside a table instead."""
    out, i = [], 2
    while True:
        if blob[i] != 0xFF:
            raise ValueError(f"no marker at offset {i}")
        marker, length = blob[i + 1], int.from_bytes(blob[i + 2:i + 4], "big")
        out.append((i, marker, length))
        if marker == 0xDA:
            return out
        i += 2 + length


def sos_offset(blob: bytes) -> int:
    """Offset of the SOS marker's 0xFF."""
    return header_segments(blob)[-1][0]


def scan_start(blob: bytes) -> int:
    """Offset of the first byte of the entropy-coded data (after the SOS segment)."""
    i, _, length = header_segments(blob)[-1]
    return i + 2 + length


def damaged(blob: bytes, seed: int, count: int) -> list[tuple[str, bytes]]:
    """`count` copies of a JPEG, each damaged inside its scan (header and end marker intact): one flipped
    bit, three random bytes, or a stretch of 1-7 bytes dropped or doubled, in turn. Some damage leaves a
    well-formed scan (a stretch inside one block), most does not."""
    rng = np.random.default_rng(seed)
    start, end = scan_start(blob), len(blob) - 2
    out = []
    for trial in range(count):
        b = bytearray(blob)
        kind = trial % 3
        if kind == 0:
            k = int(rng.integers(start, end))
            b[k] ^= 1 << int(rng.integers(0, 8))
            label = f"bit flipped at {k}"
        elif kind == 1:
            ks = rng.integers(start, end, 3)
            for k in ks:
                b[k] = int(rng.integers(0, 256))
            label = f"bytes replaced at {ks.tolist()}"
        else:
            a = int(rng.integers(start, end - 8))
            z = a + int(rng.integers(1, 8))
            doubled = bool(trial % 2)
            b = b[:z] + b[a:z] + b[z:] if doubled else b[:a] + b[z:]
            label = f"bytes {a}:{z} {'doubled' if doubled else 'dropped'}"
        out.append((label, bytes(b)))
    return out
