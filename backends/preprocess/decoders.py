"""What the Preprocessor asks of a decoder, and the decoder that takes every image: Pillow.

A Preprocessor holds its decoders in line, the exact GPU JPEG decoder (jpeg_gpu.py) first where there
is one and Pillow last. Per request, `start` gives each decoder's part of it (a `Decoding`); each frame
goes to the first that takes it (`refusal` is None), and each decodes its frames in order
(`frames`) to device RGB uint8 (H, W, 3) tensors. A decoder may give a frame back while decoding it
(None in its place: Pillow decodes it then), and its answers may be provisional until `settle`, which
names the images it takes back: the Preprocessor then computes the request again with them refused.

Counting, in the Counter every decoder of one Preprocessor shares (its decode_stats, (path, reason) ->
images): a frame is counted once its decoder's answer is final, by that decoder. Pillow counts its
frames when they are routed to it, under the reason the decoder ahead of it gave ("no_gpu" where none
was asked); the GPU JPEG decoder counts what it gives back, and its own frames once settled.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from PIL import Image

from backends.preprocess import host_threads
from backends.preprocess.decode import HeaderOnly, decode_rgb
from backends.preprocess.resize_rule import ResizePlan

# Frames decoded ahead on the host threads (host_threads.py, shared by every Preprocessor in the process).
DECODE_AHEAD = host_threads.THREADS


@dataclass(frozen=True)
class Frame:
    """One frame of the request, as routed to a decoder."""

    index: int  # its place in IMAGES
    image: Image.Image | HeaderOnly  # its opened handle (decode.open_image)
    plan: ResizePlan  # its media's resize plan
    why: str | None = None  # why the decoders ahead of the one it went to did not take it (None: none asked)


class Decoding(Protocol):
    """One decoder's part of one request."""

    def refusal(self, index: int, image) -> str | None:
        """None if this decoder takes image `index`, else why not (a decode_stats reason)."""

    def frames(self, frames: Sequence[Frame]) -> Generator[torch.Tensor | None, None, None]:
        """The frames routed to it, decoded in order to device RGB uint8 (H, W, 3) as they are pulled;
        None for a frame it gives back (counted by it): Pillow decodes that one."""

    def settle(self) -> dict[int, str]:
        """After a pass over the request: {image: why} for the answers it takes back ({} where all stand)."""

    def close(self) -> None:
        """The request is over: what it still runs for the request is not wanted."""


class Decoder(Protocol):
    name: str  # its path in decode_stats

    def start(self, blobs: Sequence[bytes], max_pixels: int) -> Decoding:
        """Its part of a request over `blobs`, begun before their headers are read."""


def resize_pillow(img: Image.Image, width: int, height: int) -> Image.Image:
    """The checkpoint's own resize call: Pillow BICUBIC on the uint8 RGB image."""
    if img.size == (width, height):
        return img
    return img.resize((width, height), resample=Image.Resampling.BICUBIC)


class PillowDecoder:
    """`Image.open(...).convert("RGB")` on the host threads, up to DECODE_AHEAD frames ahead of the one
    uploaded (Pillow drops the GIL while it decodes, and each frame is decoded on its own, so the
    values cannot change); with `resize_on_host` (on CPU, where Pillow is the reference and fast) also
    Pillow's resize to the plan's size. It takes every image and keeps nothing per request: it is its
    own Decoding."""

    name = "pillow"

    def __init__(self, device: torch.device, resize_on_host: bool, stats: Counter):
        self.device, self.resize_on_host, self.stats = torch.device(device), resize_on_host, stats

    def start(self, blobs, max_pixels: int) -> "PillowDecoder":
        return self

    def refusal(self, index: int, image) -> str | None:
        return None

    def settle(self) -> dict[int, str]:
        return {}

    def close(self) -> None:
        pass

    def frames(self, frames: Sequence[Frame]) -> Generator[torch.Tensor, None, None]:
        """Counted now (their answers are final), decoded as they are pulled."""
        self.stats.update((self.name, f.why or "no_gpu") for f in frames)
        return self._ahead(list(frames))

    def frame(self, f: Frame) -> torch.Tensor:
        """One frame, decoded on this thread and not counted: one a decoder ahead gave back (it counted it)."""
        return self._upload(self.host_frame(f))

    def host_frame(self, f: Frame) -> np.ndarray:
        """The host part of a frame (thread-safe; Pillow drops the GIL): decoded, and with resize_on_host
        resized, as an (h, w, 3) uint8 array."""
        rgb = decode_rgb(f.image, f.index)
        if self.resize_on_host:
            rgb = resize_pillow(rgb, f.plan.width, f.plan.height)
        return np.array(rgb)  # a writable copy: torch.from_numpy wants one

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        """A host frame (h, w, 3) uint8 onto the device."""
        pixels = torch.from_numpy(array)
        if self.device.type == "cuda":
            return pixels.pin_memory().to(self.device, non_blocking=True)
        return pixels.to(self.device)

    def _ahead(self, frames: list[Frame]) -> Generator[torch.Tensor, None, None]:
        """`frames` in order as device tensors, the host work done up to DECODE_AHEAD frames ahead on the
        host threads."""
        if len(frames) <= 1:
            yield from (self.frame(f) for f in frames)
            return
        threads = host_threads.pool()
        pending: deque = deque()
        try:
            for n in range(len(frames)):
                # Bounded: at most DECODE_AHEAD decoded frames wait in memory.
                while len(pending) < DECODE_AHEAD and n + len(pending) < len(frames):
                    pending.append(threads.submit(self.host_frame, frames[n + len(pending)]))
                yield self._upload(pending.popleft().result())
        finally:
            for f in pending:  # a failed frame: do not decode the rest
                f.cancel()
