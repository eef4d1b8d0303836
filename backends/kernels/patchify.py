"""Pad + normalize + patchify: resized uint8 (T, H, W, 3) -> (T*gh*gw, 3, p, p), as a Triton kernel and
its torch reference.

Both read each value's uint8 level (zero outside the resized image, i.e. the bottom/right padding)
and look it up in a per-channel normalization table (preprocess/normalize.py builds it with the
checkpoint processor's arithmetic), so their outputs are equal bit for bit. Patches are ordered
t-major, then patch row, then patch column; each patch is channel-first (C, py, px)
(docs/kimi_k25.md#patch-layout). The kernel never materializes the padded image or a float
intermediate: one byte read and one output element written per value.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def _frames(image: torch.Tensor, patch: int, padded_height: int, padded_width: int) -> torch.Tensor:
    """The shared input check: uint8 (H, W, 3) or (T, H, W, 3) inside a padded grid of whole patches.
    Returns the (T, H, W, 3) view."""
    if image.dtype != torch.uint8:
        raise ValueError(f"patchify takes uint8 pixels, got {image.dtype}")
    if image.dim() not in (3, 4) or image.shape[-1] != 3:
        raise ValueError(f"patchify takes (H, W, 3) or (T, H, W, 3) pixels, got shape {tuple(image.shape)}")
    frames = image if image.dim() == 4 else image.unsqueeze(0)
    h, w = frames.shape[1], frames.shape[2]
    if padded_height % patch or padded_width % patch or padded_height < h or padded_width < w:
        raise ValueError(f"cannot pad {h}x{w} pixels to {padded_height}x{padded_width}, "
                         f"which must be whole {patch}-pixel patches at least as large")
    return frames


def pad_normalize_patchify(image: torch.Tensor, table: torch.Tensor, patch: int, padded_height: int,
                           padded_width: int, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The torch reference, any device. image: uint8 (H, W, 3) or (T, H, W, 3); table: (3, 256) float32
    on the image's device. Returns (T*gh*gw, 3, patch, patch) `out_dtype`, gh = padded_height / patch."""
    frames = _frames(image, patch, padded_height, padded_width)
    t, h, w, _ = frames.shape
    padded = frames.new_zeros((t, padded_height, padded_width, 3))
    padded[:, :h, :w] = frames
    # Gather per channel: table[c][level] -> (t, ph, pw, 3) float32.
    idx = padded.long() + torch.arange(3, device=padded.device) * 256
    values = table.reshape(-1)[idx]
    gh, gw = padded_height // patch, padded_width // patch
    patches = values.view(t, gh, patch, gw, patch, 3).permute(0, 1, 3, 5, 2, 4)
    return patches.reshape(t * gh * gw, 3, patch, patch).to(out_dtype)


if triton is not None:

    # A new image size must not compile a variant: sizes are not specialized on, nor the frames' address
    # (a frame of a batch is a view at its size's offset) on 16-byte alignment.
    @triton.jit(do_not_specialize=["H", "W", "GH", "GW"], do_not_specialize_on_alignment=["img_ptr"])
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


def normalize_patchify(image: torch.Tensor, table: torch.Tensor, patch: int, padded_height: int,
                       padded_width: int, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The Triton kernel: same arguments and result as `pad_normalize_patchify`; image contiguous CUDA."""
    frames = _frames(image, patch, padded_height, padded_width)
    t, h, w, _ = frames.shape
    gh, gw = padded_height // patch, padded_width // patch
    out = torch.empty((t * gh * gw, 3, patch, patch), dtype=out_dtype, device=image.device)
    if out.numel():
        _patchify_kernel[(t * gh * gw,)](frames, table, out, h, w, gh, gw, P=patch,
                                         BLOCK=triton.next_power_of_2(3 * patch * patch))
    return out
