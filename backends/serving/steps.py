"""What each Triton model does, as plain Python over numpy/torch: testable without a server.

The adapters in `backends.serving.triton_models` only convert tensors and map RequestError to a
per-request error response.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backends.config import Limits, VisionConfig
from backends.encoder.cache import cache_version, cached_tensors, held_bytes
from backends.encoder.metadata import as_grid_list, check_pixels
from backends.errors import RequestError
from backends.placeholder.expand import check_one_placeholder_per_image, expand_placeholders
from backends.preprocess.media import plan_media, split_media
from backends.preprocess.preprocessor import Preprocessor, open_images
from contract import EXPANDED_IDS, GRID_THWS, IMAGE_TOKEN_COUNTS, PIXEL_VALUES

log = logging.getLogger(__name__)


def throttled(ask, every_s: float, clock=time.monotonic):
    """`ask` wrapped so that it is really asked at most once per `every_s` (the first time `every_s`
    after this call); in between the answer is False. For request.is_cancelled(), a round trip from
    the stub to the server: asked before every media of an 8-image request it cost
    more than the check is worth, while a request that runs long is still stopped within `every_s`."""
    last = clock()

    def check() -> bool:
        nonlocal last
        now = clock()
        if now - last < every_s:
            return False
        last = now
        return bool(ask())

    return check


def check_prompt(input_ids, cfg: VisionConfig, num_media: int, media_frames=None) -> np.ndarray:
    """The 1:1 rule (one `<|media_pad|>` per media) from the prompt and the media count alone, before
    any image byte is read; returns the ids as int64. The same check and wording in both steps."""
    what = "image(s)" if media_frames is None else "media (images or video chunks)"
    return check_one_placeholder_per_image(input_ids, cfg.tokens.media_pad, num_media, what=what)


def _num_media(num_images: int, media_frames, cfg: VisionConfig) -> int:
    return len(split_media(num_images, media_frames, cfg.media))


class PlaceholderStep:
    """INPUT_IDS + (IMAGE_TOKEN_COUNTS, or IMAGES [+ MEDIA_FRAMES]) -> EXPANDED_IDS + IMAGE_TOKEN_COUNTS.

    In the ensemble it gets IMAGE_TOKEN_COUNTS from kimi_preprocess, which has already checked the
    prompt (check_prompt), and runs beside the encoder. Called on its own with IMAGES it reads only
    their headers: the 1:1 check first, then the sizes, the plans and the counts.
    """

    def __init__(self, cfg: VisionConfig, limits: Limits = Limits()):
        self.cfg, self.limits = cfg, limits

    def __call__(self, input_ids: np.ndarray, images: Sequence[bytes] | None = None, media_frames=None,
                 token_counts=None) -> dict[str, np.ndarray]:
        pad = self.cfg.tokens.media_pad
        if token_counts is not None:
            if images is not None:
                raise RequestError("send IMAGES or IMAGE_TOKEN_COUNTS, not both: the counts are the images' "
                                   "token counts", "bad_tensor")
            counts = np.asarray(token_counts).reshape(-1)
            if counts.size and not np.issubdtype(counts.dtype, np.integer):
                raise RequestError(f"IMAGE_TOKEN_COUNTS must be integers, got {counts.dtype}", "bad_counts")
            if media_frames is not None and np.asarray(media_frames).size != counts.size:
                raise RequestError(f"MEDIA_FRAMES names {np.asarray(media_frames).size} media but IMAGE_TOKEN_COUNTS "
                                   f"has {counts.size} counts", "media_frames")
            # No image may yield more tokens than max_patches allows the whole request: bounds the output.
            counts = [int(c) for c in counts]  # Python ints: no overflow in the sum below
            most = self.limits.max_patches // self.cfg.media.merge_kernel_size ** 2
            if sum(max(c, 0) for c in counts) > most:
                raise RequestError(f"IMAGE_TOKEN_COUNTS adds up to {sum(max(c, 0) for c in counts)} tokens, more than "
                                   f"max_patches={self.limits.max_patches} allows ({most})", "bad_counts")
            ids = check_prompt(input_ids, self.cfg, len(counts), media_frames)
        else:
            if images is None:
                raise RequestError("missing input: IMAGES (or IMAGE_TOKEN_COUNTS)", "bad_tensor")
            ids = check_prompt(input_ids, self.cfg, _num_media(len(images), media_frames, self.cfg), media_frames)
            sizes = [img.size for img in open_images(images, self.limits)]
            counts = [m.plan.num_tokens for m in plan_media(sizes, self.cfg.media, self.limits, media_frames)]
        return {
            EXPANDED_IDS: expand_placeholders(ids, pad, counts),
            IMAGE_TOKEN_COUNTS: np.asarray(counts, dtype=np.int64),
        }


class PreprocessStep:
    """IMAGES (+ MEDIA_FRAMES, + INPUT_IDS to check first, + IMAGE_TOKEN_COUNTS to cross-check)
    -> PIXEL_VALUES + GRID_THWS + IMAGE_TOKEN_COUNTS.

    The ensemble's first step: given INPUT_IDS it refuses a prompt that breaks the 1:1 rule before
    any image byte is read, so that a bad request fails here, in one step, and kimi_placeholder
    (which then only expands ids) can run beside the encoder without ever failing with it: tritonserver
    2.51 never answers a request whose parallel steps both fail
    (docs/triton_runtime.md#known-server-limitations).
    """

    def __init__(self, cfg: VisionConfig, limits: Limits = Limits(), device: str = "cpu",
                 out_dtype: torch.dtype = torch.float32):
        self.cfg = cfg
        self.pre = Preprocessor(cfg.media, limits, device=device, out_dtype=out_dtype)

    def __call__(self, images: Sequence[bytes], expected_counts: np.ndarray | None = None, media_frames=None,
                 cancelled=None, input_ids=None):
        if input_ids is not None:
            check_prompt(input_ids, self.cfg, _num_media(len(images), media_frames, self.cfg), media_frames)
        pixel_values, grid_thws, plans = self.pre(images, media_frames, cancelled)
        counts = [m.plan.num_tokens for m in plans]
        if expected_counts is not None and np.asarray(expected_counts).reshape(-1).tolist() != counts:
            raise RequestError(f"IMAGE_TOKEN_COUNTS {np.asarray(expected_counts).tolist()} does not match "
                               f"the images' {counts}", "bad_counts")
        return {PIXEL_VALUES: pixel_values, GRID_THWS: grid_thws,
                IMAGE_TOKEN_COUNTS: np.asarray(counts, dtype=np.int64)}


class HeldCount:
    """Device bytes that an encoder step's CUDA graphs and the per-grid caches keep alive, counted
    together (a table held by a cache and by a graph counts once), and recounted only when a graph or a
    cached table may have changed. Counted on the thread that encodes; others read `bytes`."""

    def __init__(self, step, device):
        self.step, self.device = step, device
        self.bytes, self._key = 0, None

    def update(self) -> None:
        key = self.step.held_key()
        if key != self._key:
            tensors = [*self.step.graph_tensors(), *cached_tensors()]
            self.bytes = held_bytes(tensors, device=self.device)
            self._key = key


@dataclass
class EncoderRequest:
    pixel_values: torch.Tensor  # (N, 3, p, p)
    grid_thws: np.ndarray  # (M, 3) int64, host


class EncoderStep:
    """Runs several requests' media in one varlen forward and splits the embeddings back per request.

    A request whose inputs are inconsistent fails alone; if the joint forward itself fails, each
    request is retried on its own so one bad request cannot take the batch down.
    """

    def __init__(self, model, cuda_graphs: int = 0):
        self.model = model
        # The forward used for batches: graph replays for grid lists seen before, on CUDA.
        self.forward = model
        self._graphed = None
        if cuda_graphs > 0 and model.device.type == "cuda":
            from backends.encoder.graphs import GraphedEncoder

            self.forward = self._graphed = GraphedEncoder(model, max_graphs=cuda_graphs)
        self.merge_tokens = model.cfg.merge_tokens
        self._held = HeldCount(self, model.device)

    def cached_bytes(self) -> int:
        """Device bytes our bounded caches keep alive: the CUDA graphs' static buffers and the per-grid
        tables (RoPE, resized position embeddings). They grow towards their bounds as new shapes
        arrive; allocated memory beyond them that grows is a leak.

        Counted on the request thread after each batch, and only when the graphs or a cached table may
        have changed; other threads (the metrics sender) read the last count and never touch the
        graphs themselves, so no graph is ever freed on their side."""
        return self._held.bytes

    def held_key(self) -> tuple:
        """Changes whenever what this step's graphs or the per-grid caches hold may have changed."""
        return (self._graphed.changes if self._graphed is not None else 0, cache_version())

    def graph_tensors(self) -> list[torch.Tensor]:
        return self._graphed.held_tensors() if self._graphed is not None else []

    def check(self, req: EncoderRequest) -> None:
        grid = np.asarray(req.grid_thws)
        if grid.ndim != 2 or grid.shape[1] != 3:
            raise RequestError(f"GRID_THWS must have shape [M, 3], got {list(grid.shape)}", "bad_tensor")
        try:  # shapes, patch count, merge divisibility, frames, RoPE range
            check_pixels(self.model.cfg, tuple(req.pixel_values.shape), as_grid_list(grid))
        except ValueError as exc:
            raise RequestError(str(exc), "bad_tensor") from None

    def run_batch(self, requests: Sequence[EncoderRequest]) -> list[torch.Tensor | Exception]:
        try:
            return self._run_batch(requests)
        finally:
            self._held.update()

    def _run_batch(self, requests: Sequence[EncoderRequest]) -> list[torch.Tensor | Exception]:
        results: list[torch.Tensor | Exception] = [None] * len(requests)  # type: ignore[list-item]
        good = []
        for i, req in enumerate(requests):
            try:
                self.check(req)
                good.append(i)
            except Exception as exc:  # noqa: BLE001 - this request alone
                results[i] = exc
        if not good:
            return results
        try:
            embeds = self._forward([requests[i] for i in good])
        except Exception as exc:  # noqa: BLE001 - isolate the failure to the request that caused it
            if len(good) == 1:  # nothing to isolate: running it again would only fail again
                results[good[0]] = exc
                return results
            log.exception("joint encoder forward failed; retrying requests one by one")
            for i in good:
                try:
                    results[i] = self._forward([requests[i]])[0]
                except Exception as exc:  # noqa: BLE001
                    results[i] = exc
            return results
        for i, e in zip(good, embeds):
            results[i] = e
        return results

    def _forward(self, reqs: Sequence[EncoderRequest]) -> list[torch.Tensor]:
        grids = np.concatenate([np.asarray(r.grid_thws, dtype=np.int64).reshape(-1, 3) for r in reqs])
        device = self.model.device
        # Cast each request before joining: an empty (text-only) request must not promote the batch.
        # One request (the plain ensemble, a batch of one) is used where it lies: no copy.
        parts = [r.pixel_values.to(device, self.model.dtype, non_blocking=True) for r in reqs]
        pixels = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = self.forward(pixels, grids)
        # Split on host-known token counts: no device read.
        sizes = [self._tokens(r.grid_thws) for r in reqs]
        return list(torch.split(out, sizes))

    def _tokens(self, grid_thws) -> int:
        grid = np.asarray(grid_thws, dtype=np.int64).reshape(-1, 3)
        return int((grid[:, 1] * grid[:, 2]).sum() // self.merge_tokens)
