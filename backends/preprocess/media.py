"""Which IMAGES entries form which media, and where each media goes: the request's resize plans.

A request carries media in prompt order, one `<|media_pad|>` each. A media is either a still image
(one IMAGES entry) or a video chunk of 1..4 frames (that many consecutive IMAGES entries), as the
optional MEDIA_FRAMES input says: one entry per media, 0 for an image, t for a chunk of t frames.
A chunk is planned from its first frame with the per-frame patch limit and every frame is resized to
that size (docs/kimi_k25.md#video-chunks), giving grid (t, h, w) and h*w/4 tokens.

Pure arithmetic on image sizes (read from headers by the caller), so the placeholder step and the
preprocessing step plan identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from backends.config import Limits, MediaConfig
from backends.errors import RequestError
from backends.preprocess.resize_rule import ResizePlan, navit_resize


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
        raise RequestError(f"MEDIA_FRAMES must be integers, got {frames.dtype}", "media_frames")
    limit = media.temporal_merge_kernel_size
    if frames.size and (frames.min() < 0 or frames.max() > limit):
        raise RequestError(f"MEDIA_FRAMES entries must be 0 (image) or 1..{limit} (video chunk frames), "
                           f"got {frames.tolist()}", "media_frames")
    needed = int(np.maximum(frames, 1).sum())
    if needed != num_blobs:
        raise RequestError(f"MEDIA_FRAMES {frames.tolist()} describes {needed} IMAGES entries but {num_blobs} were sent",
                           "media_frames")
    groups, start = [], 0
    for f in frames.tolist():
        n = max(f, 1)
        groups.append((tuple(range(start, start + n)), f > 0))
        start += n
    return groups


def check_image_count(num_blobs: int, limits: Limits) -> None:
    if num_blobs > limits.max_images:
        raise RequestError(f"{num_blobs} images in one request exceeds the limit max_images={limits.max_images}",
                           "image_count_limit")


def plan_media(sizes: Sequence[tuple[int, int]], media: MediaConfig, limits: Limits, media_frames=None) -> list[MediaPlan]:
    """Plan each media's resize from every IMAGES entry's (width, height); enforce the request limits."""
    check_image_count(len(sizes), limits)
    plans = []
    for indices, is_video in split_media(len(sizes), media_frames, media):
        w, h = sizes[indices[0]]  # a chunk is planned from its first frame, as the reference does
        if is_video:
            plan = navit_resize(w, h, media, patch_limit=media.in_patch_limit_each_frame, frames=len(indices))
        else:
            plan = navit_resize(w, h, media)
        plans.append(MediaPlan(plan, indices, is_video))
    total = sum(p.plan.num_patches for p in plans)
    if total > limits.max_patches:
        raise RequestError(f"the request's images need {total} patches, exceeding the limit max_patches={limits.max_patches}",
                           "patch_limit")
    return plans
