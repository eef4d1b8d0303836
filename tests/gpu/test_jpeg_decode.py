"""Exact JPEG decoding on the GPU: equal to Pillow's `Image.open(f).convert("RGB")` on the whole corpus,
the files it cannot reproduce left to Pillow and counted, and the preprocessing result unchanged."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from backends.config import MediaConfig
from backends.preprocess import Preprocessor
from backends.preprocess.decode import HeaderOnly, open_image
from backends.preprocess.jpeg_gpu import GpuJpegDecoder
from clients.samples import encode, photo_like
from oracles.jpeg_corpus import corpus, pillow_only

DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def decoder():
    d = GpuJpegDecoder(DEV, enabled=True)
    assert d.enabled, d.off_reason  # the self-check passed on this GPU
    return d


@pytest.mark.parametrize("handles", ["pillow", "walked"])
def test_every_corpus_file_equals_pillow(decoder, handles):
    """Opened by Pillow, the planes' sizes come from nvJPEG's own header read; opened as a request opens
    them (jpeg_header's walk, where it takes the file), from the walked header (nvjpeg.header_info)."""
    files = corpus()
    if handles == "pillow":
        images = [Image.open(io.BytesIO(b)) for _, b in files]
    else:
        images = [open_image(b, k, 1 << 30) for k, (_, b) in enumerate(files)]
        assert sum(isinstance(img, HeaderOnly) for img in images) >= len(files) - 1  # all but EXIF without JFIF
    assert all(decoder.reason(img) is None for img in images)
    before = decoder.stats[("gpu", "")]
    got = decoder.decode([b for _, b in files], images)
    differing = []
    for (label, blob), rgb in zip(files, got):
        assert rgb is not None, f"{label}: refused by the hardware decoder"
        ref = np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))
        if not np.array_equal(rgb.cpu().numpy(), ref):
            differing.append(label)
    assert differing == [], differing
    assert decoder.stats[("gpu", "")] == before + len(files)  # each counted once, none refused


def test_the_walked_header_gives_nvjpegs_own_planes(decoder):
    """nvjpeg.header_info, which spares a walked header nvJPEG's header read, against that read itself
    (HardwareJpegDecoder.info): the same planes, sampling and components for every file the route takes."""
    from backends.preprocess.jpeg_gpu import pillow_reason, self_check_images
    from backends.preprocess.nvjpeg import header_info

    compared = 0
    for blob in [b for _, b in corpus()] + self_check_images():
        img = open_image(blob, 0, 1 << 30)
        if not isinstance(img, HeaderOnly) or pillow_reason(img) is not None:
            continue
        assert header_info(img.header) == decoder.decoder.info(blob), img.header
        compared += 1
    assert compared >= len(corpus()) - 1


def test_files_it_cannot_reproduce_go_to_pillow_and_are_counted():
    pre = Preprocessor(MediaConfig(), device=DEV, out_dtype=torch.float32)
    assert pre.jpeg is not None and pre.jpeg.enabled
    for label, blob, reason in pillow_only():
        ref, _, _ = Preprocessor(MediaConfig())([blob])
        before = pre.decode_stats[("pillow", reason)]
        got, _, _ = pre([blob])
        assert torch.equal(got.cpu(), ref), label
        assert pre.decode_stats[("pillow", reason)] == before + 1, (label, dict(pre.decode_stats))


def test_preprocessing_with_gpu_decoding_equals_the_cpu_reference():
    files = [b for label, b in corpus() if label.startswith(("641x479", "1001x667", "333x222"))]
    ref, ref_grid, _ = Preprocessor(MediaConfig())(files)
    pre = Preprocessor(MediaConfig(), device=DEV, out_dtype=torch.float32)
    got, grid, _ = pre(files)
    assert grid.tolist() == ref_grid.tolist() and torch.equal(got.cpu(), ref)
    assert pre.decode_stats[("gpu", "")] == len(files)


def test_a_truncated_jpeg_is_refused_as_pillow_refuses_it():
    from backends.errors import RequestError

    blob = corpus()[-1][1]
    cut = blob[: len(blob) * 2 // 3]  # the header is intact; the scan ends early, no end-of-image marker
    with pytest.raises(RequestError, match="image 0"):
        Preprocessor(MediaConfig())([cut])
    pre = Preprocessor(MediaConfig(), device=DEV, out_dtype=torch.float32)
    with pytest.raises(RequestError, match="image 0"):
        pre([cut])
    assert pre.decode_stats[("pillow", "no_end_marker")] == 1


def _jpeg(w, h, seed, gray=False, **save):
    img = Image.fromarray(photo_like(w, h, seed=seed))
    return encode(img.convert("L") if gray else img, "JPEG", **save)


def test_runs_of_same_sized_jpegs_equal_the_cpu_reference(monkeypatch):
    """Same-sized JPEGs in a row are converted in one launch and patchified in one launch; the result
    must not change: every run boundary (sampling, size, grayscale, another format) in one request."""
    from backends.kernels import jpeg_color, patchify

    launches = {"colour": [], "patchify": []}
    colour, patch = jpeg_color.ycc_to_rgb_batch, patchify.normalize_patchify
    monkeypatch.setattr(jpeg_color, "ycc_to_rgb_batch",
                        lambda y, *a, **k: launches["colour"].append(y.shape[0]) or colour(y, *a, **k))
    monkeypatch.setattr(patchify, "normalize_patchify",
                        lambda px, *a, **k: launches["patchify"].append(px.shape[0] if px.dim() == 4 else 1) or patch(px, *a, **k))
    files = ([_jpeg(448, 448, s, quality=90) for s in range(5)] + [_jpeg(448, 448, 9, quality=90, subsampling=0)]
             + [_jpeg(448, 448, s, quality=80) for s in range(10, 13)] + [_jpeg(300, 200, 1)]
             + [_jpeg(448, 448, s, gray=True) for s in range(2)] + [_jpeg(57, 31, s) for s in range(3)])

    files.insert(3, encode(photo_like(448, 448, seed=99), "PNG"))
    ref, ref_grid, _ = Preprocessor(MediaConfig())(files)
    pre = Preprocessor(MediaConfig(), device=DEV, out_dtype=torch.float32)
    for calls in launches.values():  # the decoder's start-up self-check converted its own JPEGs
        calls.clear()
    got, grid, _ = pre(files)
    assert grid.tolist() == ref_grid.tolist() and torch.equal(got.cpu(), ref)
    assert pre.decode_stats[("gpu", "")] == len(files) - 1
    # Runs formed: colour per decode run (448 4:2:0 x5, 4:4:4, 448 4:2:0 x3, 300x200, 57x31 x3; the gray
    # pair is one copy of repeated planes), patchify per run in prompt order (the PNG stands alone).
    assert launches["colour"] == [5, 1, 3, 1, 3], launches
    assert launches["patchify"] == [3, 1, 2, 1, 3, 1, 2, 3], launches


def _answer(pre, blob):
    from backends.errors import RequestError

    try:
        return pre([blob])[0].cpu()
    except RequestError as exc:
        return exc.reason


@pytest.mark.parametrize("seed", range(4))
def test_a_damaged_scan_gets_the_cpu_paths_answer(seed):
    """Header and end-of-image marker intact, the entropy-coded scan damaged (oracles/jpeg_corpus.damaged,
    and bytes flipped all along it): libjpeg-turbo (Pillow) decodes such a file into garbage of its
    own, or raises; the hardware decoder recovers differently. The GPU path must give the CPU path's
    answer, the same pixels or the same per-request error: the scan check sends what would differ to
    Pillow, and lets through only damage that leaves a well-formed scan."""
    from oracles.jpeg_corpus import damaged, scan_start

    size = 1600 if seed == 3 else 448  # 1600x1200: a scan the check splits among its threads
    base = encode(photo_like(size, size * 3 // 4 if seed == 3 else size, seed=5 + seed), "JPEG",
                  quality=(90, 75, 95, 90)[seed], subsampling=(2, 1, 0, 2)[seed])
    files = damaged(base, seed, 15 if seed == 3 else 45)
    for every in (997, 61):
        blob = bytearray(base)
        for k in range(scan_start(base) + 100, len(blob) - 100, every):
            blob[k] ^= 0x55
        files.append((f"every {every}th byte flipped", bytes(blob)))
    from backends.preprocess import scan_check

    cpu_pre = Preprocessor(MediaConfig())
    gpu_pre = Preprocessor(MediaConfig(), device=DEV, out_dtype=torch.float32)
    gpu_pre.decode_stats.clear()
    walks, _ = scan_check.parallel_counts()
    for label, blob in files:
        cpu, gpu = _answer(cpu_pre, blob), _answer(gpu_pre, blob)
        if isinstance(cpu, str):
            assert gpu == cpu, (label, cpu, gpu)
        else:
            assert isinstance(gpu, torch.Tensor) and torch.equal(gpu, cpu), f"{label}: the GPU path decoded other pixels"
    stats = gpu_pre.decode_stats
    refused = sum(n for (path, why), n in stats.items() if why.startswith("scan_"))
    assert refused > 0 and stats[("gpu", "")] > 0, stats  # both kinds were exercised
    if seed == 3:  # the large photo's checks ran on several threads (the GPU machine has the cores)
        assert scan_check.THREADS > 1 and scan_check.parallel_counts()[0] > walks


def test_a_hardware_decode_never_writes_memory_earlier_work_still_reads():
    """nvJPEG's hardware decoder is not ordered after its stream's earlier work the way a kernel is, so
    decode_planes drains the stream first (docs/jpeg_decoding.md#one-hardware-decode-at-a-time). Each
    trial frees a buffer that a sum queued behind a long GPU sleep still reads, then decodes; the decode
    must get that very block (else the trial proves nothing) and the sum must stay right."""
    from backends.preprocess.nvjpeg import HardwareJpegDecoder

    dec = HardwareJpegDecoder(DEV)
    blob = encode(photo_like(448, 448, seed=0), "JPEG", quality=90)
    info = dec.info(blob)
    stream = torch.cuda.Stream(DEV)
    trials = [_order_trial(dec, blob, info, stream, sleep_cycles=20_000_000) for _ in range(5)]
    assert any(reused for reused, _ in trials), "the decode never got the freed block: the test proves nothing"
    assert all(right for reused, right in trials if reused), trials


def _order_trial(dec, blob: bytes, info, stream, sleep_cycles: int) -> tuple[bool, bool]:
    """(the decode got the freed block, the sum over it came out right). A long GPU sleep, then a sum
    over a buffer of 7s; the buffer goes back to the allocator (reusable on this stream at once) and
    the decode follows. A kernel handed that block would run after the sum; a decode that wrote it
    earlier would spoil the sum."""
    from backends.preprocess.nvjpeg import plane_bytes

    need = plane_bytes(info) + (1 << 16)  # decode_planes' buffer: the planes and its slack
    with torch.cuda.stream(stream):
        filler = torch.full((need,), 7, dtype=torch.uint8, device=stream.device)
        block = filler.data_ptr()
        torch.cuda._sleep(sleep_cycles)
        total = filler.sum(dtype=torch.int64)
        del filler
        planes = dec.decode_planes([blob], [info])
        reused = planes.buffer.data_ptr() == block
    torch.cuda.synchronize()
    return reused, int(total) == 7 * need
