"""Exact JPEG decoding on the GPU against Pillow, one run: pixels on the corpus, then speed at 12 MP.

    python -m lab.bench.decode_bench --out lab/out

1. Every file of oracles.jpeg_corpus (all samplings, qualities 30-100, odd sizes, restart markers,
   EXIF/ICC, grayscale; 4:4:0 where OpenCV is installed) decoded by the GPU path and by Pillow's
   `Image.open(f).convert("RGB")`: files and pixels that differ (the target is 0).
2. 4032x3024 (12 MP) photo-like JPEGs, quality 90, at 4:2:0, 4:2:2 and 4:4:4: the GPU path
   (nvJPEG hardware planes + our upsampling/colour kernel, batch of one, synchronized wall time, the
   host calls included) against Pillow on one core (median of wall times). Target: >= 10x at 4:2:0.

Both steps open the files as a request does (decode.open_image: the planes' sizes from the walked header).
"""

from __future__ import annotations

import argparse
import io
import statistics
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from backends.preprocess.decode import open_image
from backends.preprocess.jpeg_gpu import GpuJpegDecoder
from lab.bench.gpu_timing import machine_line, timed, write_report
from clients.samples import encode, photo_like
from oracles.jpeg_corpus import corpus


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("lab/out"))
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    dec = GpuJpegDecoder(torch.device("cuda"))
    lines = ["# Exact JPEG decoding on the GPU vs Pillow\n", f"{machine_line()}; Pillow {Image.__version__}\n"]
    results = {"gpu_decode_on": dec.enabled, "off_reason": dec.off_reason}
    if not dec.enabled:
        lines.append(f"GPU decoding is off: {dec.off_reason}")
        write_report(args.out, "decode_bench", lines, results)
        return 1
    files = corpus()
    images = [open_image(b, k, 1 << 30) for k, (_, b) in enumerate(files)]
    got = dec.decode([b for _, b in files], images)
    bad, pixels = [], 0
    for (label, blob), rgb in zip(files, got):
        ref = np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))
        diff = 0 if rgb is None else int((rgb.cpu().numpy() != ref).any(-1).sum())
        pixels += ref.shape[0] * ref.shape[1]
        if rgb is None or diff:
            bad.append(f"{label}: {'refused' if rgb is None else f'{diff} pixels differ'}")
    results["corpus"] = {"files": len(files), "pixels": pixels, "differing": bad}
    lines += [f"## Corpus: {len(files)} files, {pixels:,} pixels: {len(bad)} files differ from Pillow\n"]
    lines += [f"- {b}" for b in bad]
    lines += ["", "## 4032x3024 (12 MP), quality 90\n", "| chroma | GPU exact decode ms | Pillow 1 core ms | speed-up |",
              "|---|---|---|---|"]
    for sub, name in ((2, "4:2:0"), (1, "4:2:2"), (0, "4:4:4")):
        blob = encode(photo_like(4032, 3024, seed=1), "JPEG", quality=90, subsampling=sub)
        img = open_image(blob, 0, 1 << 30)
        out = dec.decode([blob], [img])[0]
        assert out is not None and np.array_equal(out.cpu().numpy(), np.asarray(Image.open(io.BytesIO(blob)).convert("RGB")))
        gpu = statistics.median(timed(lambda: dec.decode([blob], [img]), args.iters, warmup=3))
        pil = statistics.median(timed(lambda: Image.open(io.BytesIO(blob)).convert("RGB"), 5, warmup=1))
        results[name] = {"gpu_ms": gpu, "pillow_ms": pil, "speedup": pil / gpu, "bytes": len(blob)}
        lines.append(f"| {name} | {gpu:.2f} | {pil:.1f} | {pil / gpu:.1f}x |")
    write_report(args.out, "decode_bench", lines, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
