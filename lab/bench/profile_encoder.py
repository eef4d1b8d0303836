"""Where the encoder's GPU time goes: torch.profiler over one forward per case (real size, random
bf16 weights), top kernels by CUDA time.

    python -m lab.bench.profile_encoder --out lab/out [--backend cudnn_loop] [--section profile]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from backends.config import EncoderConfig
from backends.encoder.moonvit3d import KimiVisionModel
from backends.checkpoint.seeded import init_random_
from lab.bench.encoder_bench import CASES
from lab.bench.gpu_timing import machine_line
from lab.bench.results_page import write_section


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("lab/out"))
    ap.add_argument("--backend", default=None)
    ap.add_argument("--section", default=None, help="also write the tables to this section of the machine's page")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = init_random_(KimiVisionModel(EncoderConfig())).to("cuda", torch.bfloat16).eval()
    text = [f"# Encoder profile (eager, backend {args.backend or 'auto'})\n",
            machine_line()]
    for case, grids in CASES.items():
        n = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(n, 3, 14, 14, device="cuda", dtype=torch.bfloat16)
        grid_np = np.asarray(grids)
        for _ in range(3):
            model(pixels, grid_np, attn_backend=args.backend)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model(pixels, grid_np, attn_backend=args.backend)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
        text += [f"\n## {case}\n", table]
    out = "\n".join(text)
    print(out)
    (args.out / "profile_eager.txt").write_text(out)
    if args.section:  # the profiler's tables are fixed-width text: kept as a code block on the page
        command = f"$ python -m lab.bench.profile_encoder {' '.join(sys.argv[1:] if argv is None else argv)}"
        print(f"written to {write_section('gpu', args.section, command + chr(10) * 2 + '```' + chr(10) + out + chr(10) + '```')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
