"""The position-embedding table resized to a grid: torch's bicubic rule as two small matrix products.

The reference resizes the learnable (64, 64, 1152) table to each media's (h, w) grid with
`F.interpolate(mode="bicubic", align_corners=False)`. torch's CUDA kernel for that gives each thread one
output pixel and loops over the 1,152 channels in it, so one new grid cost ~8 ms of GPU time on an
H100 (a third of a 1024^2 image's encoder time), paid by the first request of every size.

The rule is separable and linear: each output row is a fixed combination of four input rows, and each
output column of four input columns. So the resize is `Wy @ table @ Wx^T` per channel, with Wy (h, 64) and
Wx (w, 64) holding torch's cubic weights, and it runs as two GEMMs in float64 (microseconds) before one
rounding to the table's dtype. The weights, as torch's upsample kernels compute them
(aten/src/ATen/native/UpSample.h): output index i reads source position s = (i + 0.5) * in/out - 0.5
(not clamped, for cubic), taps floor(s) - 1 .. floor(s) + 2 clamped into the input, t = s - floor(s), and
Keys' cubic with A = -0.75: weights k(t + 1), k(t), k(1 - t), k(2 - t), where k(x) = ((A + 2) x - (A + 3)) x^2 + 1
for |x| <= 1 and ((A x - 5 A) x + 8 A) x - 4 A for 1 < |x| < 2. In float64 this is the rule's value
rounded once to the table's dtype (tests/unit/test_pos_resize.py); torch's own kernels round on the way
(float32 sums on CUDA; on CPU a bf16 table came out up to one bf16 step from the exact value), so in bf16
about a third of the values are one step from the reference's, well inside the encoder's bf16 drift.
"""

from __future__ import annotations

import torch

A = -0.75  # torch's bicubic constant


def _keys_near(x):  # |x| <= 1
    return ((A + 2) * x - (A + 3)) * x * x + 1


def _keys_far(x):  # 1 < |x| < 2
    return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A


def cubic_weights(n_in: int, n_out: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(n_out, n_in) float64 on `device`: row i holds the weights output i gives each input
    (align_corners=False). Made by device kernels only, no host-to-device copy, so a table can be
    resized inside a CUDA graph's capture as well as outside."""
    if n_in < 1 or n_out < 1:
        raise ValueError(f"sizes must be positive, got {n_in} -> {n_out}")
    src = (torch.arange(n_out, dtype=torch.float64, device=device) + 0.5) * (n_in / n_out) - 0.5
    base = torch.floor(src)
    t = src - base
    taps = torch.stack([_keys_far(t + 1), _keys_near(t), _keys_near(1 - t), _keys_far(2 - t)], dim=1)
    cols = (base.long()[:, None] - 1 + torch.arange(4, device=device)).clamp(0, n_in - 1)  # (n_out, 4)
    # Taps clamped onto one edge input add up there, in tap order: a fixed order of float64 sums (a
    # scatter_add would add them in whatever order its atomics land).
    inputs = torch.arange(n_in, device=device)
    w = torch.zeros((n_out, n_in), dtype=torch.float64, device=device)
    for k in range(4):
        w += (cols[:, k, None] == inputs) * taps[:, k, None]
    return w


def resize_table(table: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(H0, W0, D) -> (h, w, D) in table's dtype and device, as
    `F.interpolate(table.permute(2, 0, 1)[None], (h, w), mode="bicubic", align_corners=False)` laid out
    back as (h, w, D)."""
    h0, w0, d = table.shape
    wy, wx = cubic_weights(h0, h, table.device), cubic_weights(w0, w, table.device)
    rows = (wy @ table.to(torch.float64).reshape(h0, w0 * d)).reshape(h, w0, d)  # (h, W0, D)
    return torch.matmul(wx, rows).to(table.dtype)  # (w, W0) @ (h, W0, D) -> (h, w, D)
