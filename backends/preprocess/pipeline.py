"""Encoded images -> (PIXEL_VALUES, GRID_THWS): decode, navit resize, pad, normalize, patchify.

A request carries media in prompt order, one `<|media_pad|>` each. A media is either a still image
(one IMAGES entry) or a video chunk of 1..4 frames (that many consecutive IMAGES entries), as the
optional MEDIA_FRAMES input says: one entry per media, 0 for an image, t for a chunk of t frames.
A chunk is planned from its first frame with the per-frame patch limit and every frame is resized
to that size (reference doc §1.7), giving grid (t, h, w) and h*w/4 tokens.

On CPU the resize is Pillow itself (the reference). On a GPU the decoded uint8 frame is uploaded
and resized by `bicubic.resize_bicubic`, which equals Pillow bit for bit.

Decoding (and on CPU the Pillow resize) runs on a few threads, a bounded window of frames ahead of
the one being uploaded: Pillow releases the GIL while it decodes and resizes, so a multi-image
request decodes in parallel, and the values cannot change (each frame is decoded on its own).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from backends.config import MediaConfig
from backends.errors import RequestError
from backends.kernels import patchify as fused_patchify
from backends.preprocess.bicubic import resize_bicubic
from backends.preprocess.decode import decode_rgb, image_size
from backends.preprocess.patchify import normalization_table, pad_normalize_patchify
from backends.preprocess.resize_rule import ResizePlan, navit_resize


@dataclass(frozen=True)
class Limits:
    """Per-request limits (model config parameters). Every violation is a RequestError."""

    max_images: int = 64  # IMAGES entries (frames count one each)
    max_patches: int = 16384 * 8
    max_image_pixels: int = 179_000_000  # Pillow's own hard bomb limit (2 x MAX_IMAGE_PIXELS)


@dataclass(frozen=True)
class MediaPlan:
    plan: ResizePlan
    frames: tuple[int, ...]  # indices into IMAGES
    is_video: bool


def split_media(num_blobs: int, media_frames, media: MediaConfig) -> list[tuple[tuple[int, ...], bool]]:
    """Group IMAGES indices into media from MEDIA_FRAMES (None: every entry is an image)."""
    if media_frames is None:
        return [((i,), False) for i in range(num_blobs)]
    frames = np.asarray(media_frames).reshape(-1)
    if frames.size and not np.issubdtype(frames.dtype, np.integer):
        raise RequestError(f"MEDIA_FRAMES must be integers, got {frames.dtype}")
    limit = media.temporal_merge_kernel_size
    if frames.size and (frames.min() < 0 or frames.max() > limit):
        raise RequestError(f"MEDIA_FRAMES entries must be 0 (image) or 1..{limit} (video chunk frames), "
                           f"got {frames.tolist()}")
    needed = int(np.maximum(frames, 1).sum())
    if needed != num_blobs:
        raise RequestError(f"MEDIA_FRAMES {frames.tolist()} describes {needed} IMAGES entries but {num_blobs} were sent")
    groups, start = [], 0
    for f in frames.tolist():
        n = max(f, 1)
        groups.append((tuple(range(start, start + n)), f > 0))
        start += n
    return groups


def plan_media(blobs: Sequence[bytes], media: MediaConfig, limits: Limits, media_frames=None) -> list[MediaPlan]:
    """Read headers (no pixel decode), plan each media's resize, enforce the request limits."""
    if len(blobs) > limits.max_images:
        raise RequestError(f"{len(blobs)} images in one request exceeds the limit max_images={limits.max_images}")
    plans = []
    for indices, is_video in split_media(len(blobs), media_frames, media):
        # Every frame's header is read (garbage and bombs are refused before decoding); a chunk is
        # planned from its first frame, as the reference does.
        sizes = [image_size(blobs[i], i, max_pixels=limits.max_image_pixels) for i in indices]
        w, h = sizes[0]
        if is_video:
            plan = navit_resize(w, h, media, patch_limit=media.in_patch_limit_each_frame, frames=len(indices))
        else:
            plan = navit_resize(w, h, media)
        plans.append(MediaPlan(plan, indices, is_video))
    total = sum(p.plan.num_patches for p in plans)
    if total > limits.max_patches:
        raise RequestError(f"the request's images need {total} patches, exceeding the limit max_patches={limits.max_patches}")
    return plans


def resize_pillow(img: Image.Image, width: int, height: int) -> Image.Image:
    """The checkpoint's own resize call: Pillow BICUBIC on the uint8 RGB image."""
    if img.size == (width, height):
        return img
    return img.resize((width, height), resample=Image.Resampling.BICUBIC)


# Host decode threads, shared by every Preprocessor in the process, and frames decoded ahead.
DECODE_THREADS = max(1, min(4, (os.cpu_count() or 1)))
DECODE_AHEAD = DECODE_THREADS
_POOL_LOCK = threading.Lock()


class Preprocessor:
    """Stateful only in its normalization table (built once, kept on the target device)."""

    _pool: ThreadPoolExecutor | None = None

    def __init__(self, media: MediaConfig, limits: Limits = Limits(), device: str | torch.device = "cpu",
                 out_dtype: torch.dtype = torch.float32, resize: str | None = None):
        self.media = media
        self.limits = limits
        self.device = torch.device(device)
        self.out_dtype = out_dtype
        # "pillow" on CPU (it is the reference and fast there), "torch" (our exact port) elsewhere.
        self.resize = resize or ("pillow" if self.device.type == "cpu" else "torch")
        if self.resize not in ("pillow", "torch"):
            raise ValueError(f"resize must be 'pillow' or 'torch', got {self.resize!r}")
        self.table = torch.from_numpy(normalization_table(media)).to(self.device)

    def plan(self, blobs: Sequence[bytes], media_frames=None) -> list[MediaPlan]:
        return plan_media(blobs, self.media, self.limits, media_frames)

    def host_frame(self, blob: bytes, index: int, plan: ResizePlan) -> np.ndarray:
        """The host part of a frame (thread-safe; Pillow drops the GIL): decoded, and on the Pillow
        path resized, as an (h, w, 3) uint8 array."""
        img = decode_rgb(blob, index, max_pixels=self.limits.max_image_pixels)
        if self.resize == "pillow":
            img = resize_pillow(img, plan.width, plan.height)
        return np.array(img)  # a writable copy: torch.from_numpy wants one

    def device_frame(self, array: np.ndarray, plan: ResizePlan) -> torch.Tensor:
        """The rest: (h, w, 3) uint8 on the target device, resized."""
        pixels = torch.from_numpy(array)
        if self.resize == "pillow":
            return pixels.to(self.device)
        if self.device.type == "cuda":
            pixels = pixels.pin_memory().to(self.device, non_blocking=True)
        return resize_bicubic(pixels, plan.width, plan.height)

    def frame(self, blob: bytes, index: int, plan: ResizePlan) -> torch.Tensor:
        """One decoded, resized frame: (h, w, 3) uint8 on the target device."""
        return self.device_frame(self.host_frame(blob, index, plan), plan)

    def _frames(self, blobs: Sequence[bytes], plans: list[MediaPlan]):
        """Every frame of every media in order, host work done up to DECODE_AHEAD frames ahead."""
        jobs = [(i, m.plan) for m in plans for i in m.frames]
        if len(jobs) <= 1:
            yield from (self.frame(blobs[i], i, plan) for i, plan in jobs)
            return
        with _POOL_LOCK:  # concurrent first calls must not each start a pool (idle threads never exit)
            if Preprocessor._pool is None:
                Preprocessor._pool = ThreadPoolExecutor(max_workers=DECODE_THREADS, thread_name_prefix="kimi-decode")
        pending: deque = deque()
        try:
            for n, (i, plan) in enumerate(jobs):
                # Bounded: at most DECODE_AHEAD decoded frames wait in memory.
                while len(pending) < DECODE_AHEAD and n + len(pending) < len(jobs):
                    j, p = jobs[n + len(pending)]
                    pending.append(Preprocessor._pool.submit(self.host_frame, blobs[j], j, p))
                yield self.device_frame(pending.popleft().result(), plan)
        finally:
            for f in pending:  # a failed frame: do not decode the rest
                f.cancel()

    def __call__(self, blobs: Sequence[bytes], media_frames=None) -> tuple[torch.Tensor, np.ndarray, list[MediaPlan]]:
        """Returns pixel_values (N, 3, p, p) on `device`, grid_thws (M, 3) int64 on the host, plans."""
        plans = self.plan(blobs, media_frames)
        chunks = []
        # closing: if a later step fails, the frames decoded ahead are cancelled now, not at some
        # garbage collection (the traceback keeps this frame, and so the generator, alive).
        with contextlib.closing(self._frames(blobs, plans)) as frames_in_order:
            for m in plans:
                frames = [next(frames_in_order) for _ in m.frames]
                pixels = frames[0] if len(frames) == 1 and not m.is_video else torch.stack(frames)
                if fused_patchify.can_use(pixels):  # one kernel on the GPU, same values as the torch reference
                    chunks.append(fused_patchify.normalize_patchify(pixels, m.plan, self.table, self.out_dtype))
                else:
                    chunks.append(pad_normalize_patchify(pixels, m.plan, self.table, self.out_dtype))
        p = self.media.patch_size
        pixel_values = torch.cat(chunks) if chunks else torch.empty((0, 3, p, p), dtype=self.out_dtype, device=self.device)
        grid_thws = np.asarray([m.plan.grid_thw for m in plans], dtype=np.int64).reshape(-1, 3)
        return pixel_values, grid_thws, plans
