"""Where preprocessing's time goes on the GPU, call by call, and what idle gaps between requests cost.

In the server `kimi_preprocess` holds an 8x448^2 request about 1.5 ms longer than the same Preprocessor
takes in a hot loop in one process (bench/results/h200-2026-12-01-fifth.md). This probe separates the
candidates, in one process, medians of --iters runs each (host wall time, the GPU synchronized at the end):
- the calls of one GPU decode: Pillow's header parse (and jpeg_header's, which replaced it), nvJPEG's image info, its stream parse and
  "batched supported" check, the batched decoder's initialization, the decode (also the host time until
  it returns), the colour kernel;
- the whole Preprocessor call back to back, after an idle gap (what the server's preprocessing sees
  while the encoder runs in another process), and after a busy GPU kernel in this process;
- the idle gap's cost taken apart: this thread spinning through the gap, and the scan checks left out
  (in this probe only).

    python -m tools.preprocess_probe [--iters 30] [--gap-ms 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from backends.config import DEMO_CONFIG, Limits
from backends.preprocess import jpeg_gpu
from backends.preprocess.jpeg_gpu import GpuJpegDecoder
from backends.preprocess.nvjpeg import NVJPEG_OUTPUT_YUV
from backends.preprocess.decode import open_image
from backends.preprocess.preprocessor import Preprocessor, open_images
from bench.cases import case_jpegs
from bench.gpu_timing import spin, timed


def _ms(fn, iters: int, before=None) -> float:
    return statistics.median(timed(fn, iters, warmup=0, before=before))


def _host_ms(fn, iters: int) -> float:
    """Median host time until fn returns, the GPU idle before each call (what a call holds the host)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def probe(name: str, blobs: list[bytes], iters: int, gap_ms: float) -> list[str]:
    pre = Preprocessor(DEMO_CONFIG.media, Limits(), device="cuda", out_dtype=torch.bfloat16)
    jpeg: GpuJpegDecoder = pre.jpeg
    if jpeg is None or not jpeg.enabled:
        return [f"{name}: GPU decoding is off ({getattr(jpeg, 'off_reason', 'no GPU')})"]
    dec = jpeg.decoder
    images = open_images(blobs, Limits())
    lim = Limits().max_image_pixels
    infos = [dec.info(b) for b in blobs]
    for _ in range(5):
        pre(blobs)
    rows = {
        "Pillow header parse (all images)": lambda: [open_image(b, i, lim, fast=False) for i, b in enumerate(blobs)],
        "jpeg_header parse (all images)": lambda: [open_image(b, i, lim, fast=True) for i, b in enumerate(blobs)],
        "nvjpegGetImageInfo (all)": lambda: [dec.info(b) for b in blobs],
        "ParseHeader + BatchedSupported (all)": lambda: [dec.unsupported(b, i) for b, i in zip(blobs, infos)],
        "DecodeBatchedInitialize": lambda: dec.lib.nvjpegDecodeBatchedInitialize(dec.handle, dec.state, len(blobs), 1,
                                                                                 NVJPEG_OUTPUT_YUV),
        "decode_planes (init + decode + sync)": lambda: dec.decode_planes(blobs, infos),
        "GpuJpegDecoder.decode (headers, planes, colour)": lambda: jpeg.decode(blobs, images),
        "Preprocessor, back to back": lambda: pre(blobs),
    }
    out = [f"### {name}: {len(blobs)} JPEG(s), {sum(map(len, blobs)) // 1024} KiB", "",
           "| what | ms (median) |", "|---|---|"]
    for what, fn in rows.items():
        out.append(f"| {what} | {_ms(fn, iters):.3f} |")
    host = _host_ms(lambda: dec.decode_planes(blobs, infos), iters)
    out.append(f"| decode_planes, host time until it returns | {host:.3f} |")
    out.append(f"| Preprocessor, after {gap_ms:.0f} ms idle | {_ms(lambda: pre(blobs), iters, lambda: time.sleep(gap_ms / 1e3)):.3f} |")
    cycles = int(gap_ms * 1.5e6)  # a spin of gap_ms at 1.5 GHz: shorter at the H200's ~2 GHz boost
    busy = lambda: (torch.cuda._sleep(cycles), torch.cuda.synchronize())  # noqa: E731
    out.append(f"| Preprocessor, after a ~{gap_ms:.0f} ms kernel in this process ({cycles:.1e} cycles) | "
               f"{_ms(lambda: pre(blobs), iters, busy):.3f} |")
    # What the idle gap costs, taken apart: this thread kept busy through the gap (its core never idles,
    # the scan check's threads still sleep); the scan checks not run at all (here only: the GPU's answer
    # taken unchecked, which serving never does).
    out.append(f"| Preprocessor, after {gap_ms:.0f} ms of this thread spinning | "
               f"{_ms(lambda: pre(blobs), iters, lambda: spin(gap_ms / 1e3)):.3f} |")
    with mock.patch.object(jpeg_gpu, "_start", _unchecked):
        out.append(f"| Preprocessor without scan checks (probe only), back to back | {_ms(lambda: pre(blobs), iters):.3f} |")
        out.append(f"| Preprocessor without scan checks (probe only), after {gap_ms:.0f} ms idle | "
                   f"{_ms(lambda: pre(blobs), iters, lambda: time.sleep(gap_ms / 1e3)):.3f} |")
    return out + [""]


class _Unchecked:
    """A scan check's verdict that says "fine" without checking (the probe's no-check rows only)."""

    def result(self):
        return None

    def cancel(self):
        return None


def _unchecked(indices, blobs, max_pixels):
    return {i: _Unchecked() for i in indices}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    args = ap.parse_args(argv)
    cases = {case: case_jpegs(case) for case in ("8x448^2", "1x1024^2")}  # the stage table's JPEGs
    lines = [f"$ python -m tools.preprocess_probe --iters {args.iters} --gap-ms {args.gap_ms:g}",
             f"{torch.cuda.get_device_name()} | torch {torch.__version__}", ""]
    for name, blobs in cases.items():
        lines += probe(name, blobs, args.iters, args.gap_ms)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
