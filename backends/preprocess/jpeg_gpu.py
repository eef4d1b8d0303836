"""Exact JPEG decoding on the GPU: which images may go there, the decode, and the start-up self-check.

Route (docs/jpeg_decoding.md): nvJPEG's hardware decoder gives the raw Y/Cb/Cr planes (nvjpeg.py), and
kernels/jpeg_color.py applies libjpeg-turbo's fancy upsampling and fixed-point YCbCr->RGB, so the
result equals Pillow's `Image.open(f).convert("RGB")`. Everything else stays on Pillow, counted by
reason in `stats`, never a wrong pixel: not a JPEG, progressive or arithmetic coding, CMYK/YCCK,
an RGB-coded JPEG (Adobe transform 0, or R/G/B component ids without JFIF), other bit depths,
subsampling other than 4:4:4, 4:2:2, 4:2:0, 4:4:0 or grayscale, and whatever the hardware decoder
refuses, and every file whose entropy-coded scan is damaged or out of range (scan_check.c: the two
decoders recover from damage differently). At start-up a self-check decodes a few generated JPEGs both
ways; one differing pixel turns GPU decoding off, with a log line.

In a Preprocessor it is the first decoder in line (decoders.py): per request (`start`, a JpegDecoding)
the scan checks start before the headers are read, the JPEGs it takes are decoded in batches, and the
answers are provisional until `settle` has the checks' verdicts. An image's planes come from the header
jpeg_header walked for the route (nvjpeg.header_info), or from nvJPEG's own header read where Pillow
opened the file.
"""

from __future__ import annotations

import io
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from backends.config import env_flag
from backends.kernels import jpeg_color
from backends.preprocess import scan_check
from backends.preprocess.decode import HeaderOnly, open_image
from backends.preprocess.decoders import Frame
from backends.preprocess.nvjpeg import HardwareJpegDecoder, JpegInfo, NvJpegError, NvJpegUnavailable, header_info

log = logging.getLogger("kimi_vision.jpeg")

_FACTORS = tuple(jpeg_color.SAMPLING)  # the samplings the colour kernel reproduces
# Decoded pixels one batched GPU decode may hold at once (a request may carry 64 huge JPEGs).
GPU_DECODE_PIXELS = 64 << 20


def pillow_reason(img: Image.Image) -> str | None:
    """Why an opened image must be decoded by Pillow; None if the GPU path reproduces it exactly.
    Reads only what Pillow parsed from the header."""
    if img.format != "JPEG":
        return "not_jpeg"
    if img.mode not in ("RGB", "L"):
        return "color_space"  # CMYK, YCCK
    if img.info.get("progressive") or img.info.get("progression"):
        return "progressive"
    if getattr(img, "bits", 8) != 8:
        return "bit_depth"
    layers = getattr(img, "layer", None) or []
    if img.mode == "L":
        return None if len(layers) == 1 else "color_space"
    if len(layers) != 3:
        return "color_space"
    (_, h0, v0, _), chroma = layers[0], layers[1:]
    if (h0, v0) not in _FACTORS or any((h, v) != (1, 1) for _, h, v, _ in chroma):
        return "sampling"
    if "adobe" in img.info and img.info.get("adobe_transform") == 0:
        return "color_space"  # stored as RGB, no YCbCr transform
    ids = [ord(layer[0]) if isinstance(layer[0], str) else layer[0] for layer in layers]
    if "jfif" not in img.info and "adobe" not in img.info and ids == [ord("R"), ord("G"), ord("B")]:
        return "color_space"  # libjpeg reads R, G, B component ids as RGB
    return None


# 4:4:0 (h1v2), which Pillow decodes but cannot write; OpenCV wrote it once (lab/tools/make_440_jpegs.py).
SELF_CHECK_440 = Path(__file__).with_name("selfcheck_440.jpg")


def gradient_picture(w: int, h: int, rng: np.random.Generator) -> np.ndarray:
    """The self-check's pictures (uint8 RGB): gradients with some noise, so that chroma varies at every
    upsampling edge."""
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 3 + y * 5) % 256, (x * 7 + 40) % 256, (y * 11 + x) % 256], -1) + rng.integers(-30, 30, (h, w, 3))
    return np.clip(rgb, 0, 255).astype(np.uint8)


def self_check_images() -> list[bytes]:
    """Small JPEGs covering every sampling the GPU path takes, odd sizes and fancy-upsampling edges."""
    rng = np.random.default_rng(7)
    blobs = []
    for w, h in ((67, 45), (3, 2), (257, 131), (16, 9)):
        img = Image.fromarray(gradient_picture(w, h, rng))
        for subsampling in (0, 1, 2):
            for quality in (75, 100):
                buf = io.BytesIO()
                img.save(buf, "JPEG", quality=quality, subsampling=subsampling)
                blobs.append(buf.getvalue())
        for quality in (75, 90):  # a pair: grayscale runs are converted together too
            buf = io.BytesIO()
            img.convert("L").save(buf, "JPEG", quality=quality)
            blobs.append(buf.getvalue())
    blobs.append(SELF_CHECK_440.read_bytes())
    return blobs


def self_check_handles(blobs: list[bytes]) -> list:
    """The self-check's opened images: the handles a request gets (jpeg_header's walk, a HeaderOnly),
    every other one Pillow's, so that both ways to an image's planes (nvjpeg.header_info, nvJPEG's own
    header read) meet the hardware decoder, each for every size and sampling but 4:4:0 (the last file)."""
    return [Image.open(io.BytesIO(b)) if k % 2 else open_image(b, k, 1 << 30) for k, b in enumerate(blobs)]


class GpuJpegDecoder:
    """Per model instance: routes, decodes, counts in `stats` (path, reason) -> images (a Preprocessor's
    decode_stats, shared with its other decoders; else its own)."""

    name = "gpu"

    def __init__(self, device: torch.device, enabled: bool | None = None, stats: Counter | None = None):
        self.device = torch.device(device)
        self.stats: Counter = Counter() if stats is None else stats
        self.decoder: HardwareJpegDecoder | None = None
        self.off_reason = ""
        if enabled is None:
            enabled = env_flag("KIMI_GPU_JPEG", True)
        if not enabled:
            self.off_reason = "turned off (KIMI_GPU_JPEG, or gpu_jpeg=False)"
            return
        try:
            scan_check.library()  # built here, once: without it no JPEG may go to the GPU
            self.decoder = HardwareJpegDecoder(self.device)
        except (NvJpegUnavailable, NvJpegError, scan_check.ScanCheckUnavailable) as exc:
            self.off_reason = str(exc)
            log.warning("exact GPU JPEG decoding is off: %s; JPEGs are decoded by Pillow", exc)
            return
        try:
            failure = self.self_check()
        except Exception as exc:  # noqa: BLE001 - e.g. the kernel fails to build: Pillow must still serve
            log.exception("GPU JPEG self-check raised")
            failure = f"it raised {type(exc).__name__}: {exc}"
        if failure:
            self.decoder.close()
            self.decoder = None
            self.off_reason = f"self-check: {failure}"
            log.error("exact GPU JPEG decoding is off: %s; JPEGs are decoded by Pillow", self.off_reason)
        else:
            log.info("exact GPU JPEG decoding is on (nvJPEG hardware decoder; self-check equal to Pillow)")
        self.stats.clear()

    @property
    def enabled(self) -> bool:
        return self.decoder is not None

    def self_check(self) -> str:
        """"" if the GPU gives Pillow's pixels for every generated JPEG; else what went wrong: how many
        differ, or which ones the scan check refused (well-formed files it must pass)."""
        blobs = self_check_images()
        images = self_check_handles(blobs)
        got, pending = self.decode_async(blobs, images)
        refused = {k: why for k, why in self.settle(pending).items() if why is not None}
        if refused:
            return (f"the scan check refused {len(refused)} of the generated JPEGs "
                    f"({', '.join(sorted(set(refused.values())))})")
        bad = 0
        for blob, img, rgb in zip(blobs, images, got):
            ref = np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))
            if rgb is None or not np.array_equal(rgb.cpu().numpy(), ref):
                bad += 1
        return f"{bad} of the generated JPEGs differ from Pillow" if bad else ""

    def reason(self, img: Image.Image) -> str | None:
        """Why `img` goes to Pillow, None if it goes to the GPU."""
        if self.decoder is None:
            return "gpu_decode_off" if img.format == "JPEG" else "not_jpeg"
        return pillow_reason(img)

    def start(self, blobs, max_pixels: int) -> "JpegDecoding":
        """Its part of a request (decoders.Decoding): the scan checks start now."""
        return JpegDecoding(self, blobs, max_pixels)

    def decode(self, blobs: list[bytes], images: list[Image.Image]) -> list[torch.Tensor | None]:
        """decode_async, waiting for the scan checks: None for every image the GPU must not answer."""
        out, pending = self.decode_async(blobs, images)
        verdicts = self.settle(pending)
        self.count(verdicts)
        for k, why in verdicts.items():
            if why is not None:
                out[k] = None
        return out

    def start_checks(self, blobs, max_pixels: int) -> dict:
        """The scan checks of every blob that opens and ends like a JPEG, started now on the scan check's own
        threads ({index: scan_check.Pending}), for a caller that has other work before its decode
        (the header reads): pass them to decode_async, and cancel them when done (a check the
        decode never asked for).
        Images above `max_pixels` are refused from their header (the request's own check refuses them
        too), so that a decompression bomb costs no scan decode here."""
        if self.decoder is None:
            return {}
        return _start([i for i, b in enumerate(blobs) if _whole_jpeg(b)], blobs, max_pixels)

    def decode_async(self, blobs: list[bytes], images: list[Image.Image],
                     checks: list | None = None) -> tuple[list[torch.Tensor | None], dict]:
        """RGB (H, W, 3) uint8 on the device for each blob the hardware decoder takes (one batched decode,
        after a host wait for the stream's earlier work: nvjpeg.py), None for those it refuses (decode
        them with Pillow); and the pending scan checks of the decoded ones (settle() waits for them:
        until then a decoded image is provisional).
        `images` are the opened handles: an image's planes are read from its header as jpeg_header walked
        it (a HeaderOnly), else asked of nvJPEG, whose sizes must then agree with the handle's. Refusals are
        counted in `stats` on return, decoded images by the caller through count() once settled: when
        this raises, the caller decodes the whole batch with Pillow and counts it so (the checks are
        then cancelled).

        The scans are checked on the scan check's own threads (scan_check.Checks: started with one call,
        they need no GIL, so they run beside this thread's Python) while this thread reads the headers
        and launches the decode, and while the caller goes on with the request. `checks`, one per blob,
        are checks the caller started earlier (start_checks; None where it did not): they are used, and
        left to the caller to cancel."""
        given = checks or [None] * len(blobs)
        own = [k for k, c in enumerate(given) if c is None and _ends_as_jpeg(blobs[k])]
        started = _start(own, blobs, 0)
        verdicts = [c if c is not None else started.get(k) for k, c in enumerate(given)]
        try:
            out, pending = self._decode_checked(blobs, images, verdicts)
        except BaseException:
            for k in own:
                verdicts[k].cancel()
            raise
        for k in own:
            if k not in pending:
                verdicts[k].cancel()  # Pillow decodes that image whatever its check says
        return out, pending

    def _decode_checked(self, blobs, images, verdicts) -> tuple[list[torch.Tensor | None], dict]:
        counts: Counter = Counter()
        infos: list[JpegInfo | None] = []
        for k, (blob, img) in enumerate(zip(blobs, images)):
            if not _ends_as_jpeg(blob):
                # No end-of-image marker right at the end: a truncated file, which Pillow refuses and the
                # hardware decoder might fill in; or trailing bytes after it. Pillow decides either way.
                counts[("pillow", "no_end_marker")] += 1
                infos.append(None)
                continue
            try:
                info = self._info(blob, img)
                why = self.decoder.unsupported(blob, info)  # the hardware decoder's own verdict
            except NvJpegError as exc:  # a header nvJPEG cannot read: this image alone goes to Pillow
                info, why = None, str(exc)
            if why is None and (info.width, info.height) != img.size:
                why = f"nvJPEG reads {info.width}x{info.height}, Pillow {img.size[0]}x{img.size[1]}"
            if why is not None:
                log.debug("image %d of the batch goes to Pillow: %s", k, why)
                counts[("pillow", "nvjpeg_refused")] += 1
                infos.append(None)
            else:
                infos.append(info)
        todo = [k for k, info in enumerate(infos) if info is not None]
        out: list[torch.Tensor | None] = [None] * len(blobs)
        if todo:
            planes = self.decoder.decode_planes([blobs[k] for k in todo], [infos[k] for k in todo])
            for run in _runs([infos[k] for k in todo]):
                rgb = _convert(planes.stacked(run), infos[todo[run[0]]])
                for i, r in enumerate(run):
                    out[todo[r]] = rgb[i]
        self.stats.update(counts)
        return out, {k: verdicts[k] for k in todo}

    def _info(self, blob, img) -> JpegInfo:
        """The image's planes: from the header jpeg_header walked (a HeaderOnly handle), else from
        nvJPEG's own read of the header."""
        info = header_info(img.header) if isinstance(img, HeaderOnly) else None
        return info if info is not None else self.decoder.info(blob)

    @staticmethod
    def settle(pending: dict) -> dict:
        """Waits for the scan checks of decode_async's images ({key: scan_check.Pending}): {key: None where the GPU's
        answer stands, else the reason the image must be decoded by Pillow}. A check that raised sends its
        image to Pillow too, counted apart when it had been dropped (a bug of ours: a decoded image's
        check must never be dropped)."""
        verdicts = {}
        for key, verdict in pending.items():
            try:
                verdicts[key] = verdict.result()
            except scan_check.CheckDropped:
                log.exception("the scan check of a GPU-decoded image was dropped; Pillow decodes it")
                verdicts[key] = "scan_check_dropped"
            except Exception:  # noqa: BLE001 - never keep the GPU's answer unchecked
                log.exception("the scan check of an image raised; Pillow decodes it")
                verdicts[key] = "scan_check_error"
        return verdicts

    def count(self, verdicts: dict) -> None:
        """Counts settled images: on the GPU, or on Pillow by the scan check's reason."""
        for why in verdicts.values():
            self.stats[("pillow", why) if why else ("gpu", "")] += 1


class JpegDecoding:
    """One request's part of the GPU JPEG decoder (decoders.Decoding). Its scan checks start with it,
    before the headers are read, so that they have as long as possible to finish beside the rest; a
    pass done again reuses their answers. The images it decodes in a pass are provisional until settle()
    has their checks' verdicts; an image a check refused is refused from then on (the next pass routes
    it to Pillow, which counts it under the check's reason)."""

    def __init__(self, decoder: GpuJpegDecoder, blobs, max_pixels: int):
        self.decoder, self.blobs = decoder, blobs
        # Images above `max_pixels` are refused from their header (the request's own check refuses them
        # too), so that a decompression bomb costs no scan decode here.
        self.early = decoder.start_checks(blobs, max_pixels)
        self.pending: dict = {}  # image index -> its check (scan_check.Pending), for this pass's decodes
        self.refused: dict[int, str] = {}  # image index -> why its check refused it

    def refusal(self, index: int, image) -> str | None:
        return self.refused.get(index) or self.decoder.reason(image)

    def frames(self, frames: Sequence[Frame]):
        """Decoded in batches of up to GPU_DECODE_PIXELS, each formed when its first frame is wanted;
        None for an image the decode gives back (counted), or all of a batch whose decode raised (e.g.
        nvJPEG rejects a corrupt file: Pillow decides; counted as gpu_error)."""
        frames = list(frames)
        decoded: dict[int, torch.Tensor | None] = {}
        for n, f in enumerate(frames):
            if f.index not in decoded:
                decoded.update(self._decode(_batch(frames[n:], decoded)))
            yield decoded.pop(f.index)

    def _decode(self, batch: list[Frame]) -> dict[int, torch.Tensor | None]:
        indices = [f.index for f in batch]
        try:
            rgbs, checks = self.decoder.decode_async([self.blobs[i] for i in indices], [f.image for f in batch],
                                                     [self.early.get(i) for i in indices])
        except Exception:  # noqa: BLE001 - e.g. nvJPEG rejects a corrupt file: Pillow decides
            log.warning("GPU JPEG decode failed for images %s; decoding them with Pillow", indices, exc_info=True)
            self.decoder.stats[("pillow", "gpu_error")] += len(batch)
            return dict.fromkeys(indices)
        self.pending.update((indices[k], check) for k, check in checks.items())
        return dict(zip(indices, rgbs))

    def settle(self) -> dict[int, str]:
        """Waits for this pass's checks: {image: why} for those refused (remembered for the next pass);
        where none is, the decoded images are counted on the GPU."""
        pending, self.pending = self.pending, {}
        verdicts = self.decoder.settle(pending)
        refused = {i: why for i, why in verdicts.items() if why is not None}
        if refused:
            self.refused.update(refused)
        else:
            self.decoder.count(verdicts)
        return refused

    def close(self) -> None:
        """Checks no longer wanted: those of a pass that failed, and those the decode never asked for (a
        PNG-like JPEG, an error)."""
        for verdict in (*self.pending.values(), *self.early.values()):
            verdict.cancel()
        self.pending = {}


def _pixels(img) -> int:
    return img.size[0] * img.size[1]


def _batch(frames: list[Frame], decoded: dict) -> list[Frame]:
    """The next batch, from frames[0] on: every frame not yet decoded that still fits in
    GPU_DECODE_PIXELS (the first always)."""
    batch, pixels = [], 0
    for f in frames:
        if f.index not in decoded and (not batch or pixels + _pixels(f.image) <= GPU_DECODE_PIXELS):
            batch.append(f)
            pixels += _pixels(f.image)
    return batch


def _ends_as_jpeg(blob) -> bool:
    """Ends with the end-of-image marker. A file that does not is truncated, or has bytes after it:
    Pillow decides either way (decode_async), so its scan is never checked."""
    return bytes(blob[-2:]) == b"\xff\xd9"


def _whole_jpeg(blob) -> bool:
    """Starts and ends with a JPEG's markers (decode_async, given what the route took as JPEGs, asks
    only the end)."""
    return bytes(blob[:2]) == b"\xff\xd8" and _ends_as_jpeg(blob)


def _start(indices: list[int], blobs, max_pixels: int) -> dict:
    """The scan checks of blobs[i] for i in `indices`, queued at once ({i: pending verdict})."""
    if not indices:
        return {}
    checks = scan_check.Checks([blobs[i] for i in indices], scan_check.THREADS, max_pixels)
    return {i: checks.pending(k) for k, i in enumerate(indices)}


def _convert(planes: list[torch.Tensor], info: JpegInfo) -> torch.Tensor:
    """One run's images, their planes of `info` as (n, rows, cols) views (DecodedPlanes.stacked) ->
    (n, H, W, 3) uint8 RGB: one launch of the colour kernel, or for grayscale one copy of the repeated
    Y planes."""
    y, *chroma = planes
    if info.factors is None:  # grayscale: convert("RGB") repeats L
        return y.unsqueeze(-1).expand(-1, -1, -1, 3).contiguous()
    return jpeg_color.ycc_to_rgb_batch(y, *chroma, *info.factors)  # Y planes are (height, width)


def _runs(infos: list[JpegInfo]) -> list[range]:
    """Consecutive images with the same info (the same sampling, number and sizes of planes): each run
    is converted in one launch."""
    runs, start = [], 0
    for i in range(1, len(infos) + 1):
        if i == len(infos) or infos[i] != infos[start]:
            runs.append(range(start, i))
            start = i
    return runs
