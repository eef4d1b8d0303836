"""Does preprocessing or the encoder keep device memory across requests, outside tritonserver?

The GPU soak (bench/soak.py) saw torch's allocated memory at idle grow beyond what our bounded caches
hold (bench/results/h200-2026-12-01-fifth.md, call 2). This runs the soak's good requests through the
same steps in one process, no server: PreprocessStep on the GPU, then EncoderStep (the demo model,
CUDA graphs as deployed) on random batches of 1-8 preprocessed requests, as the dynamic batcher
forms them. Every --every requests, with the GPU idle: allocated, what the caches hold, and the rest.
Flat `uncached` here and growing in the server puts the leak in the exchange with tritonserver.

    python -m tools.memory_probe [--requests 3000] [--every 500]
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch

from backends.config import DEMO_CONFIG, Limits
from backends.serving.steps import EncoderRequest, EncoderStep, PreprocessStep
from backends.weights.load import load_model
from bench.soak import request_mix
from contract import GRID_THWS, PIXEL_VALUES


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--cuda-graphs", type=int, default=16)
    ap.add_argument("--device", default="cuda", help="cpu only checks that the loop runs (no memory figures)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    good = [m for m in request_mix() if m[1] and m[3]]  # good requests with images
    weights = [m[-1] for m in good]
    pre = PreprocessStep(DEMO_CONFIG, Limits(), device=args.device, out_dtype=torch.float32)
    model, _ = load_model("", args.device, torch.float32)
    enc = EncoderStep(model, cuda_graphs=args.cuda_graphs)
    rng = random.Random(0)
    lines = [f"$ python -m tools.memory_probe --requests {args.requests} --every {args.every} --cuda-graphs {args.cuda_graphs}"
             + ("" if on_gpu else f" --device {args.device}"),
             f"{torch.cuda.get_device_name() if on_gpu else 'cpu'} | torch {torch.__version__}", "",
             "| requests | allocated MiB | cached MiB | uncached MiB | reserved MiB | graphs | captures |",
             "|---|---|---|---|---|---|---|"]

    def sample(n: int) -> None:
        if on_gpu:
            torch.cuda.synchronize()
        alloc = torch.cuda.memory_allocated(device) if on_gpu else 0
        cached = enc.cached_bytes()
        graphs = getattr(enc.forward, "graphs", {})
        lines.append(f"| {n} | {_mib(alloc)} | {_mib(cached)} | {_mib(alloc - cached)} | "
                     f"{_mib(torch.cuda.memory_reserved(device) if on_gpu else 0)} | {len(graphs)} | {getattr(enc.forward, 'captures', 0)} |")

    done, next_sample = 0, args.every
    sample(0)
    while done < args.requests:
        batch = []
        for _ in range(rng.randint(1, 8)):
            _, _, ids, blobs, frames, _ = rng.choices(good, weights=weights)[0]
            out = pre(blobs, media_frames=frames, input_ids=ids)
            batch.append(EncoderRequest(out[PIXEL_VALUES], np.asarray(out[GRID_THWS])))
        results = enc.run_batch(batch)
        bad = [r for r in results if isinstance(r, Exception)]
        if bad:
            raise bad[0]
        done += len(batch)
        del batch, out, results
        if done >= next_sample:
            sample(done)
            next_sample += args.every
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
