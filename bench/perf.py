"""`make perf`: the real perf_analyzer over gRPC against the ensemble, fixed inputs, several concurrencies.

Inputs (`--images`): `sample` = the `make run` request (a 640x480 JPEG and a 300x200 PNG), or `1024` =
one 1024x1024 JPEG. Prints throughput (requests/s and images/s) and p50/p99 latency per concurrency
and writes perf_analyzer's CSVs under --out. Recorded, never asserted: absolute numbers mean something
only on the machine that produced them.
"""

from __future__ import annotations

import argparse
import base64
import csv
import json
import os
import platform
import subprocess
import time
from pathlib import Path

from backends.deploy.repository import Deployment
from backends.deploy.server import BUILD, deployment_server, resolve_device
from clients.kimi_client import chat_prompt_ids
from clients.samples import encode, photo_like, sample_images


def request_images(kind: str) -> list[bytes]:
    if kind == "sample":
        return sample_images()
    if kind == "1024":
        return [encode(photo_like(1024, 1024, seed=3), "JPEG", quality=90)]
    raise SystemExit(f"--images must be 'sample' or '1024', got {kind!r}")


def write_input_data(path: Path, images: list[bytes]) -> Path:
    """perf_analyzer JSON: INT64 ids as content; the BYTES tensor as base64 of its serialized form
    (each element a 4-byte little-endian length followed by its bytes)."""
    serialized = b"".join(len(b).to_bytes(4, "little") + b for b in images)
    ids = chat_prompt_ids(len(images))
    data = {"data": [{
        "INPUT_IDS": {"content": ids.tolist(), "shape": [len(ids)]},
        "IMAGES": {"b64": base64.b64encode(serialized).decode(), "shape": [len(images)]},
    }]}
    path.write_text(json.dumps(data))
    return path


def perf_analyzer_env(perf_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    libs = [str(perf_dir / "nvidia" / "cuda_runtime" / "lib")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    ap.add_argument("--checkpoint", default=os.environ.get("KIMI_VISION_CHECKPOINT", ""))
    ap.add_argument("--perf-dir", type=Path, default=Path(".venv/perf_analyzer"))
    ap.add_argument("--concurrency", default="1,2,4", help="comma-separated concurrency levels")
    ap.add_argument("--images", default="sample", help="'sample' (2 images per request) or '1024' (one 1024^2 JPEG)")
    ap.add_argument("--measurement-ms", type=int, default=4000)
    ap.add_argument("--stability", type=int, default=25, help="perf_analyzer --stability-percentage")
    ap.add_argument("--ensembles", default="plain",
                    help="comma-separated: plain (kimi_k25_vision) and/or batched (kimi_k25_vision_batched, "
                         "requests of batch 1 that the server batches across clients); one server, one run")
    ap.add_argument("--out", type=Path, default=BUILD / "perf")
    args = ap.parse_args(argv)

    device = resolve_device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    images = request_images(args.images)
    data = write_input_data(args.out / "input_data.json", images)
    binary = args.perf_dir / "bin" / "perf_analyzer"
    if not binary.exists():
        raise SystemExit(f"{binary} not found: run `make perf` (it installs perf_analyzer) or pass --perf-dir")
    server = deployment_server(Deployment(device=device, checkpoint=args.checkpoint), f"perf-{device}")
    names = {"plain": "kimi_k25_vision", "batched": "kimi_k25_vision_batched"}
    runs = [(names[e], int(c)) for e in args.ensembles.split(",") for c in args.concurrency.split(",")]
    rows = []
    t0 = time.monotonic()
    with server:
        for model, level in runs:
            csv_path = args.out / f"perf_{device}_{model}_{args.images}_c{level}.csv"
            cmd = [str(binary), "-m", model, "-b", "1", "-i", "grpc", "-u", server.grpc_url,
                   "--input-data", str(data), "--concurrency-range", f"{level}:{level}",
                   "--measurement-interval", str(args.measurement_ms), "--percentile", "99",
                   "-f", str(csv_path), "--verbose-csv"]
            cmd += ["--stability-percentage", str(args.stability), "--max-trials", "10"]
            print("$", " ".join(cmd), flush=True)
            proc = subprocess.run(cmd, env=perf_analyzer_env(args.perf_dir), capture_output=True, text=True)
            if proc.returncode != 0:
                # e.g. exit 2: no stable window within --max-trials (a busy 2-core machine)
                print(f"perf_analyzer exited {proc.returncode} at concurrency {level}:\n{proc.stdout[-1500:]}{proc.stderr[-800:]}")
                continue
            with open(csv_path) as f:
                rows += [{**row, "model": model} for row in csv.DictReader(f)]
    wall = time.monotonic() - t0
    print(f"\n{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, device={device}, images={args.images} "
          f"({len(images)} per request), {time.strftime('%Y-%m-%d %H:%M')}, wall {wall:.0f}s")
    print(f"{'ensemble':>24} {'concurrency':>11} {'infer/s':>9} {'images/s':>9} {'p50 ms':>9} {'p99 ms':>9}")
    for row in rows:
        rps = float(row["Inferences/Second"])
        print(f"{row['model']:>24} {row['Concurrency']:>11} {rps:9.2f} {len(images) * rps:9.2f} "
              f"{float(row['p50 latency']) / 1000:9.1f} {float(row['p99 latency']) / 1000:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
