"""Encoded images -> (PIXEL_VALUES, GRID_THWS): decode, navit resize, pad, normalize, patchify."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from backends.config import MediaConfig
from backends.errors import RequestError
from backends.preprocess.decode import decode_rgb, image_size, to_uint8_hwc
from backends.preprocess.patchify import normalization_table, pad_normalize_patchify
from backends.preprocess.resize_rule import ResizePlan, navit_resize


@dataclass(frozen=True)
class Limits:
    """Per-request limits (model config parameters). Every violation is a RequestError."""

    max_images: int = 64
    max_patches: int = 16384 * 8
    max_image_pixels: int = 179_000_000  # Pillow's own hard bomb limit (2 x MAX_IMAGE_PIXELS)


def plan_images(blobs: Sequence[bytes], media: MediaConfig, limits: Limits) -> list[ResizePlan]:
    """Read each image's header (no pixel decode) and plan its resize; enforce the request limits."""
    if len(blobs) > limits.max_images:
        raise RequestError(f"{len(blobs)} images in one request exceeds the limit max_images={limits.max_images}")
    plans = []
    for i, blob in enumerate(blobs):
        w, h = image_size(blob, i, max_pixels=limits.max_image_pixels)
        plans.append(navit_resize(w, h, media))
    total = sum(p.num_patches for p in plans)
    if total > limits.max_patches:
        raise RequestError(f"the request's images need {total} patches, exceeding the limit max_patches={limits.max_patches}")
    return plans


def resize_pillow(img: Image.Image, plan: ResizePlan) -> Image.Image:
    """The checkpoint's own resize call: Pillow BICUBIC on the uint8 RGB image."""
    if not plan.needs_resize:
        return img
    return img.resize((plan.width, plan.height), resample=Image.Resampling.BICUBIC)


class Preprocessor:
    """Stateful only in its normalization table (built once, kept on the target device)."""

    def __init__(self, media: MediaConfig, limits: Limits = Limits(), device: str | torch.device = "cpu",
                 out_dtype: torch.dtype = torch.float32):
        self.media = media
        self.limits = limits
        self.device = torch.device(device)
        self.out_dtype = out_dtype
        self.table = torch.from_numpy(normalization_table(media)).to(self.device)

    def plan(self, blobs: Sequence[bytes]) -> list[ResizePlan]:
        return plan_images(blobs, self.media, self.limits)

    def __call__(self, blobs: Sequence[bytes]) -> tuple[torch.Tensor, np.ndarray, list[ResizePlan]]:
        """Returns pixel_values (N, 3, p, p) on `device`, grid_thws (M, 3) int64 on the host, plans."""
        plans = self.plan(blobs)
        chunks = []
        for i, (blob, plan) in enumerate(zip(blobs, plans)):
            img = decode_rgb(blob, i, max_pixels=self.limits.max_image_pixels)
            if img.size != (plan.src_width, plan.src_height):
                raise RequestError(f"image {i}: decoded size {img.size} differs from its header size "
                                   f"{(plan.src_width, plan.src_height)}")
            pixels = torch.from_numpy(to_uint8_hwc(resize_pillow(img, plan)).copy()).to(self.device)
            chunks.append(pad_normalize_patchify(pixels, plan, self.table, self.out_dtype))
        p = self.media.patch_size
        pixel_values = torch.cat(chunks) if chunks else torch.empty((0, 3, p, p), dtype=self.out_dtype, device=self.device)
        grid_thws = np.asarray([plan.grid_thw for plan in plans], dtype=np.int64).reshape(-1, 3)
        return pixel_values, grid_thws, plans
