"""What each Triton model does, as plain Python over numpy/torch: testable without a server.

The adapters in `backends.serving.triton_models` only convert tensors and map RequestError to a
per-request error response.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from backends.cache.keys import KEY_BYTES, media_key
from backends.cache.store import EmbeddingCache
from backends.config import Limits, VisionConfig
from backends.encoder.cache import cache_version, cached_tensors, held_bytes
from backends.encoder.metadata import as_grid_list, check_pixels
from backends.errors import RequestCancelled, RequestError, first_line
from backends.placeholder.expand import check_one_placeholder_per_image, expand_placeholders
from backends.preprocess.media import check_image_bytes, plan_media, split_media
from backends.preprocess.preprocessor import Preprocessor, open_images
from backends.preprocess.warmup import warmup_requests
from contract import EXPANDED_IDS, GRID_THWS, IMAGE_TOKEN_COUNTS, MEDIA_CACHED, MEDIA_KEYS, PIXEL_VALUES

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
            check_image_bytes(images, self.limits)  # from the lengths alone, as preprocessing does
            ids = check_prompt(input_ids, self.cfg, _num_media(len(images), media_frames, self.cfg), media_frames)
            sizes = [img.size for img in open_images(images, self.limits)]
            counts = [m.plan.num_tokens for m in plan_media(sizes, self.cfg.media, self.limits, media_frames)]
        return {
            EXPANDED_IDS: expand_placeholders(ids, pad, counts),
            IMAGE_TOKEN_COUNTS: np.asarray(counts, dtype=np.int64),
        }


class PreprocessStep:
    """IMAGES (+ MEDIA_FRAMES, + INPUT_IDS to check first, + IMAGE_TOKEN_COUNTS to cross-check)
    -> PIXEL_VALUES + GRID_THWS + IMAGE_TOKEN_COUNTS + MEDIA_KEYS + MEDIA_CACHED.

    The ensemble's first step: it refuses too many images or bytes from the IMAGES lengths alone
    (Limits.max_images, max_image_bytes, max_request_bytes), then, given INPUT_IDS, a prompt that breaks
    the 1:1 rule before any image byte is read, so that a bad request fails here, in one step, and kimi_placeholder
    (which then only expands ids) can run beside the encoder without ever failing with it: tritonserver
    2.51 never answers a request whose parallel steps both fail
    (docs/triton_runtime.md#known-server-limitations).

    With the embedding cache on (`cache_context`: backends/cache/keys.py), each media gets its key, and a
    media that every encoder instance holds (`held(key)`: backends/cache/index.py) is planned from its
    header but not decoded: its patches are left out of PIXEL_VALUES and MEDIA_CACHED says so.
    """

    def __init__(self, cfg: VisionConfig, limits: Limits = Limits(), device: str = "cpu",
                 out_dtype: torch.dtype = torch.float32, cache_context: bytes | None = None, held=None):
        self.cfg = cfg
        self.pre = Preprocessor(cfg.media, limits, device=device, out_dtype=out_dtype)
        self.cache_context, self.held = cache_context, held

    def prepare(self) -> str:
        """Start-up work that keeps first requests as fast as later ones: a few requests of our own through
        every path (backends/preprocess/warmup.py), not counted in the decode statistics. Returns a line
        for the log."""
        t0 = time.perf_counter()
        counted = dict(self.pre.decode_stats)
        requests = warmup_requests(self.cfg.media)
        failed = []
        for images in requests:
            try:  # ours, not a user's: one refused (e.g. under tighter limits) or failing is logged, not fatal
                self.pre(images)
            except Exception as exc:  # noqa: BLE001
                failed.append(f"{type(exc).__name__}: {first_line(exc)}")
        if self.pre.device.type == "cuda":
            torch.cuda.synchronize(self.pre.device)
        self.pre.decode_stats.clear()
        self.pre.decode_stats.update(counted)
        line = f"warmed up with {len(requests)} requests of our own in {time.perf_counter() - t0:.2f} s"
        return line + (f"; {len(failed)} failed (first: {failed[0]})" if failed else "")

    def keys(self, images: Sequence[bytes], media_frames=None) -> list[bytes]:
        """Each media's cache key, in order; [] with the cache off."""
        if self.cache_context is None:
            return []
        check_image_bytes(images, self.pre.limits)  # hash no more images or bytes than a request may bring
        return [media_key(self.cache_context, [images[i] for i in frames], is_video)
                for frames, is_video in split_media(len(images), media_frames, self.cfg.media)]

    def __call__(self, images: Sequence[bytes], expected_counts: np.ndarray | None = None, media_frames=None,
                 cancelled=None, input_ids=None, encoder_follows: bool = False):
        """`encoder_follows`: an encoder that completes left-out media comes next (the ensembles); else
        every media's pixels are computed."""
        check_image_bytes(images, self.pre.limits)  # from the lengths alone, before the prompt and any byte
        if input_ids is not None:
            check_prompt(input_ids, self.cfg, _num_media(len(images), media_frames, self.cfg), media_frames)
        keys = self.keys(images, media_frames)
        held = self.held if encoder_follows else None
        skip = frozenset(n for n, key in enumerate(keys) if held is not None and held(key))
        pixel_values, grid_thws, plans = self.pre(images, media_frames, cancelled, skip=skip)
        counts = [m.plan.num_tokens for m in plans]
        if expected_counts is not None and np.asarray(expected_counts).reshape(-1).tolist() != counts:
            raise RequestError(f"IMAGE_TOKEN_COUNTS {np.asarray(expected_counts).tolist()} does not match "
                               f"the images' {counts}", "bad_counts")
        return {PIXEL_VALUES: pixel_values, GRID_THWS: grid_thws,
                IMAGE_TOKEN_COUNTS: np.asarray(counts, dtype=np.int64),
                MEDIA_KEYS: np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, KEY_BYTES).copy(),
                MEDIA_CACHED: np.asarray([n in skip for n in range(len(plans))], dtype=bool)}


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
    pixel_values: torch.Tensor  # (N, 3, p, p): the patches of every media not marked in `cached`, in order
    grid_thws: np.ndarray  # (M, 3) int64, host: every media's grid
    keys: list[bytes] | None = None  # each media's cache key (backends/cache/keys.py); None: no caching
    cached: np.ndarray | None = None  # (M,) bool: media whose patches preprocessing left out (rows expected held)
    # media index -> its patches, for a media left out whose rows are gone by now (evicted meanwhile)
    fallback: Callable[[int], torch.Tensor] | None = None
    # Whether the client gave up: asked once, before the forward, of a request with media to encode
    # (a client that gave up costs no encoder time; one the cache answers whole is answered anyway).
    cancelled: Callable[[], bool] | None = None


@dataclass
class _Media:
    """One media of a request in a batch: its rows from the cache, or the patches to encode."""

    grid: tuple[int, int, int]
    key: bytes | None
    rows: torch.Tensor | None = None
    pixels: torch.Tensor | None = None


# The encoder's start-up forwards: one image, and two of different sizes in one batch (small: start-up).
WARMUP_GRIDS = ([(1, 16, 16)], [(1, 20, 28), (1, 16, 16)])


class EncoderStep:
    """Runs several requests' media in one varlen forward and splits the embeddings back per request.

    With an embedding cache (backends/cache/store.py), a media whose key the cache holds is not encoded:
    its rows are the ones first computed for it; the others are encoded once per batch (two requests
    with the same new media share one), put in the cache, and every request's rows are assembled in
    its media's order. A request whose inputs are inconsistent fails alone; if the joint forward itself
    fails, each request is retried on its own so one bad request cannot take the batch down, and
    nothing of a failed forward is cached.
    """

    def __init__(self, model, cuda_graphs: int = 0, cache: EmbeddingCache | None = None, max_patches: int = 16384):
        """`max_patches`: the largest batch CUDA graphs take (serving: the largest one media can bring,
        largest_media_patches, so that every single media has its bucket)."""
        self.model = model
        self.cache = cache if cache is not None and cache.enabled else None
        # The forward used for batches: graph replays for grid lists seen before, on CUDA.
        self.forward = model
        self._graphed = None
        if cuda_graphs > 0 and model.device.type == "cuda":
            from backends.encoder.graphs import GraphedEncoder

            self.forward = self._graphed = GraphedEncoder(model, max_graphs=cuda_graphs, max_patches=max_patches)
        self.merge_tokens = model.cfg.merge_tokens
        self._held = HeldCount(self, model.device)

    def prepare(self) -> list[str]:
        """Start-up work that keeps first requests as fast as later ones: the CUDA graphs of every patch
        bucket, then a few forwards of our own through the paths around them (WARMUP_GRIDS: the eager
        merge and projector, the per-grid tables, the allocator's first segments). Returns lines for the
        log (what was captured, and a missing fast kernel)."""
        from backends.encoder.attention import fast_path_note

        lines = [note] if (note := fast_path_note(self.model.device, self.model.dtype)) else []
        if self._graphed is not None:
            try:
                lines.append(self._graphed.capture_buckets())
            except Exception as exc:  # noqa: BLE001 - the encoder still serves: eagerly, or per grid list
                log.exception("CUDA graph capture at start-up failed")
                lines.append(f"no CUDA graphs captured at start-up ({type(exc).__name__}: {exc}); graphs per grid list")
        t0 = time.perf_counter()
        p = self.model.cfg.patch_size
        try:  # a warm-up that fails (out of memory, say) is logged; requests still get their own errors
            with torch.inference_mode():
                for grids in WARMUP_GRIDS:
                    patches = sum(t * h * w for t, h, w in grids)
                    x = torch.zeros((patches, 3, p, p), dtype=self.model.dtype, device=self.model.device)
                    self.forward(x, np.asarray(grids, dtype=np.int64))
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
            lines.append(f"warmed up with {len(WARMUP_GRIDS)} forwards of our own in {time.perf_counter() - t0:.2f} s")
        except Exception as exc:  # noqa: BLE001
            log.exception("the encoder's start-up warm-up failed")
            lines.append(f"warm-up forwards failed ({type(exc).__name__}: {first_line(exc)})")
        self._held.update()
        return lines

    def cached_bytes(self) -> int:
        """Device bytes our bounded caches keep alive: the CUDA graphs' static buffers, the per-grid
        tables (RoPE, resized position embeddings) and the embedding cache's rows. They grow towards
        their bounds as new shapes and media arrive; allocated memory beyond them that grows is a leak.

        Counted on the request thread after each batch, and only when the graphs or a cached table may
        have changed; other threads (the metrics sender) read the last count and never touch the
        graphs themselves, so no graph is ever freed on their side."""
        return self._held.bytes + (self.cache.bytes if self.cache is not None else 0)

    def held_key(self) -> tuple:
        """Changes whenever what this step's graphs or the per-grid caches hold may have changed."""
        return (self._graphed.changes if self._graphed is not None else 0, cache_version())

    def graph_tensors(self) -> list[torch.Tensor]:
        return self._graphed.held_tensors() if self._graphed is not None else []

    def check(self, req: EncoderRequest) -> None:
        grid = np.asarray(req.grid_thws)
        if grid.ndim != 2 or grid.shape[1] != 3:
            raise RequestError(f"GRID_THWS must have shape [M, 3], got {list(grid.shape)}", "bad_tensor")
        for name, given in (("MEDIA_KEYS", req.keys), ("MEDIA_CACHED", req.cached)):
            if given is not None and len(given) != grid.shape[0]:
                raise RequestError(f"{name} names {len(given)} media but GRID_THWS has {grid.shape[0]}", "bad_tensor")
        sent = as_grid_list(grid[~self._left_out(req)]) if grid.shape[0] else []
        try:  # shapes, patch count, merge divisibility, frames, RoPE range
            check_pixels(self.model.cfg, tuple(req.pixel_values.shape), sent)
        except ValueError as exc:
            raise RequestError(str(exc), "bad_tensor") from None

    @staticmethod
    def _left_out(req: EncoderRequest) -> np.ndarray:
        m = np.asarray(req.grid_thws).reshape(-1, 3).shape[0]
        return np.zeros(m, dtype=bool) if req.cached is None else np.asarray(req.cached, dtype=bool).reshape(-1)

    def run_batch(self, requests: Sequence[EncoderRequest]) -> list[torch.Tensor | Exception]:
        try:
            return self._run_batch(requests)
        finally:
            self._held.update()

    def _run_batch(self, requests: Sequence[EncoderRequest]) -> list[torch.Tensor | Exception]:
        results: list[torch.Tensor | Exception] = [None] * len(requests)  # type: ignore[list-item]
        good: list[tuple[int, list[_Media]]] = []
        for i, req in enumerate(requests):
            try:
                self.check(req)
                media = self._media(req)
                if req.cancelled is not None and any(md.rows is None for md in media) and req.cancelled():
                    raise RequestCancelled("cancelled by the client before the encoder ran")
                good.append((i, media))
            except Exception as exc:  # noqa: BLE001 - this request alone
                results[i] = exc
        if not good:
            return results
        try:
            for (i, _), rows in zip(good, self._encode([media for _, media in good])):
                results[i] = rows
        except Exception as exc:  # noqa: BLE001 - isolate the failure to the request that caused it
            if len(good) == 1:  # nothing to isolate: running it again would only fail again
                results[good[0][0]] = exc
                return results
            log.exception("joint encoder forward failed; retrying requests one by one")
            for i, media in good:
                try:
                    results[i] = self._encode([media])[0]
                except Exception as exc:  # noqa: BLE001
                    results[i] = exc
        return results

    def _media(self, req: EncoderRequest) -> list[_Media]:
        """The request's media: rows the cache holds, else the patches to encode (from PIXEL_VALUES, or
        from the fallback for one left out whose rows are gone)."""
        grids = as_grid_list(req.grid_thws)
        left_out = self._left_out(req)
        out, offset = [], 0
        for m, grid in enumerate(grids):
            key = req.keys[m] if req.keys else None
            patches = grid[0] * grid[1] * grid[2]
            rows = self.cache.get(key) if self.cache is not None and key is not None else None
            pixels = None
            if not left_out[m]:
                pixels = req.pixel_values[offset:offset + patches]
                offset += patches
            elif rows is None:
                if req.fallback is None:
                    raise RequestError(f"media {m} was sent without its patches (MEDIA_CACHED) and this encoder "
                                       f"does not hold its rows", "bad_tensor")
                pixels = req.fallback(m)
            out.append(_Media(tuple(grid), key, rows=rows, pixels=None if rows is not None else pixels))
        return out

    def _encode(self, requests: list[list[_Media]]) -> list[torch.Tensor]:
        """Each request's rows, in its media's order: one forward over the media to encode (each key
        once), the cache filled from it."""
        todo: list[_Media] = []
        first: dict[bytes, _Media] = {}
        for media in requests:
            for md in media:
                if md.rows is not None:
                    continue
                if md.key is not None and md.key in first:
                    continue  # the same media earlier in the batch: encoded once
                todo.append(md)
                if md.key is not None:
                    first[md.key] = md
        if todo:
            device = self.model.device
            # Cast each part before joining: an empty part must not promote the batch. One part is used
            # where it lies: no copy.
            parts = [md.pixels.to(device, self.model.dtype, non_blocking=True) for md in todo]
            pixels = parts[0] if len(parts) == 1 else torch.cat(parts)
            out = self.forward(pixels, np.asarray([md.grid for md in todo], dtype=np.int64))
            # Split on host-known token counts: no device read.
            for md, rows in zip(todo, torch.split(out, [self._tokens(md.grid) for md in todo])):
                md.rows = rows
            if self.cache is not None:
                for md in todo:
                    if md.key is not None:
                        self.cache.put(md.key, md.rows)
        answers = []
        for media in requests:
            rows = [md.rows if md.rows is not None else first[md.key].rows for md in media]
            if len(rows) == 1:
                answers.append(rows[0])
            elif rows:
                answers.append(torch.cat(rows))
            else:
                answers.append(torch.empty((0, self.model.cfg.text_hidden_size), dtype=self.model.dtype,
                                           device=self.model.device))
        return answers

    def _tokens(self, grid) -> int:
        return int(grid[1] * grid[2]) // self.merge_tokens
