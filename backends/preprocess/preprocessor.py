"""Encoded images -> (PIXEL_VALUES, GRID_THWS): decode, navit resize, pad, normalize, patchify.

The orchestrator. Each image is opened once: its header gives the size for the plan (media.py), and
the same handle is decoded. Each frame goes to the first decoder in line that takes it (decoders.py):
on a GPU the exact GPU JPEG decoder (jpeg_gpu.py: nvJPEG's hardware decoder + libjpeg-turbo's
upsampling and colour conversion) for the JPEGs it reproduces, Pillow for everything else (decoded on
the host threads a bounded window ahead, uploaded; on CPU also resized by Pillow, the reference). Then
`bicubic.resize_bicubic`, which equals Pillow bit for bit, and one Triton kernel that pads, normalizes
and patchifies (kernels/patchify.py). Consecutive JPEGs of one size and sampling (eight 448^2 photos,
or grayscale ones) come out of the GPU decoder as one tensor and, when their plan needs no resize, are
patchified in one launch: on the GPU path a request of small images costs kernel launches more than
kernel time.

A decoder's answers may be provisional (the GPU JPEG decoder's, until their scan checks are in): if one
takes an image back once the request is computed, the request is computed again with that image on
Pillow.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from PIL import Image

from backends.config import Limits, MediaConfig
from backends.errors import RequestCancelled
from backends.kernels import patchify
from backends.preprocess.bicubic import resize_bicubic
from backends.preprocess.decode import HeaderOnly, open_image
from backends.preprocess.decoders import Decoder, Decoding, Frame, PillowDecoder
from backends.preprocess.jpeg_gpu import GpuJpegDecoder
from backends.preprocess.media import MediaPlan, check_image_bytes, plan_media
from backends.preprocess.normalize import normalization_table
from backends.preprocess.resize_rule import ResizePlan
from backends.preprocess.views import spacing, stacked

log = logging.getLogger("kimi_vision.preprocess")


def open_images(blobs: Sequence[bytes], limits: Limits) -> list[Image.Image | HeaderOnly]:
    """Every image's header, nothing decoded: too many images, too many bytes, garbage and bombs are
    refused here (kimi_placeholder called with IMAGES needs no more than this)."""
    check_image_bytes(blobs, limits)
    return [open_image(b, i, limits.max_image_pixels) for i, b in enumerate(blobs)]


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """b is a contiguous frame of a's shape that starts where a ends, in the same tensor (the GPU decoder
    converts a run of same-sized JPEGs into one): patchified together they are one contiguous batch."""
    return a.is_contiguous() and spacing(a, b) == a.numel()


def _joined(frames: list[torch.Tensor]) -> torch.Tensor:
    """One frame as it is; a run of back-to-back frames as a (T, H, W, 3) view of the memory they share.
    Patchified t-major, the run gives each image's patches in order, as patchifying one by one would."""
    return frames[0] if len(frames) == 1 else stacked(frames, frames[0].numel())


def route(decodings: Sequence[Decoding], frames: Sequence[Frame]) -> list[tuple[int, Frame]]:
    """Each frame with the place in line of the first decoder that takes it, its `why` set to the first
    refusal (None where that decoder was the first asked)."""
    routed = []
    for f in frames:
        why = None
        for n, d in enumerate(decodings):
            refusal = d.refusal(f.index, f.image)
            if refusal is None:
                routed.append((n, replace(f, why=why)))
                break
            why = why or refusal
        else:
            raise RuntimeError(f"no decoder takes image {f.index} ({why})")  # Pillow, last, takes every one
    return routed


class Preprocessor:
    """Holds what is built once: the normalization table on the target device, and its decoders in
    line (on a GPU the exact JPEG decoder, with its nvJPEG handle, then Pillow), which count the images
    they decode in `decode_stats`: (path, reason) -> images, ("gpu", "") or ("pillow", why)."""

    def __init__(self, media: MediaConfig, limits: Limits = Limits(), device: str | torch.device = "cpu",
                 out_dtype: torch.dtype = torch.float32, resize: str | None = None, gpu_jpeg: bool | None = None):
        self.media = media
        self.limits = limits
        self.device = torch.device(device)
        self.out_dtype = out_dtype
        # "pillow" on CPU (it is the reference and fast there), "torch" (our exact port) elsewhere.
        self.resize = resize or ("pillow" if self.device.type == "cpu" else "torch")
        if self.resize not in ("pillow", "torch"):
            raise ValueError(f"resize must be 'pillow' or 'torch', got {self.resize!r}")
        self.table = torch.from_numpy(normalization_table(media)).to(self.device)
        self.decode_stats: Counter = Counter()
        # Exact GPU JPEG decoding where there is a GPU (None: on unless KIMI_GPU_JPEG says off; self-checked).
        jpeg = (GpuJpegDecoder(self.device, gpu_jpeg, self.decode_stats)
                if self.device.type == "cuda" and gpu_jpeg is not False else None)
        self.pillow = PillowDecoder(self.device, self.resize == "pillow", self.decode_stats)
        self.decoders: list[Decoder] = [d for d in (jpeg, self.pillow) if d is not None]

    @property
    def jpeg(self) -> GpuJpegDecoder | None:
        """The exact GPU JPEG decoder, if there is one (on or off)."""
        return next((d for d in self.decoders if isinstance(d, GpuJpegDecoder)), None)

    def open(self, blobs: Sequence[bytes]) -> list[Image.Image | HeaderOnly]:
        return open_images(blobs, self.limits)

    def plan(self, images: Sequence[Image.Image], media_frames=None) -> list[MediaPlan]:
        return plan_media([img.size for img in images], self.media, self.limits, media_frames)

    def _resize(self, pixels: torch.Tensor, plan: ResizePlan) -> torch.Tensor:
        """(h, w, 3) uint8 on the device at the plan's size (Pillow already resized on its path)."""
        if tuple(pixels.shape[:2]) == (plan.height, plan.width):
            return pixels
        return resize_bicubic(pixels, plan.width, plan.height)

    def _frames(self, decodings: Sequence[Decoding], images: Sequence[Image.Image], plans: list[MediaPlan]):
        """Every frame of every media in order, on the device and resized: routed (route()), each decoder
        decoding its own frames in order as they are wanted. A frame a decoder gives back is decoded by
        Pillow, here."""
        routed = route(decodings, [Frame(i, images[i], m.plan) for m in plans for i in m.frames])
        streams = [d.frames([f for k, f in routed if k == n]) for n, d in enumerate(decodings)]
        try:
            for n, f in routed:
                rgb = next(streams[n])
                if rgb is None:  # given back (and counted) by its decoder
                    rgb = self.pillow.frame(f)
                yield self._resize(rgb, f.plan)
        finally:
            for stream in streams:
                stream.close()

    def __call__(self, blobs: Sequence[bytes], media_frames=None, cancelled=None,
                 skip: frozenset[int] = frozenset()) -> tuple[torch.Tensor, np.ndarray, list[MediaPlan]]:
        """Returns pixel_values (N, 3, p, p) on `device`, grid_thws (M, 3) int64 on the host, plans.
        `cancelled()`, if given, is asked before each media: True raises RequestCancelled. The media
        numbered in `skip` (the encoder holds their rows: backends/cache) are planned from their headers
        but not decoded: pixel_values holds the other media's patches, in order; grid_thws and plans hold
        every media's.

        The decoders start their part of the request before the headers are read (the GPU JPEG decoder
        its scan checks, which then run on their own C threads beside the rest). An image a decoder takes
        back at the end (a scan check refused it) makes the request computed again with it on Pillow.
        Damaged files are rare, so the common request pays for its checks only where they outlast the
        rest of its preprocessing."""
        decodings: list[Decoding] = []
        try:
            for d in self.decoders:
                decodings.append(d.start(blobs, self.limits.max_image_pixels))
            return self._passes(decodings, blobs, media_frames, cancelled, skip)
        finally:
            for d in decodings:
                d.close()

    def _passes(self, decodings: Sequence[Decoding], blobs, media_frames, cancelled, skip):
        images = self.open(blobs)
        plans = self.plan(images, media_frames)
        wanted = [m for n, m in enumerate(plans) if n not in skip]
        grid_thws = np.asarray([m.plan.grid_thw for m in plans], dtype=np.int64).reshape(-1, 3)
        while True:  # twice at most: a file's check gives the same answer every time
            counted = Counter(self.decode_stats)  # a pass done again is counted once
            result = self._compute(decodings, images, wanted, cancelled)
            refused = {}
            for d in decodings:
                refused.update(d.settle())
            if not refused:
                return result, grid_thws, plans
            del result  # before the next pass allocates its own
            log.info("images %s go to Pillow after their scan checks (%s); preprocessing the request again",
                     sorted(refused), ", ".join(sorted(set(refused.values()))))
            self.decode_stats.clear()
            self.decode_stats.update(counted)  # the next pass routes and counts them anew

    def _compute(self, decodings, images, plans, cancelled) -> torch.Tensor:
        """pixel_values of `plans`' media (see __call__); provisional answers not yet settled."""
        chunks = []
        # closing: if a later step fails, the frames decoded ahead are cancelled now, not at some
        # garbage collection (the traceback keeps this frame, and so the generator, alive).
        with contextlib.closing(self._frames(decodings, images, plans)) as frames_in_order:
            run: list[torch.Tensor] = []  # still images with one plan, back to back in one tensor
            for n, m in enumerate(plans):
                if cancelled is not None and cancelled():
                    raise RequestCancelled(f"cancelled by the client after {n} of {len(plans)} media")
                # Pulling frames runs _frames up to its next yield: decode (and resize) marks come from there.
                frames = [next(frames_in_order) for _ in m.frames]
                if not m.is_video and run and plans[n - 1].plan == m.plan and _follows(run[-1], frames[0]):
                    run.append(frames[0])  # patchified with the run: one launch, same patches in order
                    continue
                if run:
                    chunks.append(self._patchify(_joined(run), plans[n - 1].plan))
                    run = []
                if m.is_video:
                    chunks.append(self._patchify(torch.stack(frames), m.plan))
                else:
                    run = [frames[0]]
            if run:
                chunks.append(self._patchify(_joined(run), plans[-1].plan))
        p = self.media.patch_size
        if len(chunks) == 1:  # e.g. one image, or one run of same-sized JPEGs: no copy
            pixel_values = chunks[0]
        else:
            pixel_values = torch.cat(chunks) if chunks else torch.empty((0, 3, p, p), dtype=self.out_dtype, device=self.device)
        return pixel_values

    def _patchify(self, pixels: torch.Tensor, plan: ResizePlan) -> torch.Tensor:
        if tuple(pixels.shape[-3:]) != (plan.height, plan.width, 3):
            raise ValueError(f"expected {plan.height}x{plan.width}x3 pixels for this plan, got {tuple(pixels.shape)}")
        args = (pixels, self.table, plan.patch_size, plan.padded_height, plan.padded_width, self.out_dtype)
        if patchify.can_use(pixels):  # one kernel on the GPU, same values as the torch reference
            out = patchify.normalize_patchify(*args)
        else:
            out = patchify.pad_normalize_patchify(*args)
        return out
