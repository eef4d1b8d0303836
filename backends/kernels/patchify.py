"""Fused pad + normalize + patchify (Triton): resized uint8 (T, H, W, 3) -> (T*gh*gw, 3, p, p) in one pass.

Reference: `backends.preprocess.patchify.pad_normalize_patchify` (torch). Each output element reads
its uint8 level (zero outside the resized image, i.e. the bottom/right padding) and looks it up in the
per-channel normalization table, so values equal the reference bit for bit; the padded image and the
float intermediate never exist in memory: one byte read and one output element written per value.
"""

from __future__ import annotations

import torch

from backends.preprocess.resize_rule import ResizePlan

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit
    def _patchify_kernel(img_ptr, table_ptr, out_ptr, H, W, GH, GW,
                         P: tl.constexpr, BLOCK: tl.constexpr):
        patch = tl.program_id(0).to(tl.int64)  # (t, gy, gx) flattened, t-major
        gx = patch % GW
        gy = (patch // GW) % GH
        t = patch // (GW * GH)
        e = tl.arange(0, BLOCK)
        n = 3 * P * P
        c = e // (P * P)
        py = (e // P) % P
        px = e % P
        y = gy * P + py
        x = gx * P + px
        inside = (e < n) & (y < H) & (x < W)
        level = tl.load(img_ptr + ((t * H + y) * W + x) * 3 + c, mask=inside, other=0).to(tl.int32)
        value = tl.load(table_ptr + c * 256 + level, mask=e < n, other=0.0)
        tl.store(out_ptr + patch * n + e, value.to(out_ptr.dtype.element_ty), mask=e < n)


def can_use(image: torch.Tensor) -> bool:
    return triton is not None and image.is_cuda and image.dtype == torch.uint8 and image.is_contiguous()


def normalize_patchify(image: torch.Tensor, plan: ResizePlan, table: torch.Tensor,
                       out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """image: (H, W, 3) or (T, H, W, 3) uint8 CUDA, contiguous; table (3, 256) float32 on the device."""
    frames = image if image.dim() == 4 else image.unsqueeze(0)
    t, h, w, c = frames.shape
    if image.dtype != torch.uint8:
        raise ValueError(f"normalize_patchify takes uint8 pixels, got {image.dtype}")
    if (h, w, c) != (plan.height, plan.width, 3):
        raise ValueError(f"expected {plan.height}x{plan.width}x3 pixels for this plan, got {h}x{w}x{c}")
    p = plan.patch_size
    gh, gw = plan.padded_height // p, plan.padded_width // p
    out = torch.empty((t * gh * gw, 3, p, p), dtype=out_dtype, device=image.device)
    if out.numel():
        _patchify_kernel[(t * gh * gw,)](frames, table, out, h, w, gh, gw, P=p,
                                         BLOCK=triton.next_power_of_2(3 * p * p))
    return out
