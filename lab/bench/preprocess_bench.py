"""Preprocessing benchmark: a 4032x3024 JPEG through decode + navit resize + normalize/patchify.

Side by side in one run: the checkpoint processor's path on the CPU (Pillow decode, convert("RGB"),
Pillow BICUBIC, numpy pad/normalize/patchify) against ours with Pillow decoding
(decode on the host, upload, exact bicubic + fused normalize/patchify on the GPU, BF16 out; the exact
GPU JPEG decode, on by default in a GPU deployment, is measured by lab/bench/decode_bench.py). The GPU part (resize + normalize/patchify)
is compared with its HBM floor: the decoded image read once plus the patches written once, over the
device copy bandwidth measured in the same run. Outputs are checked equal before timing.

    python -m lab.bench.preprocess_bench --out lab/out
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from backends.config import MediaConfig
from backends.kernels.patchify import normalize_patchify
from backends.preprocess import Preprocessor
from backends.preprocess.bicubic import resize_bicubic
from backends.preprocess.resize_rule import navit_resize
from lab.bench.gpu_timing import copy_bandwidth_gbs, cuda_time_ms, machine_line, wall_time_ms, write_report
from clients.samples import encode, photo_like
from oracles.checkpoint_processor import reference_pixels


def _encode_opencv(rgb: np.ndarray, sampling: str) -> bytes:
    import cv2

    factors = {"4:4:4": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444, "4:2:2": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_422,
               "4:2:0": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420}
    ok, buf = cv2.imencode(".jpg", rgb[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90,
                                                   cv2.IMWRITE_JPEG_SAMPLING_FACTOR, factors[sampling]])
    assert ok
    return buf.tobytes()


def nvjpeg_vs_pillow(width: int = 1023, height: int = 767) -> list[str]:
    """Does nvJPEG (torchvision.io.decode_jpeg on the GPU) give Pillow's pixels? Per encoder and chroma
    subsampling: share of differing values and the largest difference."""
    from torchvision.io import decode_jpeg

    rgb = photo_like(width, height, seed=11)
    pillow_sub = {"4:4:4": 0, "4:2:2": 1, "4:2:0": 2}
    lines = ["| encoder | chroma | differing values | max diff | nvJPEG ms | Pillow ms |", "|---|---|---|---|---|---|"]
    for encoder in ("Pillow", "OpenCV"):
        for sampling in ("4:4:4", "4:2:2", "4:2:0"):
            try:
                blob = (encode(rgb, "JPEG", quality=90, subsampling=pillow_sub[sampling]) if encoder == "Pillow"
                        else _encode_opencv(rgb, sampling))
            except Exception as exc:  # noqa: BLE001 - OpenCV may be missing
                lines.append(f"| {encoder} | {sampling} | not run ({type(exc).__name__}) | | | |")
                continue
            ref = np.array(Image.open(io.BytesIO(blob)).convert("RGB"))
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            got = decode_jpeg(data, device="cuda").permute(1, 2, 0).cpu().numpy()
            diff = np.abs(got.astype(int) - ref.astype(int))
            nv_ms = wall_time_ms(lambda: decode_jpeg(data, device="cuda"), iters=10)
            pil_ms = wall_time_ms(lambda: np.array(Image.open(io.BytesIO(blob)).convert("RGB")), iters=5)
            lines.append(f"| {encoder} | {sampling} | {np.mean(diff > 0):.1%} | {diff.max()} | {nv_ms:.2f} | {pil_ms:.2f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("lab/out"))
    args = ap.parse_args(argv)
    media = MediaConfig()
    results, lines = {}, [f"# Preprocessing benchmark\n\n{machine_line()}\n"]
    for label, subsampling in (("4:2:0", 2), ("4:4:4", 0)):
        blob = encode(photo_like(4032, 3024, seed=7), "JPEG", quality=90, subsampling=subsampling)
        plan = navit_resize(4032, 3024, media)
        gpu = Preprocessor(media, device="cuda", out_dtype=torch.bfloat16, gpu_jpeg=False)
        ref, _ = reference_pixels(blob, media)
        got, _, _ = gpu([blob])
        assert torch.equal(got.cpu(), torch.from_numpy(ref).to(torch.bfloat16)), "GPU path differs from the reference"

        cpu_ms = wall_time_ms(lambda: reference_pixels(blob, media), iters=5)
        ours_ms = wall_time_ms(lambda: gpu([blob]), iters=10)
        decode_ms = wall_time_ms(lambda: np.array(Image.open(io.BytesIO(blob)).convert("RGB")), iters=5)
        decoded = torch.from_numpy(np.array(Image.open(io.BytesIO(blob)).convert("RGB"))).cuda()
        table = gpu.table
        resize_ms = cuda_time_ms(lambda: resize_bicubic(decoded, plan.width, plan.height))
        resized = resize_bicubic(decoded, plan.width, plan.height)
        patchify_ms = cuda_time_ms(lambda: normalize_patchify(resized, table, plan.patch_size, plan.padded_height, plan.padded_width, torch.bfloat16))
        gpu_ms = cuda_time_ms(lambda: normalize_patchify(resize_bicubic(decoded, plan.width, plan.height), table,
                                                         plan.patch_size, plan.padded_height, plan.padded_width,
                                                         torch.bfloat16))
        results[label] = dict(cpu_reference_ms=cpu_ms, ours_end_to_end_ms=ours_ms, pillow_decode_ms=decode_ms,
                              gpu_resize_ms=resize_ms, gpu_patchify_ms=patchify_ms, gpu_resize_patchify_ms=gpu_ms)
        lines.append(f"## 4032x3024 JPEG, quality 90, chroma {label} -> {plan.width}x{plan.height}, grid "
                     f"{plan.grid_thw}\n")
        lines.append("| path | ms |\n|---|---|")
        lines.append(f"| checkpoint processor on CPU (Pillow decode + resize, numpy normalize/patchify) | {cpu_ms:.1f} |")
        lines.append(f"| ours: Pillow decode + upload + GPU resize + fused patchify (BF16), end to end | {ours_ms:.1f} |")
        lines.append(f"| of which Pillow decode + convert | {decode_ms:.1f} |")
        lines.append(f"| GPU exact bicubic resize | {resize_ms:.3f} |")
        lines.append(f"| GPU fused normalize + patchify | {patchify_ms:.3f} |")
        lines.append(f"| GPU resize + normalize/patchify | {gpu_ms:.3f} |")
        lines.append(f"\nspeed-up end to end: {cpu_ms / ours_ms:.1f}x\n")
    bw = copy_bandwidth_gbs()
    plan = navit_resize(4032, 3024, media)
    nbytes = 4032 * 3024 * 3 + plan.padded_width * plan.padded_height * 3 * 2
    floor = nbytes / (bw * 1e9) * 1e3
    results["hbm_floor_ms"] = floor
    results["copy_gbs"] = bw
    lines.append(f"HBM floor for resize + normalize/patchify (read {4032 * 3024 * 3 / 1e6:.1f} MB uint8 once, write "
                 f"{plan.padded_width * plan.padded_height * 6 / 1e6:.1f} MB BF16 once at {bw:.0f} GB/s): {floor:.3f} ms; "
                 f"ours {results['4:2:0']['gpu_resize_patchify_ms'] / floor:.1f}x the floor")
    try:
        lines += [f"\n## nvJPEG vs Pillow decode ({1023}x{767} photo-like, quality 90)\n"] + nvjpeg_vs_pillow()
    except Exception as exc:  # noqa: BLE001 - torchvision missing or no nvJPEG
        lines.append(f"\nnvJPEG comparison not run: {type(exc).__name__}: {exc}")
    write_report(args.out, "preprocess_bench", lines, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
