"""nvJPEG's hardware JPEG decoder, through ctypes, to the raw (not upsampled) Y/Cb/Cr planes.

Why the hardware backend and raw planes (docs/jpeg_decoding.md#nvjpeg-against-pillow): on an H200 the
planes of nvJPEG's hardware decoder (the NVJPG engines of A100/H100-class GPUs) equal libjpeg-turbo's
islow IDCT output exactly, while nvJPEG's CUDA backends (hybrid, GPU hybrid) differ by one level in a
few percent of pixels, and nvJPEG's own chroma upsampling differs from libjpeg-turbo's. So we take the
hardware decoder's planes and upsample and convert them ourselves (kernels/jpeg_color.py).

The library: KIMI_NVJPEG_LIB, else the copy torchvision's wheel bundles, else the nvidia-nvjpeg wheel's,
else the system's. Nothing here runs without a GPU; `HardwareJpegDecoder` raises NvJpegUnavailable
where the library or the hardware decoder is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass

import torch


NVJPEG_BACKEND_HARDWARE = 3
NVJPEG_OUTPUT_YUV = 1
NVJPEG_STATUS_ARCH_MISMATCH = 7
# nvjpegChromaSubsampling_t -> (fx, fy) of the chroma planes; GRAY has no chroma.
SUBSAMPLING = {0: (1, 1), 1: (2, 1), 2: (2, 2), 3: (1, 2), 6: None}
SUBSAMPLING_NAMES = {0: "4:4:4", 1: "4:2:2", 2: "4:2:0", 3: "4:4:0", 4: "4:1:1", 5: "4:1:0", 6: "gray", 7: "4:1:0V"}
_STATUS = {1: "NOT_INITIALIZED", 2: "INVALID_PARAMETER", 3: "BAD_JPEG", 4: "JPEG_NOT_SUPPORTED", 5: "ALLOCATOR_FAILURE",
           6: "EXECUTION_FAILED", 7: "ARCH_MISMATCH", 8: "INTERNAL_ERROR", 9: "IMPLEMENTATION_NOT_SUPPORTED",
           10: "INCOMPLETE_BITSTREAM"}


class NvJpegUnavailable(RuntimeError):
    """No nvJPEG library, or no hardware JPEG decoder on this GPU."""


class NvJpegError(RuntimeError):
    pass


class _Image(ctypes.Structure):  # nvjpegImage_t
    _fields_ = [("channel", ctypes.c_void_p * 4), ("pitch", ctypes.c_size_t * 4)]


def find_library() -> str:
    candidates = [os.environ.get("KIMI_NVJPEG_LIB", "")]
    spec = importlib.util.find_spec("torchvision")
    if spec and spec.origin:
        candidates += sorted(glob.glob(os.path.join(os.path.dirname(spec.origin) + ".libs", "libnvjpeg*.so*")))
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvjpeg.so*")))
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "nvjpeg", "lib", "libnvjpeg.so*")))
    candidates += [ctypes.util.find_library("nvjpeg") or "", "libnvjpeg.so.13", "libnvjpeg.so.12"]
    for path in candidates:
        if not path:
            continue
        try:
            ctypes.CDLL(path)
            return path
        except OSError:
            continue
    raise NvJpegUnavailable("no libnvjpeg found (torchvision's wheel, the nvidia-nvjpeg wheel or KIMI_NVJPEG_LIB)")


_P, _INT, _SIZE = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
_SIGNATURES = {
    "nvjpegCreateEx": [_INT, _P, _P, ctypes.c_uint, ctypes.POINTER(_P)],
    "nvjpegJpegStateCreate": [_P, ctypes.POINTER(_P)],
    "nvjpegJpegStreamCreate": [_P, ctypes.POINTER(_P)],
    "nvjpegGetImageInfo": [_P, ctypes.c_char_p, _SIZE, ctypes.POINTER(_INT), ctypes.POINTER(_INT),
                           ctypes.POINTER(_INT), ctypes.POINTER(_INT)],
    "nvjpegJpegStreamParseHeader": [_P, ctypes.c_char_p, _SIZE, _P],
    "nvjpegDecodeBatchedSupported": [_P, _P, ctypes.POINTER(_INT)],
    "nvjpegDecodeBatchedInitialize": [_P, _P, _INT, _INT, _INT],
    "nvjpegDecodeBatched": [_P, _P, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_SIZE), ctypes.POINTER(_Image), _P],
}


@dataclass(frozen=True)
class JpegInfo:
    width: int
    height: int
    components: int
    subsampling: int  # nvjpegChromaSubsampling_t
    widths: tuple[int, ...]  # per plane, as stored
    heights: tuple[int, ...]

    @property
    def factors(self) -> tuple[int, int] | None:
        return SUBSAMPLING.get(self.subsampling)


NVJPEG_CSS_GRAY = 6
_CODES = {factors: code for code, factors in SUBSAMPLING.items() if factors is not None}  # Y's (h, v) -> code


def header_info(header) -> JpegInfo | None:
    """What `HardwareJpegDecoder.info` (nvjpegGetImageInfo) gives for a JPEG whose header jpeg_header
    walked (a jpeg_header.JpegHeader: its size, and its layers, (id, h, v, table) per component), for
    the samplings the GPU route takes; None for any other, whose info is then nvJPEG's to give.

    nvJPEG reports every plane at its stored size, libjpeg's ceil(W * h / Hmax) by ceil(H * v / Vmax)
    (docs/jpeg_decoding.md#the-route-we-take), grayscale in the first plane only: with 1x1 chroma, Y is
    W x H and chroma ceil(W / h) x ceil(H / v) for Y's factors (h, v), which name the subsampling.
    tests/unit/test_jpeg_header.py holds this to that rule over the corpus, tests/gpu/test_jpeg_decode.py
    to nvJPEG itself."""
    (width, height), layers = header.size, header.layer
    if len(layers) == 1:
        if tuple(layers[0][1:3]) != (1, 1):
            return None
        return JpegInfo(width, height, 1, NVJPEG_CSS_GRAY, (width,), (height,))
    if len(layers) != 3:
        return None
    (_, h, v, _), chroma = layers[0], layers[1:]
    if (h, v) not in _CODES or any(tuple(c[1:3]) != (1, 1) for c in chroma):
        return None
    cw, ch = -(-width // h), -(-height // v)
    return JpegInfo(width, height, 3, _CODES[(h, v)], (width, cw, cw), (height, ch, ch))


class HardwareJpegDecoder:
    """Decodes baseline JPEGs on `device` to their planes. One per model instance (not thread-safe)."""

    def __init__(self, device: torch.device, library: str | None = None):
        self.device = torch.device(device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise NvJpegUnavailable("no CUDA device")
        try:
            self.lib = ctypes.CDLL(library or find_library())
        except OSError as exc:
            raise NvJpegUnavailable(str(exc)) from None
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = argtypes, _INT
        with torch.cuda.device(self.device):
            torch.cuda.current_stream(self.device)  # the context exists before nvJPEG uses it
            self.handle, self.state, self.jpeg_stream = _P(), _P(), _P()
            status = self.lib.nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, None, None, 0, ctypes.byref(self.handle))
            if status == NVJPEG_STATUS_ARCH_MISMATCH:
                raise NvJpegUnavailable(f"{torch.cuda.get_device_name(self.device)} has no hardware JPEG decoder")
            self._ok(status, "nvjpegCreateEx(HARDWARE)")
            self._ok(self.lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state)), "nvjpegJpegStateCreate")
            self._ok(self.lib.nvjpegJpegStreamCreate(self.handle, ctypes.byref(self.jpeg_stream)), "nvjpegJpegStreamCreate")
        # The latest decode: its end (an event) and its bitstreams, referenced until it has run (the
        # decoder reads them after nvjpegDecodeBatched returns).
        self._last: tuple[torch.cuda.Event, list[bytes]] | None = None

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise NvJpegError(f"{what} failed: {_STATUS.get(status, status)}")

    def info(self, data: bytes) -> JpegInfo:
        n, css = _INT(), _INT()
        widths, heights = (_INT * 4)(), (_INT * 4)()
        self._ok(self.lib.nvjpegGetImageInfo(self.handle, data, len(data), ctypes.byref(n), ctypes.byref(css),
                                             widths, heights), "nvjpegGetImageInfo")
        planes = n.value if n.value in (1, 3) else 0
        return JpegInfo(widths[0], heights[0], n.value, css.value, tuple(widths[:planes]), tuple(heights[:planes]))

    def unsupported(self, data: bytes, info: JpegInfo) -> str | None:
        """Why the hardware decoder (or our conversion) cannot take this image, None if it can."""
        if info.components not in (1, 3) or info.subsampling not in SUBSAMPLING:
            return f"{info.components} components, {SUBSAMPLING_NAMES.get(info.subsampling, info.subsampling)}"
        self._ok(self.lib.nvjpegJpegStreamParseHeader(self.handle, data, len(data), self.jpeg_stream), "ParseHeader")
        flag = _INT(-1)
        self._ok(self.lib.nvjpegDecodeBatchedSupported(self.handle, self.jpeg_stream, ctypes.byref(flag)),
                 "nvjpegDecodeBatchedSupported")
        return None if flag.value == 0 else "not decodable by the hardware decoder (e.g. progressive)"

    def close(self) -> None:
        """Waits for the latest decode, then lets its bitstreams go: before the decoder is dropped (its
        nvJPEG handle is not destroyed; one per model instance, kept for its life)."""
        if self._last is not None:
            self._last[0].synchronize()
            self._last = None

    def decode_planes(self, datas: list[bytes], infos: list[JpegInfo]) -> "DecodedPlanes":
        """Every image's planes (Y[, Cb, Cr]) as uint8 on the device, written by one batched hardware
        decode on the current stream, laid out back to back in one buffer. Only offsets
        are computed here, no per-plane tensor views (in the stub, for eight images, the phase that made
        them took about 0.17 ms more, docs/jpeg_decoding.md): DecodedPlanes.stacked views a run of them.

        The bitstreams go to nvJPEG as the bytes objects they are. Copying them into page-locked memory
        first was tried twice and cost more host time than it saved (docs/jpeg_decoding.md).

        Before the decode, the host waits for the current stream's earlier work, the previous decode's
        included (docs/jpeg_decoding.md#one-hardware-decode-at-a-time). nvJPEG's hardware decoder is not
        ordered after that work the way a kernel is: it may write its output before earlier work has
        read the memory the allocator handed over; and a pipeline that queued decodes behind earlier work
        with no such wait (since removed: docs/findings.md#one-model-instead-of-the-ensemble) now and then
        hung on the H200 with its preprocessing stream never finishing, which the wait ended (the exact
        trigger was not isolated). Where requests are
        answered one at a time the stream is idle by then, and the wait costs nothing."""
        stream = torch.cuda.current_stream(self.device)
        stream.synchronize()
        if self._last is not None:  # it may have run on another stream (the start-up self-check's)
            self._last[0].synchronize()
            self._last = None  # the previous decode has run: its bitstreams may go
        starts, total = [], 0
        for info in infos:
            starts.append(total)
            total += plane_bytes(info)
        slack = 1 << 16  # room past the last plane, should the decoder write whole MCU rows
        buffer = torch.empty(total + slack, dtype=torch.uint8, device=self.device)
        base = buffer.data_ptr()
        images = (_Image * len(datas))()
        for k, (info, start) in enumerate(zip(infos, starts)):
            for c, (w, offset) in enumerate(zip(info.widths, plane_offsets(info))):
                images[k].channel[c], images[k].pitch[c] = base + start + offset, w
        self._ok(self.lib.nvjpegDecodeBatchedInitialize(self.handle, self.state, len(datas), 1, NVJPEG_OUTPUT_YUV),
                 "nvjpegDecodeBatchedInitialize")
        pointers = (ctypes.c_char_p * len(datas))(*datas)
        lengths = (_SIZE * len(datas))(*[len(d) for d in datas])
        try:
            self._ok(self.lib.nvjpegDecodeBatched(self.handle, self.state, pointers, lengths, images,
                                                  _P(stream.cuda_stream)), "nvjpegDecodeBatched")
        except NvJpegError:
            # Work it queued before failing may still write `buffer` or read the bitstreams: let it end
            # before both go (the caller falls back to Pillow, whose tensors may get the same block).
            stream.synchronize()
            raise
        event = torch.cuda.Event()
        event.record(stream)
        self._last = (event, list(datas))
        return DecodedPlanes(buffer, tuple(starts), tuple(infos))


def plane_bytes(info: JpegInfo) -> int:
    """Bytes of one image's planes, back to back (pitch = width)."""
    return sum(w * h for w, h in zip(info.widths, info.heights))


def plane_offsets(info: JpegInfo) -> tuple[int, ...]:
    """Where each of one image's planes (Y[, Cb, Cr]) starts, in bytes from its first: back to back,
    pitch = width. decode_planes points nvJPEG there, DecodedPlanes.stacked reads there."""
    offsets, offset = [], 0
    for w, h in zip(info.widths, info.heights):
        offsets.append(offset)
        offset += w * h
    return tuple(offsets)


@dataclass(frozen=True)
class DecodedPlanes:
    """Where one batched decode wrote its images' planes: in `buffer` (uint8, flat), image k's planes
    (Y[, Cb, Cr], each (rows, cols) of infos[k], pitch = cols) back to back from element starts[k]."""

    buffer: torch.Tensor
    starts: tuple[int, ...]
    infos: tuple[JpegInfo, ...]

    def stacked(self, run: Sequence[int]) -> list[torch.Tensor]:
        """The planes of images `run` (one info, consecutive in the buffer) as one (n, rows, cols)
        strided view per plane kind, image i at i * (its planes' bytes): one kernel launch reads them all.
        Raises if they are not one image's bytes apart (the caller then decodes them with Pillow) rather
        than have the kernel read other bytes."""
        info, first = self.infos[run[0]], self.starts[run[0]]
        step = plane_bytes(info)
        for i, k in enumerate(run):
            if self.infos[k] != info:
                raise RuntimeError(f"image {i} of a run has other planes than the first ({self.infos[k]} against {info})")
            if self.starts[k] != first + i * step:
                raise RuntimeError(f"the decoder's planes are not back to back (image {i} of a run)")
        buffer = self.buffer
        if buffer.dim() != 1 or buffer.stride(0) != 1 or first < 0 or first + len(run) * step > buffer.numel():
            raise RuntimeError(f"the run's planes ({len(run)} x {step} bytes from {first}) do not lie in the "
                               f"decode's flat buffer of {buffer.numel()} bytes")
        base = buffer.storage_offset() + first
        return [buffer.as_strided((len(run), h, w), (step, w, 1), base + offset)
                for w, h, offset in zip(info.widths, info.heights, plane_offsets(info))]
