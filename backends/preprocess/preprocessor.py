"""Encoded images -> (PIXEL_VALUES, GRID_THWS): decode, navit resize, pad, normalize, patchify.

Each image is opened once: its header gives the size for the plan (media.py), and the same handle is
decoded. On CPU the resize is Pillow itself (the reference). On a GPU, JPEGs that the exact GPU path
reproduces are decoded there (jpeg_gpu.py: nvJPEG's hardware decoder + libjpeg-turbo's upsampling
and colour conversion), everything else by Pillow and uploaded; then `bicubic.resize_bicubic`, which
equals Pillow bit for bit, and one Triton kernel that pads, normalizes and patchifies
(kernels/patchify.py). Consecutive JPEGs of one size and sampling (eight 448^2 photos, or grayscale
ones) come out of the GPU decoder as one tensor and, when their plan needs no resize, are patchified in one launch: on the GPU
path a request of small images costs kernel launches more than kernel time.

Pillow decoding (and on CPU the Pillow resize) runs on a few threads, a bounded window of frames ahead
of the one being uploaded: Pillow releases the GIL while it decodes and resizes, so a multi-image
request decodes in parallel, and the values cannot change (each frame is decoded on its own).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, deque
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from backends.config import Limits, MediaConfig
from backends.errors import RequestCancelled
from backends.kernels import patchify
from backends.preprocess.bicubic import resize_bicubic
from backends.preprocess import host_threads
from backends.preprocess.decode import HeaderOnly, decode_rgb, open_image
from backends.preprocess.jpeg_gpu import GpuJpegDecoder
from backends.preprocess.media import MediaPlan, check_image_count, plan_media
from backends.preprocess.normalize import normalization_table
from backends.preprocess.resize_rule import ResizePlan
from backends.preprocess.views import spacing, stacked

log = logging.getLogger("kimi_vision.preprocess")


def _pixels(img: Image.Image) -> int:
    return img.size[0] * img.size[1]


def resize_pillow(img: Image.Image, width: int, height: int) -> Image.Image:
    """The checkpoint's own resize call: Pillow BICUBIC on the uint8 RGB image."""
    if img.size == (width, height):
        return img
    return img.resize((width, height), resample=Image.Resampling.BICUBIC)


# Frames decoded ahead on the host threads (host_threads.py, shared by every Preprocessor in the process).
DECODE_AHEAD = host_threads.THREADS
# Decoded pixels one batched GPU decode may hold at once (a request may carry 64 huge JPEGs).
GPU_DECODE_PIXELS = 64 << 20


def open_images(blobs: Sequence[bytes], limits: Limits) -> list[Image.Image | HeaderOnly]:
    """Every image's header, nothing decoded: too many images, garbage and bombs are refused here
    (kimi_placeholder called with IMAGES needs no more than this)."""
    check_image_count(len(blobs), limits)
    return [open_image(b, i, limits.max_image_pixels) for i, b in enumerate(blobs)]


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """b is a contiguous frame of a's shape that starts where a ends, in the same tensor (the GPU decoder
    converts a run of same-sized JPEGs into one): patchified together they are one contiguous batch."""
    return a.is_contiguous() and spacing(a, b) == a.numel()


def _joined(frames: list[torch.Tensor]) -> torch.Tensor:
    """One frame as it is; a run of back-to-back frames as a (T, H, W, 3) view of the memory they share.
    Patchified t-major, the run gives each image's patches in order, as patchifying one by one would."""
    return frames[0] if len(frames) == 1 else stacked(frames, frames[0].numel())


class Preprocessor:
    """Holds what is built once: the normalization table on the target device, and on a GPU the exact
    JPEG decoder (its nvJPEG handle and its decode counters)."""

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
        # Exact GPU JPEG decoding where there is a GPU (None: on unless KIMI_GPU_JPEG says off; self-checked).
        self.jpeg = GpuJpegDecoder(self.device, gpu_jpeg) if self.device.type == "cuda" and gpu_jpeg is not False else None

        self._host_only = Counter()  # decode_stats without a GPU

    @property
    def decode_stats(self) -> Counter:
        """(path, reason) -> images decoded since start: ("gpu", "") or ("pillow", why)."""
        return self.jpeg.stats if self.jpeg is not None else self._host_only

    def open(self, blobs: Sequence[bytes]) -> list[Image.Image | HeaderOnly]:
        return open_images(blobs, self.limits)

    def plan(self, images: Sequence[Image.Image], media_frames=None) -> list[MediaPlan]:
        return plan_media([img.size for img in images], self.media, self.limits, media_frames)

    def host_frame(self, img: Image.Image, index: int, plan: ResizePlan) -> np.ndarray:
        """The host part of a frame (thread-safe; Pillow drops the GIL): decoded, and on the Pillow
        path resized, as an (h, w, 3) uint8 array."""
        rgb = decode_rgb(img, index)
        if self.resize == "pillow":
            rgb = resize_pillow(rgb, plan.width, plan.height)
        return np.array(rgb)  # a writable copy: torch.from_numpy wants one

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        """A host frame (h, w, 3) uint8 onto the target device."""
        pixels = torch.from_numpy(array)
        if self.device.type == "cuda":
            return pixels.pin_memory().to(self.device, non_blocking=True)
        return pixels.to(self.device)

    def _resize(self, pixels: torch.Tensor, plan: ResizePlan) -> torch.Tensor:
        """(h, w, 3) uint8 on the device at the plan's size (Pillow already resized on its path)."""
        if tuple(pixels.shape[:2]) == (plan.height, plan.width):
            return pixels
        return resize_bicubic(pixels, plan.width, plan.height)

    def _frames(self, blobs: Sequence[bytes], images: Sequence[Image.Image], plans: list[MediaPlan],
                pending: dict, forced: dict, early: dict):
        """Every frame of every media in order, on the device and resized. JPEGs the GPU path takes are
        decoded there in batches of up to GPU_DECODE_PIXELS, their scan checks left in `pending` (image
        index -> pending verdict, scan_check.Pending); the rest by Pillow, up to DECODE_AHEAD frames ahead, `forced` (image index ->
        the scan check's reason, already counted) among them."""
        jobs = [(i, m.plan) for m in plans for i in m.frames]
        on_gpu = set()
        if self.jpeg is None:
            self._host_only[("pillow", "no_gpu")] += len(jobs)
        else:
            for i, _ in jobs:
                if i in forced:
                    continue
                why = self.jpeg.reason(images[i])
                if why is None:
                    on_gpu.add(i)
                else:
                    self.jpeg.stats[("pillow", why)] += 1
        decoded: dict[int, torch.Tensor | None] = {}
        host = self._host_frames([(i, plan) for i, plan in jobs if i not in on_gpu], images)
        try:
            for n, (i, plan) in enumerate(jobs):
                if i in on_gpu and i not in decoded:
                    group, pixels = [], 0
                    for j, _ in jobs[n:]:
                        if j in on_gpu and j not in decoded and (not group or pixels + _pixels(images[j]) <= GPU_DECODE_PIXELS):
                            group.append(j)
                            pixels += _pixels(images[j])
                    try:
                        rgbs, checks = self.jpeg.decode_async([blobs[j] for j in group], [images[j] for j in group],
                                                              [early.get(j) for j in group])
                        decoded.update(zip(group, rgbs))
                        pending.update((group[k], check) for k, check in checks.items())
                    except Exception:  # noqa: BLE001 - e.g. nvJPEG rejects a corrupt file: Pillow decides
                        log.warning("GPU JPEG decode failed for images %s; decoding them with Pillow", group, exc_info=True)
                        self.jpeg.stats[("pillow", "gpu_error")] += len(group)
                        decoded.update((j, None) for j in group)
                rgb = decoded.pop(i, None) if i in on_gpu else None
                if rgb is None and i in on_gpu:  # the hardware decoder refused it: Pillow, here
                    rgb = self._upload(self.host_frame(images[i], i, plan))
                elif rgb is None:
                    rgb = next(host)
                rgb = self._resize(rgb, plan)
                yield rgb
        finally:
            host.close()

    def _host_frames(self, jobs, images: Sequence[Image.Image]):
        """Pillow-decoded frames of `jobs` in order, as device tensors, the host work done up to
        DECODE_AHEAD frames ahead on the decode threads."""
        if len(jobs) <= 1:
            yield from (self._upload(self.host_frame(images[i], i, plan)) for i, plan in jobs)
            return
        threads = host_threads.pool()
        pending: deque = deque()
        try:
            for n, (i, plan) in enumerate(jobs):
                # Bounded: at most DECODE_AHEAD decoded frames wait in memory.
                while len(pending) < DECODE_AHEAD and n + len(pending) < len(jobs):
                    j, p = jobs[n + len(pending)]
                    pending.append(threads.submit(self.host_frame, images[j], j, p))
                yield self._upload(pending.popleft().result())
        finally:
            for f in pending:  # a failed frame: do not decode the rest
                f.cancel()

    def __call__(self, blobs: Sequence[bytes], media_frames=None, cancelled=None) -> tuple[torch.Tensor, np.ndarray, list[MediaPlan]]:
        """Returns pixel_values (N, 3, p, p) on `device`, grid_thws (M, 3) int64 on the host, plans.
        `cancelled()`, if given, is asked before each media: True raises RequestCancelled.

        GPU-decoded JPEGs are provisional until their scan checks (run meanwhile on the scan check's
        own C threads) come back, at the end: if one refuses an image, the request is computed again with that image
        on Pillow. Damaged files are rare, so the common request pays for its checks only where they
        outlast the rest of its preprocessing."""
        # The scan checks start before the headers are read (on this thread), so that they have as long
        # as possible to finish beside the rest; a pass done again reuses their answers.
        early = self.jpeg.start_checks(blobs, self.limits.max_image_pixels) if self.jpeg is not None else {}
        try:
            return self._checked(blobs, media_frames, cancelled, early)
        finally:
            for verdict in early.values():  # those the decode never asked for (a PNG-like JPEG, an error)
                verdict.cancel()

    def _checked(self, blobs, media_frames, cancelled, early: dict):
        images = self.open(blobs)
        plans = self.plan(images, media_frames)
        forced: dict[int, str] = {}
        while True:  # twice at most: a file's check gives the same answer every time
            pending: dict = {}
            counted = Counter(self.decode_stats)  # a pass done again is counted once
            try:
                result = self._compute(blobs, images, plans, cancelled, pending, forced, early)
            except BaseException:
                for verdict in pending.values():  # the request failed: its checks are not wanted
                    verdict.cancel()
                raise
            verdicts = self.jpeg.settle(pending) if pending else {}
            refused = {i: why for i, why in verdicts.items() if why is not None}
            if not refused:
                if verdicts:
                    self.jpeg.count(verdicts)
                return (*result, plans)
            del result  # before the next pass allocates its own
            log.info("images %s go to Pillow after their scan checks (%s); preprocessing the request again",
                     sorted(refused), ", ".join(sorted(set(refused.values()))))
            self.decode_stats.clear()
            self.decode_stats.update(counted)
            self.jpeg.count(refused)  # the next pass leaves them out of its routing and its counts
            forced.update(refused)

    def _compute(self, blobs, images, plans, cancelled, pending: dict, forced: dict,
                 early: dict) -> tuple[torch.Tensor, np.ndarray]:
        """pixel_values and grid_thws (see __call__), GPU decodes' scan checks left in `pending`."""
        chunks = []
        # closing: if a later step fails, the frames decoded ahead are cancelled now, not at some
        # garbage collection (the traceback keeps this frame, and so the generator, alive).
        with contextlib.closing(self._frames(blobs, images, plans, pending, forced, early)) as frames_in_order:
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
        grid_thws = np.asarray([m.plan.grid_thw for m in plans], dtype=np.int64).reshape(-1, 3)
        return pixel_values, grid_thws

    def _patchify(self, pixels: torch.Tensor, plan: ResizePlan) -> torch.Tensor:
        if tuple(pixels.shape[-3:]) != (plan.height, plan.width, 3):
            raise ValueError(f"expected {plan.height}x{plan.width}x3 pixels for this plan, got {tuple(pixels.shape)}")
        args = (pixels, self.table, plan.patch_size, plan.padded_height, plan.padded_width, self.out_dtype)
        if patchify.can_use(pixels):  # one kernel on the GPU, same values as the torch reference
            out = patchify.normalize_patchify(*args)
        else:
            out = patchify.pad_normalize_patchify(*args)
        return out
