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
from backends.preprocess.resize_rule import ResizePlan, largest_padded_patches, navit_resize


@dataclass(frozen=True)
class MediaPlan:
    plan: ResizePlan
    frames: tuple[int, ...]  # indices into IMAGES
    is_video: bool


def largest_media_patches(media: MediaConfig) -> int:
    """The most patches one media can bring to the encoder: an image, or a video chunk of the most frames
    (each planned with the per-frame budget). 21,408 for K2.5's config (a 4-frame chunk; an image at most
    17,856), which is where the encoder's CUDA-graph buckets end."""
    return max(largest_padded_patches(media),
               media.temporal_merge_kernel_size * largest_padded_patches(media, media.in_patch_limit_each_frame))


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


def image_count_error(num_blobs: int, limits: Limits) -> RequestError | None:
    if num_blobs > limits.max_images:
        return RequestError(f"{num_blobs} images in one request exceeds the limit max_images={limits.max_images}",
                            "image_count_limit")
    return None


def check_image_count(num_blobs: int, limits: Limits) -> None:
    # Raised as made, never held in a local: a raised error's traceback holds this frame, and a frame
    # holding the error makes a cycle that keeps the request's data alive until the cycle collector runs.
    if image_count_error(num_blobs, limits) is not None:
        raise image_count_error(num_blobs, limits)


def image_bytes_error(sizes: Sequence[int], limits: Limits) -> RequestError | None:
    """The error for IMAGES entries of these byte lengths, in the order checked (count, each image,
    the request's total), or None. From the lengths alone: nothing is read or copied to find it (the
    stub's unpacking of BYTES inputs asks this before it copies anything: backends/serving/bytes_inputs.py)."""
    error = image_count_error(len(sizes), limits)
    if error is not None:
        return error
    for i, n in enumerate(sizes):
        if n > limits.max_image_bytes:
            return RequestError(f"image {i}: {n} bytes exceeds the limit max_image_bytes={limits.max_image_bytes}",
                                "image_bytes_limit")
    total = sum(sizes)
    if total > limits.max_request_bytes:
        return RequestError(f"the request's {len(sizes)} images are {total} bytes in all, exceeding the limit "
                            f"max_request_bytes={limits.max_request_bytes}", "request_bytes_limit")
    return None


def _nbytes(blob) -> int:
    """An entry's byte length (a memoryview of any shape by its bytes; anything else is refused later, by
    open_image, as missing image bytes)."""
    if isinstance(blob, memoryview):
        return blob.nbytes
    return len(blob) if isinstance(blob, (bytes, bytearray)) else 0


def check_image_bytes(blobs: Sequence, limits: Limits) -> None:
    """Refuse too many IMAGES entries, or too many bytes in one or in all, before any is read."""
    sizes = [_nbytes(b) for b in blobs]
    if image_bytes_error(sizes, limits) is not None:  # raised as made (check_image_count says why)
        raise image_bytes_error(sizes, limits)


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
