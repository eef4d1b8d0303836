"""Pad + normalize + patchify: uint8 (H, W, 3) -> (gh*gw, 3, p, p) in (row, column, C, py, px) order.

Normalization goes through a per-channel 256-entry table built with the reference arithmetic
(`(x/255).astype(float32)`, then `-= mean`, then `*= 1/std`, each rounded to float32; reference doc
§1.4), so every value equals the checkpoint processor's bit for bit on any device. Padding is zero in
uint8 space and therefore lands on table[0] = -mean/std (-1 for K2.5), never 0.
"""

from __future__ import annotations

import numpy as np
import torch

from backends.config import MediaConfig
from backends.preprocess.resize_rule import ResizePlan


def normalization_table(media: MediaConfig) -> np.ndarray:
    """(3, 256) float32: the normalized value of every uint8 level, per channel."""
    levels = (np.arange(256, dtype=np.float64) / 255.0).astype(np.float32)
    mean = np.asarray(media.image_mean, dtype=np.float64)
    std_inv = 1.0 / np.asarray(media.image_std, dtype=np.float64)
    table = np.empty((3, 256), dtype=np.float32)
    for c in range(3):
        x = levels.copy()
        x -= mean[c]  # in-place into float32, as the reference does
        x *= std_inv[c]
        table[c] = x
    return table


def pad_normalize_patchify(image: torch.Tensor, plan: ResizePlan, table: torch.Tensor,
                           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """image: (H, W, 3) or (T, H, W, 3) uint8 at the plan's resized size; table: (3, 256) float32.

    Returns (T*gh*gw, 3, p, p) `out_dtype`, patches t-major then row-major (reference doc §1.5).
    """
    if image.dtype != torch.uint8:
        raise ValueError(f"pad_normalize_patchify takes uint8 pixels, got {image.dtype}")
    frames = image if image.dim() == 4 else image.unsqueeze(0)
    t, h, w, c = frames.shape
    if (h, w, c) != (plan.height, plan.width, 3):
        raise ValueError(f"expected {plan.height}x{plan.width}x3 pixels for this plan, got {h}x{w}x{c}")
    p = plan.patch_size
    ph, pw = plan.padded_height, plan.padded_width
    padded = frames.new_zeros((t, ph, pw, 3))
    padded[:, :h, :w] = frames
    # Gather per channel: table[c][level] -> (t, ph, pw, 3) float32.
    idx = padded.long() + torch.arange(3, device=padded.device) * 256
    values = table.reshape(-1)[idx]
    gh, gw = ph // p, pw // p
    patches = values.view(t, gh, p, gw, p, 3).permute(0, 1, 3, 5, 2, 4)
    return patches.reshape(t * gh * gw, 3, p, p).to(out_dtype)
