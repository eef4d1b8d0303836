"""backends.preprocess.bicubic against Pillow itself: every comparison is exact equality.

Pillow (the pinned version in the venv) is the oracle: `Image.resize(size, BICUBIC)` on the same
uint8 pixels. Images are synthetic but photo-like (smooth shading, hard block edges, noise) or
drawn text/rectangles (hard edges are where the negative lobes overshoot and the uint8 clipping,
the rounding and the pass order all show up).
"""

from __future__ import annotations

import numpy as np
import PIL
import pytest
import torch
from PIL import Image, ImageDraw

from backends.config import MediaConfig
from backends.preprocess.bicubic import (
    PRECISION_BITS,
    pass_order,
    pillow_coefficients,
    resize_bicubic,
)
from backends.preprocess.resize_rule import navit_resize


# ---------------------------------------------------------------------------------------------
# Synthetic images


def photo_like(width: int, height: int, seed: int = 0) -> np.ndarray:
    """uint8 (height, width, 3): shading + checker edges + noise, channels shifted against each other."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = 128 + 90 * np.sin(x / 40) * np.cos(y / 55) + 40 * ((x // 37 + y // 41) % 2)
    rgb = np.stack([base, np.roll(base, 13, axis=1), np.roll(base, 29, axis=0)], axis=-1)
    rgb += rng.normal(0.0, 12.0, rgb.shape).astype(np.float32)
    return np.clip(rgb, 0, 255).astype(np.uint8)


def text_like(width: int, height: int, seed: int = 0) -> np.ndarray:
    """uint8 (height, width, 3): saturated rectangles, lines and text on a light background."""
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (width, height), (245, 245, 240))
    draw = ImageDraw.Draw(img)
    for _ in range(max(3, (width * height) // 20000)):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(1, max(2, width // 3))), y0 + int(rng.integers(1, max(2, height // 3)))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        draw.rectangle((x0, y0, x1, y1), fill=colour, outline=(0, 0, 0))
    for _ in range(4):
        draw.line([(int(rng.integers(0, width)), int(rng.integers(0, height))) for _ in range(2)],
                  fill=(255, 0, 0), width=1)
    step = 12
    for row, ty in enumerate(range(2, height, step)):
        draw.text((2 + (row % 5), ty), "Kimi K2.5 vision | 0123456789 WMgjq", fill=(0, 0, 0))
    return np.asarray(img).copy()


def noise(width: int, height: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    """uint8 (height, width, channels) white noise: the worst case for overshoot and clipping."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# Oracle comparison


def pillow_resize(arr: np.ndarray, width: int, height: int) -> np.ndarray:
    """The oracle: Pillow BICUBIC on the same pixels (mode RGB, or L for one channel)."""
    img = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
    out = np.asarray(img.resize((width, height), Image.Resampling.BICUBIC))
    return out[..., None] if arr.shape[-1] == 1 else out


def assert_equal_to_pillow(arr: np.ndarray, width: int, height: int) -> None:
    expected = pillow_resize(arr, width, height)
    got = resize_bicubic(torch.from_numpy(arr), width, height)
    assert got.dtype == torch.uint8 and tuple(got.shape) == expected.shape
    got = got.numpy()
    if not np.array_equal(got, expected):
        diff = np.abs(got.astype(np.int16) - expected.astype(np.int16))
        src = f"{arr.shape[1]}x{arr.shape[0]}"
        pytest.fail(f"{src} -> {width}x{height}: {int((diff > 0).sum())} values differ, max |diff| {int(diff.max())}")


# (source (w, h), target (w, h))
DOWNSCALE = [
    ((1024, 1024), (476, 476)),
    ((2048, 1536), (1031, 775)),
    ((300, 300), (1, 1)),
    ((37, 900), (5, 901)),  # width shrinks hard, height grows by one
    ((999, 777), (333, 259)),
    ((640, 480), (320, 240)),
    ((600, 400), (599, 1)),
]
UPSCALE = [
    ((64, 48), (640, 480)),
    ((7, 5), (64, 50)),
    ((100, 80), (301, 257)),
    ((1, 1), (5, 7)),
    ((2, 3), (9, 11)),
]
SINGLE_AXIS_OR_MIXED = [
    ((640, 480), (1000, 333)),  # width grows, height shrinks: vertical first in Pillow 13
    ((7, 5), (64, 3)),
    ((500, 200), (499, 201)),
    ((640, 480), (640, 333)),
    ((640, 480), (333, 480)),
    ((480, 640), (480, 1000)),
    ((200, 300), (731, 300)),
    ((480, 640), (1000, 333)),
    ((10, 500), (20, 499)),
]
PASS_ORDER_BOUNDARY = [  # Pillow 13: vertical first iff dst_h < src_h and 2*(src_w - dst_w) < src_h - dst_h
    ((30, 40), (11, 2)),  # 38 == 38: horizontal first
    ((30, 40), (12, 2)),  # 36 < 38: vertical first
    ((60, 30), (45, 1)),  # 30 > 29: horizontal
    ((60, 30), (46, 1)),  # 28 < 29: vertical
    ((211, 173), (190, 130)),  # 42 < 43: vertical, both axes shrink
    ((211, 173), (189, 130)),  # 44 > 43: horizontal
]
EXTREME = [
    ((4000, 3), (1000, 1)),
    ((3, 4000), (1, 1000)),
    ((3, 400), (2, 100)),  # a "tall" image (h > 100 w): vertical first since Pillow 12.2
    ((5000, 2), (7, 1)),
    ((1, 500), (1, 37)),
    ((500, 1), (37, 1)),
    ((1, 300), (300, 1)),
    ((1, 1), (1, 1)),
    ((640, 480), (640, 480)),  # no-op: a copy
    ((13, 1), (1, 13)),
]
ALL_CASES = DOWNSCALE + UPSCALE + SINGLE_AXIS_OR_MIXED + PASS_ORDER_BOUNDARY + EXTREME


def _case_id(case) -> str:
    (sw, sh), (dw, dh) = case
    return f"{sw}x{sh}->{dw}x{dh}"


@pytest.mark.parametrize("case", ALL_CASES, ids=[_case_id(c) for c in ALL_CASES])
def test_photo_like_equals_pillow(case):
    (sw, sh), (dw, dh) = case
    assert_equal_to_pillow(photo_like(sw, sh, seed=sw * 7 + sh), dw, dh)


@pytest.mark.parametrize("case", ALL_CASES, ids=[_case_id(c) for c in ALL_CASES])
def test_text_and_edges_equal_pillow(case):
    (sw, sh), (dw, dh) = case
    if sw * sh > 1_000_000:
        pytest.skip("the photo-like run covers this size; keeps the file fast")
    assert_equal_to_pillow(text_like(sw, sh, seed=sw + sh), dw, dh)


@pytest.mark.parametrize("case", DOWNSCALE[2:] + SINGLE_AXIS_OR_MIXED[:4] + PASS_ORDER_BOUNDARY,
                         ids=[_case_id(c) for c in DOWNSCALE[2:] + SINGLE_AXIS_OR_MIXED[:4] + PASS_ORDER_BOUNDARY])
def test_noise_equals_pillow(case):
    """White noise overshoots and clips the most, so the pass order is visible on every pixel row."""
    (sw, sh), (dw, dh) = case
    assert_equal_to_pillow(noise(sw, sh, seed=sw * sh), dw, dh)


def test_grayscale_single_channel_equals_pillow_L():
    arr = photo_like(321, 207, seed=3)[..., :1].copy()
    for dw, dh in [(100, 61), (640, 100), (321, 1000), (7, 207)]:
        assert_equal_to_pillow(arr, dw, dh)


def test_randomized_size_pairs_equal_pillow():
    rng = np.random.default_rng(20260417)
    for i in range(30):
        sw, sh = (int(v) for v in rng.integers(1, 400, 2))
        dw, dh = (int(v) for v in rng.integers(1, 500, 2))
        make = (photo_like, text_like, noise)[i % 3]
        assert_equal_to_pillow(make(sw, sh, seed=i), dw, dh)


NAVIT_SOURCES = [(3000, 3000), (4032, 3024), (2048, 2048), (10000, 200), (200, 9000), (1000, 7000), (1920, 1080)]


@pytest.mark.parametrize("src", NAVIT_SOURCES, ids=[f"{w}x{h}" for w, h in NAVIT_SOURCES])
def test_navit_rule_targets_equal_pillow(src):
    """The sizes the K2.5 processor actually asks Pillow for (decoders.resize_pillow)."""
    plan = navit_resize(*src, MediaConfig())
    arr = photo_like(*src, seed=1)
    if not plan.needs_resize:
        assert (plan.width, plan.height) == src
    assert_equal_to_pillow(arr, plan.width, plan.height)


# ---------------------------------------------------------------------------------------------
# Pieces


def test_coefficients_shapes_dtypes_and_identity_rows():
    bounds, weights = pillow_coefficients(5, 5)
    assert bounds.dtype == np.int64 and bounds.shape == (5, 2)
    assert weights.dtype == np.int32 and weights.shape == (5, 5)  # ksize = 2 * ceil(2) + 1
    # Same size: center 2.5, taps = int(2.5 + 2 + 0.5) - int(2.5 - 2 + 0.5) = 4 inputs 1..4, where the
    # cubic is sampled at -1, 0, 1, 2 -> 0, 1, 0, 0.
    assert bounds[2].tolist() == [1, 4]
    assert weights[2].tolist() == [0, 1 << PRECISION_BITS, 0, 0, 0]


def test_coefficients_downscale_support_and_normalization():
    bounds, weights = pillow_coefficients(4032, 1794)
    assert weights.shape == (1794, 2 * int(np.ceil(2 * 4032 / 1794)) + 1)
    assert (bounds[:, 0] >= 0).all() and (bounds.sum(axis=1) <= 4032).all()
    taps = np.arange(weights.shape[1])[None, :]
    assert (weights[taps >= bounds[:, 1:]] == 0).all()
    # Each row sums to 2^22 up to the per-tap rounding.
    assert (np.abs(weights.sum(axis=1, dtype=np.int64) - (1 << PRECISION_BITS)) <= weights.shape[1]).all()


def test_pass_order_rules_by_version():
    # Pillow <= 12.1: always horizontal first.
    assert pass_order(640, 480, 1000, 333, "12.1.1") == "horizontal"
    assert pass_order(3, 400, 2, 100, "11.3.0") == "horizontal"
    # Pillow 12.2 / 12.3: only tall images (h > 100 w) that shrink vertically.
    assert pass_order(3, 400, 2, 100, "12.2.0") == "vertical"
    assert pass_order(640, 480, 1000, 333, "12.3.0") == "horizontal"
    # Pillow 13: height shrinks by more than twice the width's shrink (in pixels).
    assert pass_order(640, 480, 1000, 333, "13.0.0") == "vertical"
    assert pass_order(30, 40, 11, 2, "13.0.0") == "horizontal"
    assert pass_order(30, 40, 12, 2, "13.0.0") == "vertical"
    assert pass_order(100, 80, 300, 250, "13.0.0") == "horizontal"  # upscale both
    assert pass_order(300, 200, 150, 400, "13.0.0") == "horizontal"


def test_installed_pillow_rule_is_the_one_exercised():
    """The equality tests above pin the rule of the Pillow in this venv; say which one that is."""
    major = int(PIL.__version__.split(".")[0])
    expected = "vertical" if major >= 13 else "horizontal"
    assert pass_order(640, 480, 1000, 333) == expected


def test_non_uint8_rejected():
    for dtype in (torch.float32, torch.int16, torch.int32):
        with pytest.raises(ValueError, match="uint8"):
            resize_bicubic(torch.zeros((4, 4, 3), dtype=dtype), 2, 2)
    with pytest.raises(ValueError, match="uint8"):
        resize_bicubic(np.zeros((4, 4, 3), dtype=np.uint8), 2, 2)
    with pytest.raises(ValueError):
        resize_bicubic(torch.zeros((4, 4, 3), dtype=torch.uint8), 0, 2)


def test_non_contiguous_input_and_copy_semantics():
    arr = photo_like(300, 200, seed=9)
    # A strided view (every other column) must give the same result as its contiguous copy.
    view = torch.from_numpy(arr)[:, ::2]
    assert not view.is_contiguous()
    expected = pillow_resize(np.ascontiguousarray(arr[:, ::2]), 97, 61)
    assert np.array_equal(resize_bicubic(view, 97, 61).numpy(), expected)
    # Same size returns a copy, not an alias.
    src = torch.from_numpy(arr.copy())
    out = resize_bicubic(src, 300, 200)
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_equals_pillow():
    for (sw, sh), (dw, dh) in [((2048, 1536), (1031, 775)), ((640, 480), (1000, 333)), ((300, 300), (1, 1))]:
        arr = photo_like(sw, sh, seed=5)
        got = resize_bicubic(torch.from_numpy(arr).cuda(), dw, dh)
        assert got.device.type == "cuda"
        assert np.array_equal(got.cpu().numpy(), pillow_resize(arr, dw, dh))
