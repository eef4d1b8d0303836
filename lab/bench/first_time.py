"""Where a size's first time goes, in one process without tritonserver: preprocessing and the encoder as
the served models set them up (warm-ups, bucketed CUDA graphs), then images of sizes never seen, each
timed the first time and again (another image of the same size), synchronized. The slowest first
times are profiled (torch profiler: host calls and kernels) so the cost can be named.

    python -m lab.bench.first_time --checkpoint /tmp/kimi-random
    CUDA_MODULE_LOADING=EAGER python -m lab.bench.first_time --checkpoint /tmp/kimi-random
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from backends.checkpoint import load_model
from backends.config import Limits
from backends.preprocess.media import largest_media_patches
from backends.serving.steps import EncoderRequest, EncoderStep, PreprocessStep
from lab.bench.cases import jpeg, random_sizes


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> tuple[float, object]:
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return (time.perf_counter() - t) * 1000, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="/tmp/kimi-random")
    ap.add_argument("--images", type=int, default=12)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    print("CUDA_MODULE_LOADING =", os.environ.get("CUDA_MODULE_LOADING", "(unset: lazy)"), flush=True)
    t0 = time.perf_counter()
    model, cfg = load_model(args.checkpoint, args.device, dtype=torch.bfloat16)
    print(f"model loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    pre = PreprocessStep(cfg, Limits(), device=args.device, out_dtype=torch.bfloat16)
    print("preprocess:", pre.prepare(), flush=True)
    enc = EncoderStep(model, cuda_graphs=16, max_patches=largest_media_patches(cfg.media))
    for line in enc.prepare():
        print("encoder:", line, flush=True)
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        print(f"GPU memory in use after start-up: {(total - free) / 2**30:.2f} GiB (torch reserved "
              f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB)", flush=True)

    def steps(blob: bytes):
        pre_ms, out = timed(lambda: pre([blob]))
        req = EncoderRequest(out["PIXEL_VALUES"], out["GRID_THWS"])
        enc_ms, _ = timed(lambda: enc.run_batch([req]))
        return pre_ms, enc_ms, req

    sizes = [(1024, 1024)] + random_sizes(args.images)
    rows, worst = [], None
    for i, (w, h) in enumerate(sizes):
        a, b = jpeg(w, h, seed=100 + i), jpeg(w, h, seed=900 + i)
        p1, e1, req = steps(a)
        p2, e2, _ = steps(b)
        rows.append((w, h, p1, p2, e1, e2))
        print(f"{w}x{h}: preprocess first {p1:7.2f} ms again {p2:6.2f} | encoder first {e1:7.2f} ms again {e2:6.2f}",
              flush=True)
        if worst is None or p1 + e1 - p2 - e2 > worst[0]:
            worst = (p1 + e1 - p2 - e2, i)
    p = np.array(rows, dtype=float)
    print(f"median first/again: preprocess {np.median(p[:, 2]):.2f}/{np.median(p[:, 3]):.2f} ms, "
          f"encoder {np.median(p[:, 4]):.2f}/{np.median(p[:, 5]):.2f} ms")
    # Profile new sizes' first times: host functions by own time, and the CUDA runtime calls.
    for j, (w, h) in enumerate([(1013, 777), (641, 1399)]):
        blob = jpeg(w, h, seed=5000 + j)
        out = pre([blob])
        req = EncoderRequest(out["PIXEL_VALUES"], out["GRID_THWS"])
        print(f"\n--- torch.profiler, encoder first {w}x{h}")
        print(torch_profiled(lambda: enc.run_batch([req])))
    return 0


def torch_profiled(fn, top: int = 18) -> str:
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)


if __name__ == "__main__":
    raise SystemExit(main())
