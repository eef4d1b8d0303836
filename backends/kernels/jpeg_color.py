"""libjpeg-turbo's chroma upsampling and YCbCr -> RGB, from a JPEG's decoded planes: a Triton kernel and
its torch reference, both integer arithmetic, equal bit for bit (docs/jpeg_decoding.md).

Input: the planes at their stored sizes, as nvJPEG returns them for NVJPEG_OUTPUT_YUV: Y (H, W) and
Cb, Cr (dh, dw) uint8, with dw = ceil(W / fx), dh = ceil(H / fy) for the chroma subsampling factors
(fx, fy) in {(1, 1), (2, 1), (2, 2), (1, 2)} (4:4:4, 4:2:2, 4:2:0, 4:4:0). Output: the (H, W, 3)
uint8 RGB image that Pillow's `Image.open(f).convert("RGB")` gives, which the exact resize reads.

What libjpeg-turbo does (jdsample.c, jdcolor.c), with every index clamped to the plane (its edge
rows and columns are repeated):
- 4:2:2 (h2v1), when dw > 2: out[2i] = (3c[i] + c[i-1] + 1) >> 2, out[2i+1] = (3c[i] + c[i+1] + 2) >> 2;
- 4:2:0 (h2v2), when dw > 2: column sums s = 3c[j] + c[j-1] for output row 2j and 3c[j] + c[j+1] for
  row 2j+1, then out[2i] = (3s[i] + s[i-1] + 8) >> 4, out[2i+1] = (3s[i] + s[i+1] + 7) >> 4;
- 4:4:0 (h1v2), always: out[2j] = (3c[j] + c[j-1] + 1) >> 2, out[2j+1] = (3c[j] + c[j+1] + 2) >> 2;
- 4:2:2 and 4:2:0 with dw <= 2: plain replication (libjpeg's fancy upsampling needs 3 columns);
- colour, 16 fractional bits: R = Y + ((91881 Cr' + 32768) >> 16), B = Y + ((116130 Cb' + 32768) >> 16),
  G = Y + ((-22554 Cb' - 46802 Cr' + 32768) >> 16), Cb' = Cb - 128, Cr' = Cr - 128, each clamped to 0..255.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

SAMPLING = {(1, 1): "4:4:4", (2, 1): "4:2:2", (2, 2): "4:2:0", (1, 2): "4:4:0"}


def _check(y: torch.Tensor, cb: torch.Tensor, cr: torch.Tensor, fx: int, fy: int) -> tuple[int, int, int, int]:
    if (fx, fy) not in SAMPLING:
        raise ValueError(f"chroma subsampling {fx}x{fy} is not one of {sorted(SAMPLING)}")
    for name, t in (("Y", y), ("Cb", cb), ("Cr", cr)):
        if t.dtype != torch.uint8 or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D uint8 plane, got {t.dtype} {tuple(t.shape)}")
    h, w = y.shape
    dh, dw = -(-h // fy), -(-w // fx)
    if tuple(cb.shape) != (dh, dw) or tuple(cr.shape) != (dh, dw):
        raise ValueError(f"chroma planes must be {dh}x{dw} for a {h}x{w} image at {SAMPLING[(fx, fy)]}, "
                         f"got {tuple(cb.shape)} and {tuple(cr.shape)}")
    return h, w, dh, dw


def fancy_horizontal(fx: int, dw: int) -> bool:
    return fx == 2 and dw > 2


def upsample_reference(c: torch.Tensor, h: int, w: int, fx: int, fy: int) -> torch.Tensor:
    """One chroma plane (dh, dw) -> (h, w) int32, as libjpeg-turbo upsamples it."""
    c = c.to(torch.int32)
    dh, dw = c.shape
    rows = torch.arange(h, device=c.device)
    cols = torch.arange(w, device=c.device)
    j, i = rows // fy, cols // fx
    even_y, even_x = (rows % 2 == 0)[:, None], (cols % 2 == 0)[None, :]
    fancy_h = fancy_horizontal(fx, dw)
    if fy == 2 and (fx == 1 or fancy_h):  # vertical triangle filter (h1v2, or h2v2 when fancy)
        jn = torch.where(rows % 2 == 0, (j - 1).clamp(min=0), (j + 1).clamp(max=dh - 1))
        colsum = 3 * c[j] + c[jn]  # (h, dw)
        if fx == 1:
            return (colsum[:, i] + torch.where(even_y, 1, 2)) >> 2
        i_n = torch.where(cols % 2 == 0, (i - 1).clamp(min=0), (i + 1).clamp(max=dw - 1))
        return (3 * colsum[:, i] + colsum[:, i_n] + torch.where(even_x, 8, 7)) >> 4
    if fy == 1 and fancy_h:  # h2v1
        i_n = torch.where(cols % 2 == 0, (i - 1).clamp(min=0), (i + 1).clamp(max=dw - 1))
        return (3 * c[j][:, i] + c[j][:, i_n] + torch.where(even_x, 1, 2)) >> 2
    return c[j][:, i]  # replication


def ycc_to_rgb_reference(y: torch.Tensor, cb: torch.Tensor, cr: torch.Tensor, fx: int, fy: int) -> torch.Tensor:
    """The torch reference, any device: planes -> (H, W, 3) uint8."""
    h, w, _, _ = _check(y, cb, cr, fx, fy)
    yy = y.to(torch.int32)
    u = upsample_reference(cb, h, w, fx, fy) - 128
    v = upsample_reference(cr, h, w, fx, fy) - 128
    r = yy + ((91881 * v + 32768) >> 16)
    g = yy + ((-22554 * u - 46802 * v + 32768) >> 16)
    b = yy + ((116130 * u + 32768) >> 16)
    return torch.stack([r, g, b], dim=-1).clamp_(0, 255).to(torch.uint8)


if triton is not None:

    @triton.jit
    def _tri(near_ptr, far_ptr, mask):
        """The triangle filter's weighted sum before rounding: 3 x the nearer sample + the farther."""
        return 3 * tl.load(near_ptr, mask=mask, other=0).to(tl.int32) + tl.load(far_ptr, mask=mask, other=0).to(tl.int32)

    # Sizes and pitches are not specialized on (divisible by 16, equal to 1), nor the planes' addresses on
    # 16-byte alignment: an image's planes lie back to back at its sizes' offsets, so an odd width puts
    # Cb and Cr anywhere. Either would compile a variant on a request's path (about 200 ms, seen for a
    # 619 x 968 JPEG on an H100).
    @triton.jit(do_not_specialize=["H", "W", "DH", "DW", "Y_PITCH", "C_PITCH", "Y_IMAGE", "C_IMAGE"],
                do_not_specialize_on_alignment=["y_ptr", "cb_ptr", "cr_ptr"])
    def _ycc_rgb_kernel(y_ptr, cb_ptr, cr_ptr, out_ptr, H, W, DH, DW, Y_PITCH, C_PITCH, Y_IMAGE, C_IMAGE,
                        FX: tl.constexpr, FY: tl.constexpr, FANCY_H: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        x = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = x < W
        # Image k of a batch of same-shaped images: its planes Y_IMAGE / C_IMAGE elements further on.
        k = tl.program_id(2).to(tl.int64)
        y_ptr += k * Y_IMAGE
        cb_ptr += k * C_IMAGE
        cr_ptr += k * C_IMAGE
        out_ptr += k * H * W * 3
        yv = tl.load(y_ptr + row.to(tl.int64) * Y_PITCH + x, mask=mask, other=0).to(tl.int32)
        j = row // FY
        i = x // FX
        odd_x = (x % 2) == 1
        if FY == 2 and (FX == 1 or FANCY_H):
            odd_y = (row % 2) == 1
            jn = tl.where(odd_y, tl.minimum(j + 1, DH - 1), tl.maximum(j - 1, 0))
            # The chroma row under this output row (the nearer, weight 3) and the neighbour it blends with.
            base, other = j.to(tl.int64) * C_PITCH, jn.to(tl.int64) * C_PITCH
            if FX == 1:  # h1v2: vertical triangle only
                bias = tl.where(odd_y, 2, 1)
                u = (_tri(cb_ptr + base + i, cb_ptr + other + i, mask) + bias) >> 2
                v = (_tri(cr_ptr + base + i, cr_ptr + other + i, mask) + bias) >> 2
            else:  # h2v2: vertical sums of this column and its neighbour, then the horizontal triangle
                i_n = tl.where(odd_x, tl.minimum(i + 1, DW - 1), tl.maximum(i - 1, 0))
                bias = tl.where(odd_x, 7, 8)
                su = _tri(cb_ptr + base + i, cb_ptr + other + i, mask)
                sun = _tri(cb_ptr + base + i_n, cb_ptr + other + i_n, mask)
                sv = _tri(cr_ptr + base + i, cr_ptr + other + i, mask)
                svn = _tri(cr_ptr + base + i_n, cr_ptr + other + i_n, mask)
                u = (3 * su + sun + bias) >> 4
                v = (3 * sv + svn + bias) >> 4
        elif FY == 1 and FANCY_H:  # h2v1: horizontal triangle only
            base = j.to(tl.int64) * C_PITCH
            i_n = tl.where(odd_x, tl.minimum(i + 1, DW - 1), tl.maximum(i - 1, 0))
            bias = tl.where(odd_x, 2, 1)
            u = (_tri(cb_ptr + base + i, cb_ptr + base + i_n, mask) + bias) >> 2
            v = (_tri(cr_ptr + base + i, cr_ptr + base + i_n, mask) + bias) >> 2
        else:
            base = j.to(tl.int64) * C_PITCH
            u = tl.load(cb_ptr + base + i, mask=mask, other=0).to(tl.int32)
            v = tl.load(cr_ptr + base + i, mask=mask, other=0).to(tl.int32)
        u = u - 128
        v = v - 128
        r = yv + ((91881 * v + 32768) >> 16)
        g = yv + ((-22554 * u - 46802 * v + 32768) >> 16)
        b = yv + ((116130 * u + 32768) >> 16)
        out = out_ptr + (row.to(tl.int64) * W + x) * 3
        tl.store(out, tl.minimum(tl.maximum(r, 0), 255).to(tl.uint8), mask=mask)
        tl.store(out + 1, tl.minimum(tl.maximum(g, 0), 255).to(tl.uint8), mask=mask)
        tl.store(out + 2, tl.minimum(tl.maximum(b, 0), 255).to(tl.uint8), mask=mask)


def ycc_to_rgb_batch(y: torch.Tensor, cb: torch.Tensor, cr: torch.Tensor, fx: int, fy: int,
                     block: int = 256) -> torch.Tensor:
    """The Triton kernel, for N same-shaped images in one launch: Y (N, H, W), Cb and Cr (N, dh, dw),
    strided views (unit stride within a row; Cb and Cr with the same strides) -> (N, H, W, 3) uint8,
    image k equal to `ycc_to_rgb_reference(y[k], cb[k], cr[k], fx, fy)`. One launch instead of N: on a
    GPU the launches, not the kernels, are what eight small images cost."""
    if y.dim() != 3 or cb.dim() != 3 or cr.dim() != 3 or not (y.shape[0] == cb.shape[0] == cr.shape[0]):
        raise ValueError(f"planes must be (N, rows, cols) with the same N, got {tuple(y.shape)}, "
                         f"{tuple(cb.shape)}, {tuple(cr.shape)}")
    n = y.shape[0]
    h, w, dh, dw = _check(y[0], cb[0], cr[0], fx, fy) if n else (y.shape[1], y.shape[2], 0, 0)
    if y.stride(2) != 1 or cb.stride(2) != 1 or cr.stride(2) != 1 or cb.stride()[:2] != cr.stride()[:2]:
        raise ValueError("planes need unit stride within a row, and Cb and Cr the same strides")
    out = torch.empty((n, h, w, 3), dtype=torch.uint8, device=y.device)
    if n and h and w:
        grid = (h, triton.cdiv(w, block), n)
        _ycc_rgb_kernel[grid](y, cb, cr, out, h, w, dh, dw, y.stride(1), cb.stride(1), y.stride(0), cb.stride(0),
                              FX=fx, FY=fy, FANCY_H=fancy_horizontal(fx, dw), BLOCK=block)
    return out
