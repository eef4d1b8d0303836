"""How moonvit3d should run a full dynamic batch: the encoder alone, per request, side by side in one run.

Variants, for one request kind (`--images`, as bench/perf.py), through EncoderStep as the server runs it
(bf16, CUDA graphs, the same pixels for every request of the batch):
- `one`: one request, a graph replay (the encoder-alone figure bench/perf.py compares served images/s with);
- `joint`: `--batch` requests in one forward: eager once the batch is over the graphs' patch bound;
- `chunks`: the same batch cut into runs of requests that fit the bound, each replayed from a graph
  (EncoderStep(graph_chunks=True));
- `joint-graphed`: the whole batch as one graph, the bound raised to fit it, with the memory its graph
  pool takes.
The variants alternate round by round, so drift in the machine's clocks falls on all of them alike.
Reports wall time per request (host launches included, the GPU synchronized around each call) and GPU
time per request (CUDA events). Recorded, never asserted.

    python -m bench.encoder_batching --checkpoint /tmp/kimi-random --images 1024,8x448 --out bench/out
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from backends.deploy.repository import Deployment
from backends.encoder.graphs import GraphedEncoder
from backends.preprocess import Preprocessor
from backends.serving.steps import EncoderRequest, EncoderStep
from backends.weights.load import load_model
from bench.gpu_timing import machine_line
from bench.perf import request_images


def _time(fn) -> tuple[float, float]:
    """(wall ms, GPU ms) of one call, the device synchronized before and after."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, start.elapsed_time(end)


def measure(model, cfg, kind: str, batch: int, rounds: int, graphs: int) -> list[str]:
    pixels, grids, _ = Preprocessor(cfg.media, device="cuda", out_dtype=torch.bfloat16)(request_images(kind))
    req = EncoderRequest(pixels, np.asarray(grids))
    reqs = [req] * batch
    patches = int(pixels.shape[0])
    joint = EncoderStep(model, cuda_graphs=graphs)
    chunked = EncoderStep(model, cuda_graphs=graphs, graph_chunks=True)
    bound = chunked._graphed.max_patches
    big = GraphedEncoder(model, max_graphs=1, max_patches=max(bound, patches * batch))
    joint_pixels = torch.cat([pixels] * batch)
    joint_grids = np.concatenate([np.asarray(grids)] * batch)
    variants = {
        "one": (lambda: joint.run_batch([req]), 1),
        "joint": (lambda: joint.run_batch(reqs), batch),
        "chunks": (lambda: chunked.run_batch(reqs), batch),
        "joint-graphed": (lambda: big(joint_pixels, joint_grids), batch),
    }
    reserved_before = 0
    for name, (fn, _) in variants.items():  # seen, captured, replayed once
        if name == "joint-graphed":  # the big graph's memory, after the others (and the eager batch) are warm
            torch.cuda.synchronize()
            reserved_before = torch.cuda.memory_reserved()
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    big_pool_mib = (torch.cuda.memory_reserved() - reserved_before) / 2**20
    # The outputs must agree: chunking never changes a value (attention stays within each image).
    ref = joint.run_batch(reqs)
    for name, out in (("chunks", chunked.run_batch(reqs)), ("joint-graphed", list(torch.split(
            big(joint_pixels, joint_grids), [e.shape[0] for e in ref])))):
        worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref, out))
        if worst != 0.0:
            print(f"note: {name} differs from joint by up to {worst:g} (bf16 kernels may pick other tiles per shape)")
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (fn, n) in variants.items():
            wall, gpu = _time(fn)
            times[name].append((wall / n, gpu / n))
    one_wall = statistics.median(w for w, _ in times["one"])
    chunks = chunked._chunks(reqs)
    lines = [f"### {kind}: {patches} patches per request, batch of {batch} ({patches * batch} patches), "
             f"graph bound {bound} patches",
             "",
             f"`chunks` runs {len(chunks)} forward(s) of {', '.join(str(len(c)) for c in chunks)} request(s); "
             f"`joint-graphed` with its bound raised to {big.max_patches}: {big_pool_mib:.0f} MiB more reserved "
             f"by its warm-up and capture (its graph pool and static buffers), after the other variants ran.",
             "",
             "| variant | wall ms per request | GPU ms per request | wall vs `one` |",
             "|---|---|---|---|"]
    for name, samples in times.items():
        wall = statistics.median(w for w, _ in samples)
        gpu = statistics.median(g for _, g in samples)
        lines.append(f"| {name} | {wall:.2f} | {gpu:.2f} | {wall / one_wall:.3f} |")
    counts = {name: (s._graphed.captures, s._graphed.replays) for name, s in (("joint", joint), ("chunks", chunked))}
    lines += ["", f"graphs captured / replayed: {counts}; {rounds} rounds, variants alternating", ""]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="", help="checkpoint folder (empty: the small demo model)")
    ap.add_argument("--images", default="1024,8x448", help="request kinds, as bench/perf.py's --images")
    ap.add_argument("--batch", type=int, default=Deployment("gpu").max_batch, help="requests in a full batch")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    model, cfg = load_model(args.checkpoint, "cuda", torch.bfloat16)
    graphs = Deployment("gpu").cuda_graphs
    lines = ["# moonvit3d's full batch: one forward, graphed chunks, one big graph", "", machine_line(), "",
             f"$ python -m bench.encoder_batching --checkpoint {args.checkpoint or '(demo)'} --images {args.images} "
             f"--batch {args.batch} --rounds {args.rounds}", ""]
    for kind in args.images.split(","):
        lines += measure(model, cfg, kind, args.batch, args.rounds, graphs)
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "encoder_batching.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
