"""The encoder with flash-attn-4 fed heads padded to 80 by the fused RoPE (what the tree runs) against the
same encoder with flash-attn-4 given head dim 72 (it pads inside with bounds-checked loads), same run:
the whole real-size forward (27 x 1152, 16 heads x 72, seeded random bf16 weights), eager, per case,
and whether the two give the same bits.

    python -m lab.bench.fa4_padding --section fa4_padding
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import numpy as np
import torch

from backends.checkpoint.seeded import seeded_model
from backends.config import EncoderConfig
from backends.encoder import attention as attention_mod
from backends.encoder.moonvit3d import Kernels
from lab.bench.gpu_timing import cuda_time_ms, machine_line
from lab.bench.results_page import report

CASES = {"1x1024^2": [(1, 74, 74)], "1x3000^2": [(1, 130, 130)], "8x448^2": [(1, 32, 32)] * 8}


@contextlib.contextmanager
def fa4_at_72():
    """The encoder as it ran before it padded heads for flash-attn-4: RoPE in place, the kernel given 72."""
    with mock.patch.object(Kernels, "rope_padded", lambda self, q, k, v: (*self.rope(q, k), v)), \
            mock.patch.object(attention_mod, "padded_head_dim", lambda d: d):
        yield


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--section", default=None)
    args = ap.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    model = seeded_model(EncoderConfig()).to(dev, dt)
    lines = [machine_line(), "",
             "| case | fa4 fed 80 (padded by the RoPE) ms | fa4 given 72 ms | speed-up | bit-equal |",
             "|---|---|---|---|---|"]
    with torch.inference_mode():
        for case, grids in CASES.items():
            n = sum(t * h * w for t, h, w in grids)
            gen = torch.Generator(device=dev).manual_seed(0)
            pixels = (torch.rand(n, 3, 14, 14, generator=gen, device=dev) * 2 - 1).to(dt)
            grid_np = np.asarray(grids)
            run = lambda: model(pixels, grid_np, attn_backend="fa4", fused=True)  # noqa: E731
            out = run()
            ms = cuda_time_ms(run, iters=args.iters)
            with fa4_at_72():
                out72 = run()
                ms72 = cuda_time_ms(run, iters=args.iters)
            lines.append(f"| {case} | {ms:.2f} | {ms72:.2f} | {ms72 / ms:.3f}x | {'yes' if torch.equal(out, out72) else 'NO'} |")
            print(lines[-1], flush=True)
    report("\n".join(lines), "gpu", args.section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
