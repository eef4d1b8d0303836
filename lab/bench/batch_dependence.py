"""Does a media's embedding depend on what it was batched with? Its rows encoded alone against the same
media packed with others in one varlen forward (the encoder's dynamic batches; GEMMs then run over
another number of rows and may pick other kernels or tilings).

    python -m lab.bench.batch_dependence [--device cuda] [--section batch_dependence]

Real-size MoonViT3d with seeded random weights (bf16 on a GPU; fp32 and two layers on CPU), photo-like JPEGs: for each
media of a set (448^2 to 1500^2), its rows alone and packed after the others, eagerly and with no cache.
Prints whether they are bit-equal and the largest absolute and relative difference. The embedding cache
keeps a media's rows as first computed, in whatever batch: a hit is no further from a solo encode than
this (docs/design.md#the-embedding-cache).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from backends.checkpoint.seeded import seeded_model
from backends.config import EncoderConfig, MediaConfig
from backends.preprocess import Preprocessor
from clients.samples import encode, photo_like
from lab.bench.results_page import report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--section", default="")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # Real size on a GPU; two layers of it on CPU, where the full tower takes minutes per forward.
    model = seeded_model(EncoderConfig() if device.type == "cuda" else EncoderConfig(num_layers=2)).to(device, dtype)
    pre = Preprocessor(MediaConfig(), device=device, out_dtype=dtype)
    sides = (448, 640, 1024, 1500)
    media = [pre([encode(photo_like(s, s, seed=s), "JPEG", quality=90)])[:2] for s in sides]
    lines = [f"$ python -m lab.bench.batch_dependence {' '.join(sys.argv[1:] if argv is None else argv)}",
             f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, {dtype}, "
             f"{model.cfg.num_layers} layers of the real size, random weights, "
             f"{time.strftime('%Y-%m-%d %H:%M')}", "",
             "| media | packed after | bit-equal | max abs diff | max abs diff / max abs value |", "|---|---|---|---|---|"]
    worst = 0.0
    with torch.inference_mode():
        for n, (pixels, grid) in enumerate(media):
            solo = model(pixels, grid)
            for k in range(len(media) - 1):
                ids = [j for j in range(len(media)) if j != n][: k + 1]
                others = [media[j] for j in ids]
                packed = model(torch.cat([p for p, _ in others] + [pixels]),
                               np.concatenate([g for _, g in others] + [grid]))[-solo.shape[0]:]
                diff = (packed.float() - solo.float()).abs().max().item()
                rel = diff / solo.float().abs().max().item()
                worst = max(worst, rel)
                lines.append(f"| {sides[n]}^2 | {', '.join(f'{sides[j]}^2' for j in ids)} | "
                             f"{torch.equal(packed, solo)} | {diff:.3g} | {rel:.3g} |")
    lines.append(f"\nlargest relative difference: {worst:.3g}")
    report("\n".join(lines), 'gpu' if device.type == 'cuda' else 'cpu', args.section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
