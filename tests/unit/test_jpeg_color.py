"""The torch reference of libjpeg-turbo's chroma upsampling + YCbCr->RGB against a loop-by-loop
transcription of libjpeg-turbo's C functions (jdsample.c h2v1/h2v2/h1v2 fancy upsampling and plain
replication, jdcolor.c's fixed-point tables), on random planes of many sizes. On the GPU the same
reference meets Pillow on real JPEGs (tests/gpu/test_jpeg_decode.py)."""

import numpy as np
import pytest
import torch

from backends.kernels.jpeg_color import ycc_to_rgb_reference

SCALEBITS, ONE_HALF = 16, 1 << 15


def FIX(x):  # noqa: N802 - libjpeg's macro
    return int(x * (1 << SCALEBITS) + 0.5)


def c_h2v1_fancy(row):
    dw, out = len(row), []
    out += [row[0], (row[0] * 3 + row[1] + 2) >> 2]
    for k in range(1, dw - 1):
        v = row[k] * 3
        out += [(v + row[k - 1] + 1) >> 2, (v + row[k + 1] + 2) >> 2]
    out += [(row[-1] * 3 + row[-2] + 1) >> 2, row[-1]]
    return out


def c_h2v2_fancy(plane):
    dh, dw = len(plane), len(plane[0])
    out = []
    for j in range(dh):
        for v in range(2):
            other = plane[max(j - 1, 0)] if v == 0 else plane[min(j + 1, dh - 1)]
            this, nxt = plane[j][0] * 3 + other[0], plane[j][1] * 3 + other[1]
            row = [(this * 4 + 8) >> 4, (this * 3 + nxt + 7) >> 4]
            last, this = this, nxt
            for k in range(2, dw):
                nxt = plane[j][k] * 3 + other[k]
                row += [(this * 3 + last + 8) >> 4, (this * 3 + nxt + 7) >> 4]
                last, this = this, nxt
            row += [(this * 3 + last + 8) >> 4, (this * 4 + 7) >> 4]
            out.append(row)
    return out


def c_h1v2_fancy(plane):
    dh = len(plane)
    out = []
    for j in range(dh):
        for v, bias in ((0, 1), (1, 2)):
            other = plane[max(j - 1, 0)] if v == 0 else plane[min(j + 1, dh - 1)]
            out.append([(a * 3 + b + bias) >> 2 for a, b in zip(plane[j], other)])
    return out


def c_upsample(plane, fx, fy):
    dw = len(plane[0])
    if (fx, fy) == (1, 1):
        return plane
    if (fx, fy) == (2, 1):
        return [c_h2v1_fancy(r) for r in plane] if dw > 2 else [[v for v in r for _ in (0, 1)] for r in plane]
    if (fx, fy) == (2, 2):
        return c_h2v2_fancy(plane) if dw > 2 else [[v for v in r for _ in (0, 1)] for r in plane for _ in (0, 1)]
    return c_h1v2_fancy(plane)


def c_ycc_rgb(y, cb, cr):
    def limit(v):
        return min(max(v, 0), 255)

    r_tab = [(FIX(1.40200) * (i - 128) + ONE_HALF) >> SCALEBITS for i in range(256)]
    b_tab = [(FIX(1.77200) * (i - 128) + ONE_HALF) >> SCALEBITS for i in range(256)]
    cr_g = [-FIX(0.71414) * (i - 128) for i in range(256)]
    cb_g = [-FIX(0.34414) * (i - 128) + ONE_HALF for i in range(256)]
    return [[[limit(yv + r_tab[v]), limit(yv + ((cb_g[u] + cr_g[v]) >> SCALEBITS)), limit(yv + b_tab[u])]
             for yv, u, v in zip(yr, ur, vr)] for yr, ur, vr in zip(y, cb, cr)]


def libjpeg(y, cb, cr, fx, fy):
    h, w = y.shape
    up = [np.asarray(c_upsample(p.tolist(), fx, fy))[:h, :w].tolist() for p in (cb, cr)]
    return np.asarray(c_ycc_rgb(y.tolist(), *up), dtype=np.uint8)


SIZES = [(1, 1), (2, 3), (3, 2), (5, 4), (4, 5), (7, 9), (16, 16), (17, 33), (31, 8)]


@pytest.mark.parametrize("fx,fy", [(1, 1), (2, 1), (2, 2), (1, 2)])
@pytest.mark.parametrize("h,w", SIZES)
def test_reference_equals_libjpeg_transcribed(h, w, fx, fy):
    rng = np.random.default_rng(h * 100 + w + fx * 7 + fy)
    dh, dw = -(-h // fy), -(-w // fx)
    y = rng.integers(0, 256, (h, w), dtype=np.uint8)
    cb, cr = (rng.integers(0, 256, (dh, dw), dtype=np.uint8) for _ in range(2))
    got = ycc_to_rgb_reference(torch.from_numpy(y), torch.from_numpy(cb), torch.from_numpy(cr), fx, fy)
    np.testing.assert_array_equal(got.numpy(), libjpeg(y, cb, cr, fx, fy))


def test_planes_of_the_wrong_size_are_refused():
    y = torch.zeros(5, 5, dtype=torch.uint8)
    with pytest.raises(ValueError, match="must be 3x3"):
        ycc_to_rgb_reference(y, torch.zeros(2, 2, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), 2, 2)
    with pytest.raises(ValueError, match="subsampling 4x1"):
        ycc_to_rgb_reference(y, y, y, 4, 1)
