"""Residual add + LayerNorm in one pass: `s = x + delta; y = LayerNorm(s)`, both returned.

Every encoder block does this twice (after attention, after the MLP). Done as two torch kernels it reads
x and delta, writes s, reads s again and writes y: five trips through HBM of an (L, 1152) tensor, and
torch's LayerNorm kernel runs well below the copy bandwidth at this width. The fused kernel reads x and
delta once and writes s and y once (four trips), one program per row.

Rounding follows the unfused torch path: s is rounded to the input dtype once (as torch's add does), and
the norm is taken of that rounded s in fp32, scaled and shifted in fp32, rounded once. The mean and
variance are fp32 sums over the row (two passes: the mean, then the centred squares) where torch runs a
Welford loop: the fp32 statistics differ in their last bits, so s is equal to torch's and y is within
one ulp of the input dtype of torch's (for |y| < 1, within the ulp of 1) (tests/gpu/test_gpu_kernels.py,
tests/unit/test_triton_kernels_interpreted.py). A row's result depends on that row alone: packing media
together does not change their rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton use the reference
    triton = None


def add_layernorm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused torch path: (x + delta, layer_norm(x + delta))."""
    s = x + delta
    return s, F.layer_norm(s, (s.shape[-1],), weight, bias, eps)


if triton is not None:

    @triton.jit
    def _add_layernorm_kernel(x_ptr, d_ptr, w_ptr, b_ptr, s_ptr, y_ptr, eps,
                              WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * WIDTH  # int64: 16,900 rows x 1152 fits int32, long videos do not
        cols = tl.arange(0, BLOCK)
        mask = cols < WIDTH
        x = tl.load(x_ptr + row + cols, mask=mask, other=0.0)
        d = tl.load(d_ptr + row + cols, mask=mask, other=0.0)
        s = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # the residual stream, rounded as torch's add
        tl.store(s_ptr + row + cols, s, mask=mask)
        sf = s.to(tl.float32)
        mean = tl.sum(sf, axis=0) / WIDTH
        centred = tl.where(mask, sf - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / WIDTH + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row + cols, (centred * rstd * w + b).to(x.dtype), mask=mask)


def fusable(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """Whether the fused kernel takes these: triton present; x and delta (L, D) of one shape and dtype,
    contiguous; weight and bias (D,) contiguous on their device (a LayerNorm without affine parameters
    takes the reference)."""
    if triton is None or x.dim() != 2 or x.shape != delta.shape or x.dtype != delta.dtype or x.shape[1] > 16384:
        return False
    if weight is None or bias is None:
        return False
    tensors = (x, delta, weight, bias)
    return (all(t.is_contiguous() and t.device == x.device for t in tensors)
            and weight.shape == bias.shape == (x.shape[1],))


def add_layernorm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  eps: float, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta: (L, D) contiguous; weight, bias: (D,) contiguous. Returns new tensors
    (x + delta, LayerNorm(x + delta))."""
    if not fusable(x, delta, weight, bias):
        raise ValueError(f"the fused add + LayerNorm takes two contiguous (L, D) tensors of one dtype and contiguous "
                         f"(D,) parameters on their device, got {tuple(x.shape)} {x.dtype}, {tuple(delta.shape)} "
                         f"{delta.dtype}, parameters {None if weight is None else tuple(weight.shape)} / "
                         f"{None if bias is None else tuple(bias.shape)}")
    rows, width = x.shape
    s, y = torch.empty_like(x), torch.empty_like(x)
    if rows:
        _add_layernorm_kernel[(rows,)](x, delta, weight, bias, s, y, eps,
                                       WIDTH=width, BLOCK=triton.next_power_of_2(width), num_warps=num_warps)
    return s, y
