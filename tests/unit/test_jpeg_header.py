"""backends/preprocess/jpeg_header against its oracle, Pillow's own header parse: wherever `read` takes a
file, `Image.open` of the same bytes succeeds and reports the same fields, and the GPU route decides the
same; damaged headers (cut, bytes replaced, bytes inserted) either give Pillow's answer or go to Pillow."""

from __future__ import annotations

import functools
import io

import numpy as np
import pytest
from PIL import Image

from backends.errors import RequestError
from backends.preprocess import jpeg_header
from backends.preprocess.decode import HeaderOnly, decode_rgb, open_image
from backends.preprocess.jpeg_gpu import pillow_reason
from clients.samples import encode
from oracles.jpeg_corpus import corpus, photo, pillow_only, scan_start


_save = functools.partial(encode, fmt="JPEG")  # image -> JPEG bytes, Pillow's save options as keywords


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload


def _with_segment(blob: bytes, segment: bytes) -> bytes:
    """The JPEG with one more segment right after its SOI."""
    return blob[:2] + segment + blob[2:]


def _pillow_fields(img) -> tuple:
    info = {k: img.info[k] for k in ("jfif", "adobe", "adobe_transform") if k in img.info}
    return (img.format, img.size, img.mode, getattr(img, "bits", 8), tuple(tuple(x) for x in img.layer), info)


def _ours(h: jpeg_header.JpegHeader) -> tuple:
    return (h.format, h.size, h.mode, h.bits, h.layer, h.info)


def _pillow_open(blob: bytes):
    try:
        return Image.open(io.BytesIO(blob))
    except Exception:  # noqa: BLE001 - the oracle refuses the file
        return None


def _agrees(blob: bytes) -> bool:
    """True if read() took the file; fails the test if Pillow disagrees with what it took."""
    h = jpeg_header.read(blob)
    if h is None:
        return False
    img = _pillow_open(blob)
    assert img is not None, "read() took a file Pillow cannot open"
    assert _ours(h) == _pillow_fields(img)
    assert pillow_reason(HeaderOnly(blob, h)) == pillow_reason(img)
    return True


def _extra_files() -> list[tuple[str, bytes]]:
    img = photo(96, 64, seed=5)
    plain = _save(img, quality=90)
    adobe = bytes(b"Adobe") + bytes([0, 100, 0, 0, 0, 0, 1])
    exif = Image.Exif()
    exif[0x0112] = 3
    return [
        ("comment", _save(img, quality=90, comment=b"hello")),
        ("jfif dpi + exif", _save(img, quality=90, dpi=(300, 300), exif=exif.tobytes())),
        ("adobe ycc", _with_segment(plain, _segment(0xEE, adobe))),
        ("adobe rgb", _with_segment(plain, _segment(0xEE, adobe[:11] + b"\0"))),
        ("xmp", _with_segment(plain, _segment(0xE1, b"http://ns.adobe.com/xap/1.0/\0<x/>"))),
        ("other app", _with_segment(plain, _segment(0xE7, b"anything"))),
        ("dri", _save(img, quality=90, restart_marker_blocks=3)),
    ]


FILES = corpus() + [(label, blob) for label, blob, _ in pillow_only()] + _extra_files()


@pytest.mark.parametrize("label,blob", FILES, ids=[label for label, _ in FILES])
def test_files_agree_with_pillow(label, blob):
    _agrees(blob)


def test_the_common_files_are_taken():
    """The point of the module: plain baseline files, with JFIF, EXIF beside a JFIF resolution, ICC,
    restart markers, grayscale, never see Pillow's parse."""
    taken = {label for label, blob in FILES if _agrees(blob)}
    for label in ("67x45 420 q90", "1001x667 444 q100", "17x9 gray q85", "333x222 420 restart rows",
                  "333x222 444 icc", "comment", "jfif dpi + exif", "adobe ycc", "adobe rgb", "xmp", "dri",
                  "259x97 440 q50 (OpenCV)"):
        assert label in taken, label
    for label in ("progressive", "cmyk", "333x222 420 exif"):  # EXIF without a JFIF resolution: Pillow reads it
        assert label not in taken, label


@pytest.mark.parametrize("payload,why", [
    (_segment(0xE0, b"JFIF\0"), "JFIF too short for Pillow's version read"),
    (_segment(0xEE, b"Adobe\0"), "Adobe too short"),
    (_segment(0xE2, b"ICC_PROFILE\0\1"), "ICC chunk without its count"),
    (_segment(0xE2, b"MPF\0" + bytes(16)), "multi-picture index"),
    (_segment(0xED, b"Photoshop 3.0\0" + b"8BIM"), "Photoshop block"),
    (_segment(0xDB, bytes(30)), "short quantization table"),
    (_segment(0xC2, bytes(9)), "a second, progressive frame header"),
    (b"\xff\xff", "fill byte"),
    (b"\x00", "junk between segments"),
])
def test_headers_left_to_pillow(payload, why):
    blob = _with_segment(_save(photo(40, 24, seed=1), quality=80), payload)
    assert jpeg_header.read(blob) is None, why


def _mutants(blob: bytes, rng: np.random.Generator, count: int):
    head = scan_start(blob)
    for cut in range(0, head + 1):
        yield blob[:cut]
    for _ in range(count):
        b = bytearray(blob)
        kind = int(rng.integers(0, 3))
        k = int(rng.integers(0, head))
        if kind == 0:
            b[k] = int(rng.integers(0, 256))
        elif kind == 1:
            b[k] ^= 1 << int(rng.integers(0, 8))
        else:
            b[k:k] = bytes(rng.integers(0, 256, int(rng.integers(1, 4)), dtype=np.uint8))
        yield bytes(b)


def test_damaged_headers_agree_or_go_to_pillow():
    """Every mutant read() takes, Pillow opens with the same fields (the rest go to Pillow, whose own
    answer, an error or not, stands)."""
    rng = np.random.default_rng(11)
    img = photo(50, 30, seed=2)
    exif = Image.Exif()
    exif[0x0112] = 6
    bases = [_save(img, quality=75), _save(img.convert("L"), quality=60),
             _save(img, quality=90, dpi=(72, 72), exif=exif.tobytes(), icc_profile=b"icc" * 10, restart_marker_rows=1)]
    taken = tried = 0
    for base in bases:
        for mutant in _mutants(base, rng, 1500):
            tried += 1
            taken += _agrees(mutant)
    assert taken > 500 and taken < tried  # both outcomes happen: the comparison ran


def test_open_image_fast_and_pillow_paths_agree():
    """open_image: the same sizes, the same refusals with the same words, and the same pixels from a
    HeaderOnly handle as from Pillow's."""
    blob = _save(photo(64, 48, seed=4), quality=85)
    fast, slow = open_image(blob, 0, 10_000, fast=True), open_image(blob, 0, 10_000, fast=False)
    assert isinstance(fast, HeaderOnly) and not isinstance(slow, HeaderOnly)
    assert fast.size == slow.size
    assert np.array_equal(np.asarray(decode_rgb(fast, 0)), np.asarray(decode_rgb(slow, 0)))
    errors = []
    for fast_path in (True, False):
        with pytest.raises(RequestError) as exc:
            open_image(blob, 3, 64 * 48 - 1, fast=fast_path)
        errors.append((str(exc.value), exc.value.reason))
    assert errors[0] == errors[1] and "pixel" in errors[0][0]


def test_open_image_takes_any_memoryview():
    """A memoryview of any shape is read as its bytes, on both paths."""
    blob = _save(photo(32, 16, seed=6), quality=80)
    shaped = memoryview(np.frombuffer(blob + b"\0" * (len(blob) % 2), np.uint8).reshape(-1, 2))
    for fast_path in (True, False):
        img = open_image(shaped, 0, 10_000, fast=fast_path)
        assert img.size == (32, 16)


# The GPU route's planes from the walked header (nvjpeg.header_info) against what the current code makes
# of nvJPEG's answer (HardwareJpegDecoder.info), nvJPEG's header read restated from docs/jpeg_decoding.md.
# tests/gpu/test_jpeg_decode.py holds header_info to nvJPEG itself.

class _NvJpegRule:
    """nvjpegGetImageInfo as docs/jpeg_decoding.md#the-route-we-take states it, from Pillow's parse of the
    file (not jpeg_header's): the component count; nvJPEG's nvjpegChromaSubsampling_t for the frame's
    sampling factors; every plane at its stored size, libjpeg's ceil(W * h / Hmax) by ceil(H * v / Vmax),
    grayscale in the first plane only."""

    CODES = {(1, 1): 0, (2, 1): 1, (2, 2): 2, (1, 2): 3, (4, 1): 4, (4, 2): 5}  # Y's factors over 1x1 chroma
    GRAY = 6

    def nvjpegGetImageInfo(self, handle, data, length, n, css, widths, heights):
        img = Image.open(io.BytesIO(bytes(data[:length])))
        (w, h), factors = img.size, [tuple(layer[1:3]) for layer in img.layer]
        assert len(factors) == 1 or factors[1] == factors[2] == (1, 1), factors  # the route takes no other
        hmax, vmax = max(f[0] for f in factors), max(f[1] for f in factors)
        n._obj.value = len(factors)
        css._obj.value = self.GRAY if len(factors) == 1 else self.CODES[factors[0]]
        for c, (fh, fv) in enumerate(factors):
            widths[c], heights[c] = -(-w * fh // hmax), -(-h * fv // vmax)
        return 0


def _nvjpeg_info(blob: bytes):
    """HardwareJpegDecoder.info, the current code, over the restated nvJPEG."""
    from backends.preprocess.nvjpeg import HardwareJpegDecoder

    dec = HardwareJpegDecoder.__new__(HardwareJpegDecoder)
    dec.lib, dec.handle = _NvJpegRule(), None
    return dec.info(blob)


def test_header_info_equals_what_the_code_makes_of_nvjpegs_header_read():
    """For every file the GPU route takes from a walked header: the same sizes of every plane, the same
    sampling (nvJPEG's code) and the same number of components as HardwareJpegDecoder.info gives."""
    from backends.preprocess.jpeg_gpu import self_check_images
    from backends.preprocess.nvjpeg import header_info

    files = [blob for _, blob in FILES] + self_check_images()
    files += [_save(photo(w, h, seed=w), quality=q, subsampling=s) for w, h in ((1, 1), (2, 3), (5, 1), (1, 7), (33, 17))
              for q, s in ((90, 0), (80, 1), (70, 2))]
    files += [_save(photo(w, h, seed=h).convert("L"), quality=80) for w, h in ((1, 1), (3, 2), (33, 17))]
    compared = set()
    for blob in files:
        header = jpeg_header.read(blob)
        if header is None or pillow_reason(HeaderOnly(blob, header)) is not None:
            continue
        info = header_info(header)
        assert info is not None and info == _nvjpeg_info(blob), (header, info)
        compared.add("gray" if info.factors is None else info.factors)
    assert compared == {"gray", (1, 1), (2, 1), (2, 2), (1, 2)}  # every sampling the route takes


def test_header_info_leaves_what_it_does_not_know_to_nvjpeg():
    """A grayscale component not sampled 1x1 (the route takes it: one component is decoded alike), and
    samplings the route does not take: None (the decoder then asks nvJPEG)."""
    from backends.preprocess.nvjpeg import header_info

    for layer in (((1, 2, 2, 0),),  # grayscale, sampled 2x2
                  ((1, 4, 1, 0), (2, 1, 1, 1), (3, 1, 1, 1)),  # 4:1:1
                  ((1, 2, 2, 0), (2, 2, 2, 1), (3, 2, 2, 1)),  # 4:4:4 written with 2x2 everywhere
                  ((1, 2, 2, 0), (2, 1, 1, 1))):  # two components
        header = jpeg_header.JpegHeader(size=(33, 17), mode="L" if len(layer) == 1 else "RGB", layer=layer)
        assert header_info(header) is None, layer
