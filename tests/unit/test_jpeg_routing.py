"""Which images the exact GPU JPEG path may take (decided from Pillow's header alone), and the start-up
self-check that turns GPU decoding off when one pixel differs. The decode itself is tested on the GPU
(tests/gpu/test_jpeg_decode.py). Also the Preprocessor as an orchestrator over its decoders: a fake
decoder shows the routing, the order, the counting and the pass done again; stand-ins for nvJPEG the GPU
JPEG decoder's batches."""

import io
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from backends.kernels import jpeg_color
from backends.preprocess import jpeg_gpu
from backends.preprocess.jpeg_gpu import GpuJpegDecoder, pillow_reason
from backends.preprocess.nvjpeg import DecodedPlanes, JpegInfo, plane_bytes, plane_offsets
from oracles.jpeg_corpus import header_segments, sos_offset


def _img(mode="RGB", fmt="JPEG", size=(37, 21), **save):
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    rgb.convert(mode).save(buf, fmt, **save)
    return buf.getvalue()


@pytest.mark.parametrize("blob,reason", [
    (_img(subsampling=0), None), (_img(subsampling=1), None), (_img(subsampling=2), None),
    (_img("L"), None),
    (_img(progressive=True), "progressive"),
    (_img("CMYK"), "color_space"),
    (_img(fmt="PNG"), "not_jpeg"),
    (_img(fmt="WEBP"), "not_jpeg"),
], ids=["444", "422", "420", "gray", "progressive", "cmyk", "png", "webp"])
def test_route_is_decided_from_the_header(blob, reason):
    assert pillow_reason(Image.open(io.BytesIO(blob))) == reason


def test_an_rgb_coded_jpeg_stays_on_pillow():
    img = Image.open(io.BytesIO(_img(subsampling=0)))
    img.info.pop("jfif", None)
    img.info.update(adobe=100, adobe_transform=0)  # Adobe APP14 transform 0: R, G, B stored as they are
    assert pillow_reason(img) == "color_space"


def _rgb_component_ids(blob: bytes) -> bytes:
    """The JPEG with its JFIF segment removed and components named R, G, B (in SOF0 and SOS): a file
    libjpeg reads as stored RGB, without a YCbCr transform."""
    assert blob[2:4] == b"\xff\xe0"  # JFIF APP0 right after SOI
    blob = blob[:2] + blob[4 + int.from_bytes(blob[4:6], "big"):]
    out = bytearray(blob)
    for i, marker, _ in header_segments(blob):
        if marker == 0xC0:  # SOF0: 3 components of (id, sampling, table) after 6 bytes
            for k, name in enumerate(b"RGB"):
                out[i + 10 + 3 * k] = name
    i = sos_offset(blob)
    assert out[i + 4] == 3  # SOS: 3 components of (id, tables)
    for k, name in enumerate(b"RGB"):
        out[i + 5 + 2 * k] = name
    return bytes(out)


def test_a_jpeg_with_r_g_b_component_ids_and_no_jfif_stays_on_pillow():
    blob = _rgb_component_ids(_img(subsampling=0))
    img = Image.open(io.BytesIO(blob))
    assert "jfif" not in img.info and [layer[0] for layer in img.layer] == list(b"RGB")
    assert pillow_reason(img) == "color_space"
    assert np.asarray(img.convert("RGB")).shape == (21, 37, 3)  # Pillow still decodes it
    assert pillow_reason(Image.open(io.BytesIO(_img(subsampling=0)))) is None  # the file before the edit


@pytest.mark.parametrize("fault", [None, "one pixel", "raise", "refused"])
def test_self_check_counts_a_single_differing_pixel_and_survives_a_raise(monkeypatch, fault):
    """The start-up self-check against Pillow itself: equal everywhere keeps GPU decoding on; one level of
    one pixel in one image, a decode that raises, or a scan check that refuses a well-formed generated
    file, turns it off and says which."""
    from concurrent.futures import Future

    # decode_async is replaced below; close() is what the decoder is asked when it is turned off
    monkeypatch.setattr(jpeg_gpu, "HardwareJpegDecoder", lambda device: SimpleNamespace(close=lambda: None))

    def decode_async(self, blobs, images):
        if fault == "raise":
            raise RuntimeError("the colour kernel failed")
        out = [torch.from_numpy(np.asarray(Image.open(io.BytesIO(b)).convert("RGB")).copy()) for b in blobs]
        if fault == "one pixel":
            out[5][0, 0, 1] ^= 1
        pending = {}
        for k in range(len(blobs)):
            pending[k] = Future()
            pending[k].set_result("scan_range" if fault == "refused" and k in (2, 7) else None)
        return out, pending

    monkeypatch.setattr(GpuJpegDecoder, "decode_async", decode_async)
    decoder = GpuJpegDecoder(torch.device("cpu"), enabled=True)
    assert decoder.enabled == (fault is None), decoder.off_reason
    assert decoder.off_reason == {None: "",
                                  "one pixel": "self-check: 1 of the generated JPEGs differ from Pillow",
                                  "raise": "self-check: it raised RuntimeError: the colour kernel failed",
                                  "refused": "self-check: the scan check refused 2 of the generated JPEGs (scan_range)"}[fault]


class _WrongDecoder:
    """Stands in for nvJPEG: sensible shapes, wrong pixels."""

    def __init__(self, device):
        pass

    def info(self, data):
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if img.mode == "L":
            return JpegInfo(w, h, 1, 6, (w,), (h,))
        (_, fx, fy, _) = img.layer[0]
        return JpegInfo(w, h, 3, {(1, 1): 0, (2, 1): 1, (2, 2): 2, (1, 2): 3}[(fx, fy)],
                        (w, -(-w // fx), -(-w // fx)), (h, -(-h // fy), -(-h // fy)))

    def unsupported(self, data, info):
        return None

    def close(self):
        pass

    def decode_planes(self, datas, infos):
        """Flat grey planes, laid out as the real one lays them out: per image Y, Cb, Cr in one buffer."""
        starts = np.cumsum([0] + [plane_bytes(i) for i in infos]).tolist()
        buf = torch.full((starts[-1],), 77, dtype=torch.uint8)
        return DecodedPlanes(buf, tuple(starts[:-1]), tuple(infos))


def _batch_reference(y, cb, cr, fx, fy):  # the conversion, without the GPU kernel
    return torch.stack([jpeg_color.ycc_to_rgb_reference(y[k], cb[k], cr[k], fx, fy) for k in range(y.shape[0])])


def test_self_check_turns_gpu_decoding_off_when_a_pixel_differs(monkeypatch, caplog):
    monkeypatch.setattr(jpeg_gpu, "HardwareJpegDecoder", _WrongDecoder)
    monkeypatch.setattr(jpeg_color, "ycc_to_rgb_batch", _batch_reference)
    decoder = GpuJpegDecoder(torch.device("cpu"), enabled=True)
    # Every generated JPEG decodes (to flat grey) and differs: the check counts them, it did not raise.
    assert not decoder.enabled and "of the generated JPEGs differ from Pillow" in decoder.off_reason, decoder.off_reason
    assert any("GPU JPEG decoding is off" in r.getMessage() for r in caplog.records)
    assert decoder.reason(Image.open(io.BytesIO(_img()))) == "gpu_decode_off"


def test_without_nvjpeg_the_preprocessor_says_why_and_uses_pillow():
    decoder = GpuJpegDecoder(torch.device("cpu"), enabled=True)  # no GPU, no hardware decoder here
    assert not decoder.enabled and "no CUDA device" in decoder.off_reason
    assert decoder.reason(Image.open(io.BytesIO(_img()))) == "gpu_decode_off"


def _samplings(blobs) -> list:
    out = []
    for blob in blobs:
        img = Image.open(io.BytesIO(blob))
        assert pillow_reason(img) is None
        out.append(img.mode if img.mode == "L" else tuple(img.layer[0][1:3]))
    return out


def test_self_check_covers_every_sampling_the_gpu_path_takes():
    """Every sampling the colour kernel is trusted with (and grayscale) meets the hardware decoder at
    start-up; gray and colour each in a run of two or more, the way requests of same-sized images come."""
    from backends.kernels.jpeg_color import SAMPLING

    samplings = _samplings(jpeg_gpu.self_check_images())
    assert set(samplings) == set(SAMPLING) | {"L"}
    assert any(a == b == "L" for a, b in zip(samplings, samplings[1:]))


def test_self_check_meets_both_ways_to_the_planes():
    """The self-check's images reach the hardware decoder with their planes from the walked header
    (header_info) and from nvJPEG's own header read, both for every size and sampling (4:4:0, one file,
    the first way only)."""
    from backends.preprocess.decode import HeaderOnly
    from backends.preprocess.nvjpeg import header_info

    blobs = jpeg_gpu.self_check_images()
    handles = jpeg_gpu.self_check_handles(blobs)
    ways: dict = {}
    for blob, sampling, handle in zip(blobs, _samplings(blobs), handles):
        walked = isinstance(handle, HeaderOnly)
        assert not walked or header_info(handle.header) is not None
        ways.setdefault((Image.open(io.BytesIO(blob)).size, sampling), set()).add(walked)
    assert ways.pop(((67, 45), (1, 2))) == {True}
    assert all(w == {True, False} for w in ways.values()) and len(ways) == 4 * 4, ways


def test_the_exact_decode_corpus_holds_every_sampling_without_opencv():
    """tests/gpu compares the whole corpus with Pillow: 4:4:0 comes from committed files, not from an
    OpenCV that may be missing."""
    from backends.kernels.jpeg_color import SAMPLING
    from oracles.jpeg_corpus import corpus

    assert set(_samplings(b for _, b in corpus())) == set(SAMPLING) | {"L"}


def test_runs_group_consecutive_images_of_one_info():
    """Which decoded images share one colour-kernel launch (or one grayscale copy)."""
    from backends.preprocess.jpeg_gpu import _runs

    color = JpegInfo(4, 2, 3, 2, (4, 2, 2), (2, 1, 1))  # 4:2:0
    gray = JpegInfo(4, 2, 1, 6, (4,), (2,))
    other = JpegInfo(6, 2, 3, 2, (6, 3, 3), (2, 1, 1))
    infos = [color, color, color, gray, gray, color, other, color, color]
    assert [list(r) for r in _runs(infos)] == [[0, 1, 2], [3, 4], [5], [6], [7, 8]]
    assert _runs([]) == [] and [list(r) for r in _runs([gray])] == [[0]]


def _decoder_over(info: JpegInfo, starts: tuple[int, ...]) -> GpuJpegDecoder:
    """A GpuJpegDecoder whose stand-in hardware decoder reads every blob as `info` and says it wrote
    image k's planes from starts[k] of one buffer."""
    planes = DecodedPlanes(torch.zeros(max(starts) + plane_bytes(info), dtype=torch.uint8), starts, (info,) * len(starts))
    dec = object.__new__(GpuJpegDecoder)
    dec.decoder = SimpleNamespace(info=lambda blob: info, unsupported=lambda blob, i: None,
                                  decode_planes=lambda datas, infos: planes)
    dec.stats = Counter()
    return dec


def _use(pre, dec: GpuJpegDecoder) -> None:
    """`pre` (a CPU Preprocessor) with `dec` first in line, counting in its decode_stats as a GPU
    Preprocessor's GPU decoder does."""
    dec.stats = pre.decode_stats
    pre.decoders.insert(0, dec)
    assert pre.jpeg is dec


def test_planes_not_back_to_back_raise_instead_of_converting_wrong_pixels():
    """A run is read as strided views one image apart; a decoder whose images lie otherwise must stop
    the decode (the preprocessor then decodes those images with Pillow), not feed the kernel."""
    info = JpegInfo(4, 2, 3, 2, (4, 2, 2), (2, 1, 1))  # 12 bytes of planes per image
    layouts = {"the last image elsewhere": (0, 12, 40), "the middle image elsewhere": (0, 60, 24),
               "overlapping images": (0, 6, 12)}
    for what, starts in layouts.items():
        dec = _decoder_over(info, starts)
        blobs = [bytes([k]) + b"\xff\xd9" for k in range(3)]
        with pytest.raises(RuntimeError, match="back to back"):
            dec.decode(blobs, [SimpleNamespace(size=(4, 2))] * 3)
        assert dec.stats == Counter(), what  # nothing counted: the caller counts the Pillow decode


def test_decoded_planes_view_a_run_where_the_decoder_wrote_it():
    """DecodedPlanes.stacked gives, for each plane kind, image i's plane at its own offset (the pointers
    decode_planes hands nvJPEG), in a buffer that is itself a view with an offset."""
    info = JpegInfo(4, 2, 3, 2, (4, 2, 2), (2, 1, 1))  # Y 2x4, Cb 1x2, Cr 1x2: 12 bytes per image
    base = torch.arange(64, dtype=torch.uint8)
    buf = base[3:]
    planes = DecodedPlanes(buf, (0, 12, 24, 36), (info,) * 4)
    y, cb, cr = planes.stacked(range(1, 4))
    assert y.shape == (3, 2, 4) and cb.shape == cr.shape == (3, 1, 2)
    for i, k in enumerate(range(1, 4)):
        start = 3 + 12 * k
        assert torch.equal(y[i], base[start: start + 8].view(2, 4))
        assert torch.equal(cb[i], base[start + 8: start + 10].view(1, 2))
        assert torch.equal(cr[i], base[start + 10: start + 12].view(1, 2))
    assert plane_bytes(info) == 12 and plane_bytes(JpegInfo(5, 3, 1, 6, (5,), (3,))) == 15
    assert plane_offsets(info) == (0, 8, 10) and plane_offsets(JpegInfo(5, 3, 1, 6, (5,), (3,))) == (0,)


def test_decoded_planes_refuse_what_would_read_other_bytes():
    """stacked() raises rather than view bytes that are not the run's: images of another kind in the run,
    a run past the end of the buffer (though inside its storage), a buffer that is not flat."""
    info = JpegInfo(4, 2, 3, 2, (4, 2, 2), (2, 1, 1))  # 12 bytes per image
    gray = JpegInfo(4, 2, 1, 6, (4,), (2,))
    base = torch.arange(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="other planes"):
        DecodedPlanes(base, (0, 12), (info, gray)).stacked(range(2))
    with pytest.raises(RuntimeError, match="do not lie in"):
        DecodedPlanes(base[:24], (0, 12, 24), (info,) * 3).stacked(range(3))  # the third past the view's end
    with pytest.raises(RuntimeError, match="do not lie in"):
        DecodedPlanes(base[::2], (0, 12), (info,) * 2).stacked(range(2))  # every other byte: not flat
    assert [v.shape for v in DecodedPlanes(base[:24], (0, 12), (info,) * 2).stacked(range(2))] == [
        (2, 2, 4), (2, 1, 2), (2, 1, 2)]


class _Event:
    """A recorded event the test decides has or has not been passed by the stream; counts queries."""

    def __init__(self, done, queries):
        self.done, self.queries = done, queries

    def query(self):
        self.queries.append(1)
        return self.done

    def synchronize(self):
        self.done = True


def test_closing_the_decoder_waits_for_the_latest_decode_then_lets_its_bitstreams_go():
    """decode_planes drains its stream before each decode, so only the latest decode may still be
    reading its bitstreams: close waits for it and drops them."""
    from backends.preprocess.nvjpeg import HardwareJpegDecoder

    dec = HardwareJpegDecoder.__new__(HardwareJpegDecoder)  # no CUDA needed for the bookkeeping
    event = _Event(False, [])
    dec._last = (event, [b"jpeg"])
    dec.close()
    assert event.done and dec._last is None
    dec.close()  # nothing held: nothing to wait for


class _OrderedLib:
    """nvJPEG's two decode calls, logged in `calls`; the decode fails with `status` if set."""

    def __init__(self, calls, status=0):
        self.calls, self.status = calls, status

    def nvjpegDecodeBatchedInitialize(self, *args):
        self.calls.append("initialize")
        return 0

    def nvjpegDecodeBatched(self, *args):
        self.calls.append("decode")
        return self.status


def _logged_decoder(monkeypatch, calls, status=0):
    """A HardwareJpegDecoder on the CPU whose stream, events and library log what decode_planes asks of
    them, in order (no CUDA needed)."""
    from backends.preprocess import nvjpeg

    class Stream:
        cuda_stream = 0

        def synchronize(self):
            calls.append("drain")

    class Event:
        def record(self, stream):
            calls.append("record")

        def synchronize(self):
            calls.append("wait for the latest decode")

    monkeypatch.setattr(nvjpeg.torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(nvjpeg.torch.cuda, "Event", Event)
    dec = nvjpeg.HardwareJpegDecoder.__new__(nvjpeg.HardwareJpegDecoder)
    dec.device, dec.lib, dec.handle, dec.state, dec._last = torch.device("cpu"), _OrderedLib(calls, status), None, None, None
    return dec, Event


def test_each_decode_waits_for_the_stream_and_the_latest_decode_before_it_starts(monkeypatch):
    """nvJPEG's hardware decode is not ordered on its stream (docs/jpeg_decoding.md#one-hardware-decode-at-a-time):
    decode_planes drains the stream, then waits for the latest decode (which may have run on another
    stream) before it lets that decode's bitstreams go, and only then decodes."""
    from backends.preprocess.nvjpeg import JpegInfo

    calls = []
    dec, event = _logged_decoder(monkeypatch, calls)
    info = JpegInfo(4, 2, 3, 2, (4, 2, 2), (2, 1, 1))
    dec._last = (event(), [b"previous"])
    planes = dec.decode_planes([b"jpeg"], [info])
    assert calls == ["drain", "wait for the latest decode", "initialize", "decode", "record"]
    assert dec._last[1] == [b"jpeg"] and planes.buffer.numel() >= 12  # this decode's bitstreams held


def test_a_failed_decode_is_waited_for_before_its_buffer_goes(monkeypatch):
    """Work nvJPEG queued before failing may still write the buffer, which the Pillow fallback's tensors
    could get next: the stream is drained before the error goes up."""
    from backends.preprocess.nvjpeg import JpegInfo, NvJpegError

    calls = []
    dec, _ = _logged_decoder(monkeypatch, calls, status=6)  # EXECUTION_FAILED
    with pytest.raises(NvJpegError, match="EXECUTION_FAILED"):
        dec.decode_planes([b"jpeg"], [JpegInfo(4, 2, 3, 2, (4, 2, 2), (2, 1, 1))])
    assert calls == ["drain", "initialize", "decode", "drain"] and dec._last is None


def test_a_gpu_decode_that_raises_leaves_the_batch_to_pillow_each_image_counted_once():
    """The preprocessor's fallback: the decoder raises (here its planes are not back to back) after some of
    the batch was routed; every image is then decoded by Pillow, equal to the CPU path, and counted once."""
    from backends.config import MediaConfig
    from backends.preprocess.preprocessor import Preprocessor
    from clients.samples import encode, photo_like

    blobs = [encode(photo_like(40, 30, seed=s), "JPEG", quality=90) for s in range(3)]
    blobs.append(blobs[0] + b"trailing")  # routed to Pillow by decode itself (no end marker at the end)
    info = JpegInfo(40, 30, 3, 2, (40, 20, 20), (30, 15, 15))  # 1800 bytes of planes per image
    dec = _decoder_over(info, (0, 1800, 5000))
    pre = Preprocessor(MediaConfig())
    _use(pre, dec)
    got, grid, _ = pre(blobs)
    want, want_grid, _ = Preprocessor(MediaConfig())(blobs)
    assert torch.equal(got, want) and grid.tolist() == want_grid.tolist()
    assert dec.stats == Counter({("pillow", "gpu_error"): 4})


def test_a_damaged_scan_goes_to_pillow_whatever_the_gpu_made_of_it(monkeypatch):
    """The stand-in hardware decoder answers flat grey for every file. A JPEG whose scan the check
    refuses comes back from Pillow (equal to the CPU path, counted by the check's reason); a well-formed
    one keeps the GPU's answer (grey: the stand-in is really used). The request is preprocessed twice,
    and every image counted once (a PNG among them)."""
    from backends.config import MediaConfig
    from backends.preprocess.preprocessor import Preprocessor
    from clients.samples import encode, photo_like

    monkeypatch.setattr(jpeg_color, "ycc_to_rgb_batch", _batch_reference)
    good = encode(photo_like(40, 30, seed=1), "JPEG", quality=90)
    bad = good[:-2] + b"\x12\x34" + good[-2:]  # bytes left over before the end marker
    dec = object.__new__(GpuJpegDecoder)
    dec.decoder, dec.stats = _WrongDecoder(None), Counter()
    pre = Preprocessor(MediaConfig())
    _use(pre, dec)
    png = encode(photo_like(40, 30, seed=2), "PNG")
    got, _, _ = pre([bad, png, good])
    want, _, _ = Preprocessor(MediaConfig())([bad, png, good])
    third = got.shape[0] // 3
    assert torch.equal(got[:2 * third], want[:2 * third]) and not torch.equal(got[2 * third:], want[2 * third:])
    assert dec.stats == Counter({("pillow", "scan_extra_bytes"): 1, ("pillow", "not_jpeg"): 1, ("gpu", ""): 1})


def test_without_the_scan_check_no_jpeg_goes_to_the_gpu(monkeypatch):
    """No C compiler to build the scan check: the decoder stays off and says why, even where a hardware
    decoder would be there (a stand-in here)."""
    from backends.preprocess import scan_check

    def unavailable():
        raise scan_check.ScanCheckUnavailable("no C compiler ('cc') to build scan_check.c")

    monkeypatch.setattr(jpeg_gpu, "HardwareJpegDecoder", _WrongDecoder)
    monkeypatch.setattr(scan_check, "library", unavailable)
    decoder = GpuJpegDecoder(torch.device("cpu"), enabled=True)
    assert not decoder.enabled and decoder.off_reason == "no C compiler ('cc') to build scan_check.c"
    assert decoder.reason(Image.open(io.BytesIO(_img()))) == "gpu_decode_off"


def test_scan_checks_start_before_the_headers_are_read_and_run_once_per_jpeg(monkeypatch):
    """The checks start with the request (before Pillow reads the headers), a pass done again reuses
    their answers, and no check is made of what is not a JPEG, nor of one with bytes after its end."""
    from backends.config import MediaConfig
    from backends.preprocess import scan_check
    from backends.preprocess.preprocessor import Preprocessor
    from clients.samples import encode, photo_like

    checked = []

    class Counting(scan_check.Checks):
        def __init__(self, blobs, *args):
            checked.extend(bytes(b[:2]) for b in blobs)
            super().__init__(blobs, *args)

    monkeypatch.setattr(scan_check, "Checks", Counting)
    monkeypatch.setattr(jpeg_color, "ycc_to_rgb_batch", _batch_reference)
    good = encode(photo_like(40, 30, seed=1), "JPEG", quality=90)
    bad = good[:-2] + b"\x12\x34" + good[-2:]
    png = encode(photo_like(40, 30, seed=2), "PNG")
    dec = object.__new__(GpuJpegDecoder)
    dec.decoder, dec.stats = _WrongDecoder(None), Counter()
    pre = Preprocessor(MediaConfig())
    _use(pre, dec)
    order = []
    start = dec.start_checks
    monkeypatch.setattr(dec, "start_checks", lambda *a: order.append("checks") or start(*a), raising=False)
    monkeypatch.setattr(pre, "open", lambda blobs: order.append("headers") or Preprocessor.open(pre, blobs))
    trailing = good + b"\x00\x00"  # bytes after the end marker: Pillow decodes it, unchecked
    pre([bad, png, good, trailing])  # refused `bad`: preprocessed twice
    assert order == ["checks", "headers"]
    assert checked == [b"\xff\xd8"] * 2  # the two whole JPEGs, once each over both passes; never the PNG
    assert dec.stats == Counter({("pillow", "scan_extra_bytes"): 1, ("pillow", "not_jpeg"): 1, ("gpu", ""): 1,
                                 ("pillow", "no_end_marker"): 1})
    checked.clear()  # decode_async on its own starts no check either for a file without its end marker
    dec.decode([good, trailing], [Image.open(io.BytesIO(b)) for b in (good, trailing)])
    assert checked == [b"\xff\xd8"]


class _FakeDecoding:
    """A decoder's part of a request, for the orchestrator's tests: takes the images in `takes` (else
    "not_mine"), decodes them as Pillow does (so the request's result is the CPU path's), gives back those
    in `gives_back` (counted "given_back"), and in its first settle takes back those in `takes_back` (the
    next pass refuses them, "second_thoughts"). Logs what it is asked in `log`."""

    def __init__(self, log, stats, takes, gives_back=(), takes_back=()):
        self.log, self.stats, self.takes = log, stats, set(takes)
        self.gives_back, self.takes_back = set(gives_back), set(takes_back)
        self.refused, self.decoded = {}, []

    def refusal(self, index, image):
        return self.refused.get(index) or (None if index in self.takes else "not_mine")

    def frames(self, frames):
        from backends.preprocess.decode import decode_rgb

        self.log.append(("routed", [f.index for f in frames]))
        for f in frames:
            self.log.append(("decode", f.index))
            if f.index in self.gives_back:
                self.stats[("pillow", "given_back")] += 1
                yield None
            else:
                self.decoded.append(f.index)
                yield torch.from_numpy(np.array(decode_rgb(f.image, f.index)))

    def settle(self):
        refused = {i: "second_thoughts" for i in self.decoded if i in self.takes_back and not self.refused}
        self.log.append(("settle", sorted(refused)))
        if not refused:
            self.stats[("fake", "")] += len(self.decoded)
        self.refused.update(refused)
        self.decoded = []
        return refused

    def close(self):
        self.log.append("close")


class _Fake:
    name = "fake"

    def __init__(self, pre, **kw):
        self.log, self.kw, self.stats = [], kw, pre.decode_stats

    def start(self, blobs, max_pixels):
        self.log.append("start")
        self.decoding = _FakeDecoding(self.log, self.stats, **self.kw)
        return self.decoding


def _request():
    """Six images in five media (a 2-frame video chunk among them), JPEG and PNG, two sizes."""
    from clients.samples import encode, photo_like

    blobs = [encode(photo_like(w, h, seed=s), fmt, **({"quality": 90} if fmt == "JPEG" else {}))
             for s, (w, h, fmt) in enumerate([(60, 40, "JPEG"), (60, 40, "PNG"), (50, 70, "JPEG"), (50, 70, "JPEG"),
                                              (33, 20, "PNG"), (60, 40, "JPEG")])]
    return blobs, [0, 0, 2, 0, 0]


def _fake_first(**kw):
    from backends.config import MediaConfig
    from backends.preprocess.preprocessor import Preprocessor

    pre = Preprocessor(MediaConfig())
    fake = _Fake(pre, **kw)
    pre.decoders.insert(0, fake)
    log = fake.log
    opened = pre.open
    pre.open = lambda blobs: log.append("headers") or opened(blobs)
    return pre, fake


def _cpu_answer(blobs, frames):
    from backends.config import MediaConfig
    from backends.preprocess.preprocessor import Preprocessor

    pre = Preprocessor(MediaConfig())
    want, grid, _ = pre(blobs, media_frames=frames)
    return want, grid.tolist(), pre.decode_stats


def test_each_frame_goes_to_the_first_decoder_that_takes_it_and_comes_back_in_order():
    """The fake takes images 0, 2 and 5; Pillow the rest, counted under the fake's refusal; every frame
    comes back in prompt order (the result is the CPU path's), the fake's part started before the headers
    are read and closed at the end, its answers counted once settled."""
    blobs, frames = _request()
    pre, fake = _fake_first(takes={0, 2, 5})
    got, grid, _ = pre(blobs, media_frames=frames)
    want, want_grid, cpu_stats = _cpu_answer(blobs, frames)
    assert torch.equal(got, want) and grid.tolist() == want_grid
    assert fake.log == ["start", "headers", ("routed", [0, 2, 5]), ("decode", 0), ("decode", 2), ("decode", 5),
                        ("settle", []), "close"]
    assert pre.decode_stats == Counter({("fake", ""): 3, ("pillow", "not_mine"): 3})
    assert cpu_stats == Counter({("pillow", "no_gpu"): 6})  # no decoder ahead of Pillow


def test_a_frame_given_back_is_decoded_by_pillow_and_counted_once():
    blobs, frames = _request()
    pre, fake = _fake_first(takes={0, 2, 3, 5}, gives_back={3})
    got, grid, _ = pre(blobs, media_frames=frames)
    want, want_grid, _ = _cpu_answer(blobs, frames)
    assert torch.equal(got, want) and grid.tolist() == want_grid
    assert pre.decode_stats == Counter({("fake", ""): 3, ("pillow", "not_mine"): 2, ("pillow", "given_back"): 1})


def test_an_answer_taken_back_makes_a_second_pass_with_that_image_on_pillow():
    """As a scan check's refusal does: the request is computed again, the image taken back routed to
    Pillow under the decoder's reason, the others to the fake again; every image counted once, over both
    passes."""
    blobs, frames = _request()
    pre, fake = _fake_first(takes={0, 2, 3, 5}, takes_back={2})
    got, grid, _ = pre(blobs, media_frames=frames)
    want, want_grid, _ = _cpu_answer(blobs, frames)
    assert torch.equal(got, want) and grid.tolist() == want_grid
    assert fake.log == ["start", "headers",
                        ("routed", [0, 2, 3, 5]), ("decode", 0), ("decode", 2), ("decode", 3), ("decode", 5),
                        ("settle", [2]),
                        ("routed", [0, 3, 5]), ("decode", 0), ("decode", 3), ("decode", 5), ("settle", []),
                        "close"]
    assert pre.decode_stats == Counter({("fake", ""): 3, ("pillow", "not_mine"): 2, ("pillow", "second_thoughts"): 1})


def test_frames_are_decoded_as_they_are_wanted_and_a_failed_request_closes_its_decoders():
    """Cancelled after the first media: the fake decoded only what came before, nothing was settled, and
    its part of the request was closed; a frame Pillow cannot decode fails the request the same way."""
    from backends.errors import RequestCancelled, RequestError

    blobs, frames = _request()
    pre, fake = _fake_first(takes={0, 2, 5})
    asked = []
    with pytest.raises(RequestCancelled):
        pre(blobs, media_frames=frames, cancelled=lambda: asked.append(1) or len(asked) > 1)
    assert fake.log == ["start", "headers", ("routed", [0, 2, 5]), ("decode", 0), "close"]
    cut = blobs[:4] + [blobs[4][: len(blobs[4]) // 2], blobs[5]]  # image 4 (a PNG, Pillow's) truncated
    fake.log.clear()
    with pytest.raises(RequestError, match="image 4"):
        pre(cut, media_frames=frames)
    assert fake.log[-1] == "close" and ("settle", []) not in fake.log


def test_the_gpu_decoder_decodes_its_jpegs_in_batches_of_limited_pixels(monkeypatch):
    """Each batch is formed when its first JPEG is wanted: every later JPEG not yet decoded that still
    fits in GPU_DECODE_PIXELS, a PNG between them left to Pillow; a JPEG too large for the batch waits
    for one of its own, and one after it may still join."""
    from backends.config import MediaConfig
    from backends.preprocess.preprocessor import Preprocessor
    from clients.samples import encode, photo_like

    monkeypatch.setattr(jpeg_color, "ycc_to_rgb_batch", _batch_reference)
    monkeypatch.setattr(jpeg_gpu, "GPU_DECODE_PIXELS", 3000)
    sizes = [(40, 30), None, (40, 30), (80, 60), (40, 30), (10, 10), (40, 30)]  # None: a PNG
    blobs = [encode(photo_like(*(s or (40, 30)), seed=k), "PNG" if s is None else "JPEG", **({} if s is None else {"quality": 90}))
             for k, s in enumerate(sizes)]
    batches = []

    class Recording(_WrongDecoder):
        def decode_planes(self, datas, infos):
            batches.append([blobs.index(d) for d in datas])
            return super().decode_planes(datas, infos)

    dec = object.__new__(GpuJpegDecoder)
    dec.decoder = Recording(None)
    pre = Preprocessor(MediaConfig())
    _use(pre, dec)
    got, _, _ = pre(blobs)
    # 0 and 2 (2400 px), 3 and 4 too large to join, 5 (100 px) joining; then 3 alone (4800 px); then 4 and 6.
    assert batches == [[0, 2, 5], [3], [4, 6]]
    assert pre.decode_stats == Counter({("gpu", ""): 6, ("pillow", "not_jpeg"): 1})
    want, _, _ = Preprocessor(MediaConfig())(blobs)
    assert got.shape == want.shape


def _gray_sampled(blob: bytes, factors: int) -> bytes:
    """A grayscale JPEG with its one component's sampling byte set to `factors` (e.g. 0x22): still one
    component, decoded alike, but not the 1x1 that header_info knows."""
    out = bytearray(blob)
    for i, marker, _ in header_segments(blob):
        if marker in (0xC0, 0xC1):
            assert out[i + 9] == 1  # one component: (id, sampling, table) at i + 10
            out[i + 11] = factors
    return bytes(out)


def test_planes_come_from_the_walked_header_and_nvjpeg_reads_only_the_others(monkeypatch):
    """A JPEG opened by jpeg_header (a HeaderOnly, what a request gets for a plain file) has its planes from
    that header: nvJPEG's header read (info) is not asked for it; one Pillow opened, or a header
    header_info does not know (a grayscale component sampled 2x2), is read by nvJPEG as before. The
    hardware decoder's own verdict (unsupported) is asked for every one, and the planes are the same."""
    from backends.preprocess.decode import HeaderOnly, open_image

    monkeypatch.setattr(jpeg_color, "ycc_to_rgb_batch", _batch_reference)
    asked = []

    class Recording(_WrongDecoder):
        def info(self, data):
            asked.append(("info", blobs.index(data)))
            return super().info(data)

        def unsupported(self, data, info):
            asked.append(("unsupported", blobs.index(data)))
            return None

        def decode_planes(self, datas, infos):
            planes.extend(infos)
            return super().decode_planes(datas, infos)

    blobs = [_img(subsampling=2), _img(subsampling=0), _img("L"), _gray_sampled(_img("L", size=(33, 17)), 0x22)]
    walked = [open_image(b, k, 1 << 20) for k, b in enumerate(blobs)]
    assert all(isinstance(img, HeaderOnly) for img in walked)
    dec = object.__new__(GpuJpegDecoder)
    dec.decoder, dec.stats = Recording(None), Counter()
    planes = []
    dec.decode(blobs, walked)
    assert asked == [("unsupported", 0), ("unsupported", 1), ("unsupported", 2), ("info", 3), ("unsupported", 3)]
    from_headers = list(planes)
    asked.clear(), planes.clear()
    dec.decode(blobs, [Image.open(io.BytesIO(b)) for b in blobs])  # Pillow's handles: nvJPEG reads each
    assert asked == [(what, k) for k in range(4) for what in ("info", "unsupported")]
    assert planes == from_headers and dec.stats == Counter({("gpu", ""): 8})
