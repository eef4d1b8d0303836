"""Pillow-exact BICUBIC resize of uint8 images in torch (any device); docs/pillow_bicubic.md.

`PIL.Image.resize(size, BICUBIC)` on an 8-bit image is integer arithmetic once its coefficients
exist: per axis, a Keys cubic (a = -0.5) is sampled in double, normalized per output pixel, and
quantized to 22 fractional bits; each pass accumulates `2**21 + sum(pixel * weight)` in int32 and
stores `clamp(acc >> 22, 0, 255)` as uint8. We build the same coefficients on the host with numpy
(double precision, same operation order as Resample.c) and run both passes as dense-index gathers
plus an int32 multiply-accumulate, so the result is bit-identical to Pillow on CPU and GPU alike.

Pillow subtleties reproduced here (each one changes output bits if missed):
- the filter argument is `(x + xmin - center + 0.5) * (1 / filterscale)`: a multiply by the
  reciprocal, not a division;
- the normalizing sum is accumulated left to right (numpy's pairwise `sum` could differ in the
  last bit, `cumsum` is sequential);
- `int()` in C truncates toward zero, for the bounds and for the fixed-point rounding;
- every pass writes uint8, so the intermediate image is clipped and rounded;
- the pass order depends on the Pillow version (see `pass_order`).
"""

from __future__ import annotations

import functools
import re

import numpy as np
import torch

PRECISION_BITS = 32 - 8 - 2  # Pillow: 8 bits of result, 2 bits of headroom for negative lobes / overshoot
_HALF = 1 << (PRECISION_BITS - 1)
_BICUBIC_SUPPORT = 2.0


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    """Keys cubic convolution kernel, a = -0.5, evaluated exactly as Pillow's `bicubic_filter`.

    x: float64, any shape -> float64, same shape. The expressions keep Pillow's operation order so
    the doubles match to the last bit.
    """
    a = -0.5
    x = np.abs(x)
    inner = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    outer = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, inner, np.where(x < 2.0, outer, 0.0))


def _c_int(x: np.ndarray) -> np.ndarray:
    """C's `(int)double` conversion: truncation toward zero. float64 -> int64."""
    return np.trunc(x).astype(np.int64)


@functools.lru_cache(maxsize=128)
def _coefficients_cached(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    scale = float(in_size) / out_size  # Pillow: (double)(in1 - in0) / outSize, box = (0, in_size)
    filterscale = max(scale, 1.0)  # downscaling widens the filter by the scale (antialiasing)
    support = _BICUBIC_SUPPORT * filterscale
    ksize = int(np.ceil(support)) * 2 + 1
    inv_filterscale = 1.0 / filterscale  # Pillow multiplies by the reciprocal

    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    xmin = np.maximum(_c_int(center - support + 0.5), 0)
    taps = np.minimum(_c_int(center + support + 0.5), in_size) - xmin

    tap = np.arange(ksize, dtype=np.int64)
    valid = tap[None, :] < taps[:, None]  # (out, ksize)
    arg = ((tap[None, :] + xmin[:, None]).astype(np.float64) - center[:, None] + 0.5) * inv_filterscale
    w = np.where(valid, _keys_cubic(arg), 0.0)
    # Sequential left-to-right sum like the C loop; trailing zeros of invalid taps do not change it.
    total = np.cumsum(w, axis=1)[:, -1]
    w = np.where(total[:, None] != 0.0, w / np.where(total == 0.0, 1.0, total)[:, None], w)

    # Round half away from zero: (int)(w * 2^22 +/- 0.5), truncating toward zero.
    fixed = w * float(1 << PRECISION_BITS)
    weights = _c_int(np.where(w < 0, fixed - 0.5, fixed + 0.5)).astype(np.int32)
    bounds = np.stack([xmin, taps], axis=1).astype(np.int64)
    bounds.setflags(write=False)
    weights.setflags(write=False)
    return bounds, weights


def pillow_coefficients(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's fixed-point BICUBIC coefficients for resampling one axis from in_size to out_size.

    Returns (bounds, weights):
      bounds: np.int64 (out_size, 2), each row [xmin, taps]: output i reads inputs xmin .. xmin+taps-1;
      weights: np.int32 (out_size, ksize), weight of input xmin + k; zero for k >= taps.
    ksize = 2 * ceil(2 * max(in/out, 1)) + 1. The arrays are cached and read-only.
    """
    if in_size < 1 or out_size < 1:
        raise ValueError(f"sizes must be positive, got {in_size} -> {out_size}")
    return _coefficients_cached(int(in_size), int(out_size))


@functools.lru_cache(maxsize=128)
def _device_taps(in_size: int, out_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(index int64 (out, ksize), weights int32 (out, ksize)) on `device`.

    Invalid taps (k >= taps) point at the row's first tap, xmin, with weight 0, so every output
    pixel is a fixed-width dense gather with no masking, and every index stays inside the rows a
    shortened horizontal pass computed.
    """
    bounds, weights = pillow_coefficients(in_size, out_size)
    tap = np.arange(weights.shape[1])[None, :]
    index = bounds[:, :1] + np.where(tap < bounds[:, 1:], tap, 0)
    return torch.from_numpy(index).to(device), torch.from_numpy(weights.copy()).to(device)


def _chunk_budget(device: torch.device) -> int:
    """Most int32 elements one gather step may materialize.

    On CPU the pass is memory-bound: keeping each step's gathered rows and accumulator near cache
    size is ~10x faster than whole-image buffers. On an accelerator fewer, larger launches win.
    """
    return 1 << 20 if device.type == "cpu" else 1 << 26


def _resample_rows(src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One Pillow pass along dim 0 of a 2-D uint8 tensor: out[i] = clip8(2^21 + sum_k w[i,k] * src[index[i,k]]).

    src: uint8 (N, M), contiguous; index: int64 (out, ksize) into dim 0; weights: int32 (out, ksize).
    Returns uint8 (out, M). Whole source rows are gathered (contiguous copies), multiplied by their
    int32 weights and summed in int32, like Pillow's accumulator (products <= 255 * 2^22 and
    Pillow's 2 headroom bits keep the sums inside int32). Output rows are processed in chunks of
    `rows` and taps in groups of `group` so that one step materializes at most ~budget elements.
    """
    out, ksize = index.shape
    m = src.shape[1]
    budget = _chunk_budget(src.device)
    group = min(ksize, max(1, budget // max(m, 1)))
    rows = max(1, budget // (group * max(m, 1)))
    result = torch.empty((out, m), dtype=torch.uint8, device=src.device)
    for r0 in range(0, out, rows):
        idx, w = index[r0:r0 + rows], weights[r0:r0 + rows]
        n = idx.shape[0]
        acc = torch.full((n, m), _HALF, dtype=torch.int32, device=src.device)
        for k0 in range(0, ksize, group):
            gi, gw = idx[:, k0:k0 + group], w[:, k0:k0 + group]
            g = src.index_select(0, gi.reshape(-1)).to(torch.int32).view(n, gi.shape[1], m)
            acc += (g * gw.unsqueeze(-1)).sum(dim=1, dtype=torch.int32)
        # Arithmetic shift = floor division, as in C; then Pillow's clip8 table = clamp to 0..255.
        result[r0:r0 + n] = (acc >> PRECISION_BITS).clamp_(0, 255)
    return result


def horizontal_pass(src: torch.Tensor, out_width: int, rows: slice | None = None) -> torch.Tensor:
    """Resample the width of uint8 (H, W, C) to out_width; only `rows` of src if given.

    Returns uint8 (len(rows) or H, out_width, C), on src's device. The image is transposed so that
    the taps become whole-row gathers (a gather along W with C = 3 innermost is ~10x slower on CPU).
    """
    if rows is not None:
        src = src[rows]
    h, w, c = src.shape
    index, weights = _device_taps(w, out_width, src.device)
    cols = src.transpose(0, 1).contiguous().view(w, h * c)
    return _resample_rows(cols, index, weights).view(out_width, h, c).transpose(0, 1).contiguous()


def vertical_pass(src: torch.Tensor, in_height: int, out_height: int, row_offset: int = 0) -> torch.Tensor:
    """Resample uint8 (h, W, C) holding source rows row_offset.. of an in_height-tall image to out_height.

    Pillow's shifted vertical bounds: the coefficients are those of in_height -> out_height, and the
    row indices are shifted by row_offset (the first row the horizontal pass computed).
    Returns uint8 (out_height, W, C).
    """
    h, w, c = src.shape
    index, weights = _device_taps(in_height, out_height, src.device)
    if row_offset:
        index = index - row_offset
    return _resample_rows(src.contiguous().view(h, w * c), index, weights).view(out_height, w, c)


@functools.lru_cache(maxsize=16)
def _pillow_version(version: str | None = None) -> tuple[int, ...]:
    """(major, minor) of `version`, default the installed Pillow's; (13, 0) when Pillow is absent."""
    if version is None:
        try:
            import PIL
        except ImportError:  # a device-only host without Pillow: follow the newest known rule
            return (13, 0)
        version = PIL.__version__
    return tuple(int(p) for p in re.findall(r"\d+", version)[:2])


def pass_order(src_w: int, src_h: int, dst_w: int, dst_h: int, pillow_version: str | None = None) -> str:
    """Which pass Pillow runs first, "horizontal" or "vertical" (it matters only when both run:
    the intermediate image is rounded and clipped to uint8, so the order changes output bits).

    - Pillow < 12.2: always horizontal first.
    - Pillow 12.2 / 12.3 (Python-level, PR #9524): vertical first for "tall" images,
      src_h > 100 * src_w, whose height shrinks.
    - Pillow 13.x (in C, PR #9549 "if height is scaled down significantly more than width"):
      vertical first when the height shrinks and the width loses fewer than half as many pixels
      as the height does: dst_h < src_h and 2 * (src_w - dst_w) < src_h - dst_h (strict). This
      covers "height shrinks, width grows or stays". The threshold was mapped against the pinned
      13.0.0 (hundreds of random size pairs biased to the boundary, no exception); the PR's first
      version only had the "width does not shrink" half of it.
    """
    major_minor = _pillow_version(pillow_version)
    if dst_h >= src_h:
        return "horizontal"
    if major_minor >= (13,):
        return "vertical" if 2 * (src_w - dst_w) < src_h - dst_h else "horizontal"
    if major_minor >= (12, 2):
        return "vertical" if src_h > src_w * 100 else "horizontal"
    return "horizontal"


def resize_bicubic(image: torch.Tensor, width: int, height: int, *, pillow_version: str | None = None) -> torch.Tensor:
    """Pillow-exact `Image.resize((width, height), BICUBIC)` of a uint8 (H, W, C) tensor.

    image: uint8 (H, W, C) (RGB is C = 3; channels are independent, as in Pillow's RGB/L modes),
    any device. Returns a new uint8 (height, width, C) tensor on the same device.
    `pillow_version` selects the pass-order rule (default: the installed Pillow's).
    """
    if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8:
        got = image.dtype if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"resize_bicubic needs a uint8 tensor, got {got}")
    if image.dim() != 3:
        raise ValueError(f"resize_bicubic needs a (H, W, C) uint8 tensor, got shape {tuple(image.shape)}")
    width, height = int(width), int(height)
    src_h, src_w = image.shape[0], image.shape[1]
    if width < 1 or height < 1 or src_w < 1 or src_h < 1:
        raise ValueError(f"sizes must be positive, got {src_w}x{src_h} -> {width}x{height}")

    need_h, need_v = width != src_w, height != src_h
    if not need_h and not need_v:
        return image.clone()  # Pillow returns a copy for a same-size resize
    if not need_v:
        return horizontal_pass(image, width)
    if not need_h:
        return vertical_pass(image, src_h, height)

    if pass_order(src_w, src_h, width, height, pillow_version) == "vertical":
        return horizontal_pass(vertical_pass(image, src_h, height), width)
    # Horizontal first, on only the source rows the vertical pass reads (Pillow's ybox_first..last);
    # the vertical indices are shifted by the first of them.
    bounds, _ = pillow_coefficients(src_h, height)
    first = int(bounds[0, 0])
    last = int(bounds[-1, 0] + bounds[-1, 1])
    tmp = horizontal_pass(image, width, rows=slice(first, last))
    return vertical_pass(tmp, src_h, height, row_offset=first)
