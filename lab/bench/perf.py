"""`make perf`: the real perf_analyzer over gRPC against the ensembles, fixed inputs, several
concurrencies and shared-memory modes, one server, one run.

Inputs (`--images`): `sample` = the `make run` request (a 640x480 JPEG and a 300x200 PNG), `1024` =
one 1024x1024 JPEG, `8x448` = eight 448x448 JPEGs (any SIDE or N x SIDE likewise).
`--shared-memory none,cuda` measures each mode side by side: `none` sends the inputs and returns every
output over gRPC; `system` / `cuda` make perf_analyzer place the inputs and every output in POSIX /
CUDA shared memory (perf_analyzer cannot keep the inputs on gRPC while the outputs go to shared memory;
the inputs are a few hundred kB, the embeddings tens of MB). Each output region is sized from the
request (`output_byte_sizes`).

Prints, per (ensemble, shared-memory mode, concurrency): throughput (requests/s and images/s), p50/p99
latency and two of perf_analyzer's averages, the server's "compute output" and the client's
"network + server send/recv", where the embeddings' trip back shows. Writes perf_analyzer's CSVs and
the table (perf_summary.md) under --out. Recorded, never asserted: absolute numbers mean something
only on the machine that produced them.
"""

from __future__ import annotations

import argparse
import base64
import csv
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import serialize_byte_tensor

from backends.config import env_int
from backends.deploy import mps
from backends.deploy.launcher import BUILD, deployment_server, gpu_count, resolve_device
from backends.deploy.repository import Deployment, model_configs
from backends.placeholder.expand import expand_placeholders
from backends.preprocess.decode import open_image
from backends.preprocess.media import plan_media
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like, sample_images
from contract import BATCHED_ENSEMBLE, DTYPE_BYTES, ENCODER, ENSEMBLE, IMAGE_EMBEDS_NIXL, PLACEHOLDER
from lab.bench.gpu_clocks import ClockSampler
from lab.bench.results_page import write_section

# What --ensembles names.
ENSEMBLES = {"plain": ENSEMBLE, "batched": BATCHED_ENSEMBLE}
SHM_MODES = ("none", "system", "cuda")


def request_images(kind: str) -> list[bytes]:
    """'sample'; or N x SIDE photo-like JPEGs (quality 90), e.g. '8x448', or SIDE for one, e.g. '1024'.
    The seeds keep the images of the committed runs: one image seed 3, several seeds 0..N-1."""
    if kind == "sample":
        return sample_images()
    m = re.fullmatch(r"(?:(\d+)x)?(\d+)", kind)
    if not m or int(m[1] or 1) < 1 or int(m[2]) < 16:
        raise SystemExit(f"--images must be 'sample', SIDE (e.g. 1024) or N x SIDE (e.g. 8x448) with SIDE >= 16, "
                         f"got {kind!r}")
    count, side = int(m[1] or 1), int(m[2])
    seeds = [3] if count == 1 else range(count)
    return [encode(photo_like(side, side, seed=s), "JPEG", quality=90) for s in seeds]


class RunningServer:
    """A server someone else started (--url): read what it serves from its own model configs."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        from backends.config import VisionConfig

        self.grpc_url = url
        c = grpcclient.InferenceServerClient(url)
        try:
            placeholder = c.get_model_config(PLACEHOLDER).config
            self.ensemble_config = c.get_model_config(ENSEMBLE).config
        finally:
            c.close()
        self.vision = VisionConfig.from_json(placeholder.parameters["vision_config"].string_value)
        embeds = next(o for o in self.ensemble_config.output if o.name == "IMAGE_EMBEDS")
        self.device = "gpu" if embeds.data_type == mc.TYPE_BF16 else "cpu"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def output_byte_sizes(dep: Deployment, input_ids, images: list[bytes], served: RunningServer | None = None) -> dict[str, int]:
    """Bytes of each ensemble output for one request (without a batch dimension), as `dep` serves it.

    Rows come from the planning the placeholder step runs (the checkpoint's resize rule and 2x2 merge:
    IMAGE_EMBEDS has one row per image token, EXPANDED_IDS the prompt with each placeholder repeated
    once per token); widths and dtypes from the rendered ensemble config (text hidden size from the
    deployment's checkpoint config; BF16 on GPU, FP32 on CPU). An output this function has no row
    count for raises, so a new output cannot silently get a too-small shared-memory region.
    """
    vision = served.vision if served else dep.vision
    sizes = [open_image(b, i, dep.limits.max_image_pixels).size for i, b in enumerate(images)]
    counts = [m.plan.num_tokens for m in plan_media(sizes, vision.media, dep.limits)]
    expanded = expand_placeholders(input_ids, vision.tokens.media_pad, counts)
    rows = {"EXPANDED_IDS": len(expanded), "IMAGE_EMBEDS": sum(counts),
            "GRID_THWS": len(counts), "IMAGE_TOKEN_COUNTS": len(counts),
            # Only for a request with the kimi_embeds_nixl parameter, which perf_analyzer never sends.
            IMAGE_EMBEDS_NIXL: 0}
    sizes = {}
    for out in (served.ensemble_config if served else model_configs(dep)[ENSEMBLE]).output:
        if out.name not in rows:
            raise ValueError(f"output {out.name} of {ENSEMBLE} has no size rule in output_byte_sizes")
        dtype = mc.DataType.Name(out.data_type)
        sizes[out.name] = rows[out.name] * math.prod(out.dims[1:]) * DTYPE_BYTES[dtype]
    return sizes


def write_input_data(path: Path, images: list[bytes], *, media_frames: bool = False) -> Path:
    """perf_analyzer JSON: INT64 ids as content; the BYTES tensor as base64 of its serialized form
    (each element a 4-byte little-endian length followed by its bytes). media_frames=True also sends
    the optional MEDIA_FRAMES as zeros (every entry a still image: the same request as without it),
    because perf_analyzer's shared-memory mode refuses a model input that has no data."""
    serialized = serialize_byte_tensor(np.array(list(images), dtype=np.object_)).item()  # tritonclient's layout
    ids = chat_prompt_ids(len(images))
    request = {
        "INPUT_IDS": {"content": ids.tolist(), "shape": [len(ids)]},
        "IMAGES": {"b64": base64.b64encode(serialized).decode(), "shape": [len(images)]},
    }
    if media_frames:
        request["MEDIA_FRAMES"] = {"content": [0] * len(images), "shape": [len(images)]}
    path.write_text(json.dumps({"data": [request]}))
    return path


def perf_analyzer_env(perf_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    # libcudart.so.12 (CUDA shared memory), and libb64 where make perf had to fetch it
    libs = [str(perf_dir / "nvidia" / "cuda_runtime" / "lib"), str(perf_dir / "lib")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
    return env


def parse_list(value: str, allowed, flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"{flag} takes a comma-separated list of {', '.join(allowed)}; got {value!r}")
    return items


def _ms(row: dict, column: str) -> float:
    """perf_analyzer's CSV gives microseconds; a column it did not write reads as NaN."""
    try:
        return float(row[column]) / 1000
    except (KeyError, TypeError, ValueError):
        return float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    ap.add_argument("--checkpoint", default=os.environ.get("KIMI_VISION_CHECKPOINT", ""))
    ap.add_argument("--alone-seconds", type=float, default=5.0,
                    help="with --encoder-alone: also time it back to back for this long (0: the burst only)")
    ap.add_argument("--perf-dir", type=Path, default=Path(".venv/perf_analyzer"))
    ap.add_argument("--concurrency", default="1,2,4", help="comma-separated concurrency levels")
    ap.add_argument("--images", default="sample",
                    help="'sample' (2 images per request), '1024' (one 1024^2 JPEG), '8x448' (eight 448^2 JPEGs): "
                         "any SIDE or N x SIDE")
    ap.add_argument("--url", help="measure a running server at host:port (gRPC) instead of starting one")
    ap.add_argument("--encoder-alone", action="store_true",
                    help="GPU, own server: also time the encoder alone in this process on the same weights and "
                         "pixels, and print the images/s it allows next to the served ones")
    ap.add_argument("--measurement-ms", type=int, default=4000)
    ap.add_argument("--stability", type=int, default=25, help="perf_analyzer --stability-percentage")
    ap.add_argument("--ensembles", default="plain",
                    help="comma-separated: plain (kimi_k25_vision) and/or batched (kimi_k25_vision_batched, "
                         "requests of batch 1 that the server batches across clients); one server, one run")
    ap.add_argument("--shared-memory", default="none",
                    help="comma-separated perf_analyzer --shared-memory modes to measure side by side: none "
                         "(gRPC), system (POSIX shm, same host) and/or cuda (CUDA shm, needs a GPU here); "
                         "inputs and outputs both go through it, each output region sized from the request")
    ap.add_argument("--encoder-instances", type=int, default=1,
                    help="own server: moonvit3d instances per GPU (2 lets one's host work overlap the other's kernels)")
    ap.add_argument("--preprocess-instances", type=int, default=env_int("KIMI_PREPROCESS_INSTANCES", 0),
                    help="own server: per GPU; 0 = the default (KIMI_PREPROCESS_INSTANCES, as the launcher reads it)")
    ap.add_argument("--mps", action="store_true",
                    help="GPU, own server: run the server and perf_analyzer under a CUDA MPS daemon of their own "
                         "(backends/deploy/mps.py, as the launcher's --mps), stopped with the server; the encoder "
                         "alone is then timed without MPS")
    ap.add_argument("--run-timeout", type=float, default=0.0,
                    help="seconds one perf_analyzer run may take before it counts as hung (default: 12 measurement "
                         "windows + 120 s)")
    ap.add_argument("--cache-bytes", type=int, default=0,
                    help="own server: the embedding cache's budget per encoder instance (default 0, off: "
                         "perf_analyzer resends one request, which the cache would answer without the encoder)")
    ap.add_argument("--out", type=Path, default=BUILD / "perf")
    ap.add_argument("--section", default="",
                    help="also write the table into this section of lab/results/<machine>.md (lab/RESULTS.md "
                         "lists the sections the docs quote)")
    args = ap.parse_args(argv)
    plan = preflight(args)  # before any daemon starts: a run refused on its arguments leaves nothing behind
    daemon = None
    if args.mps:
        if args.url:
            raise SystemExit("--mps starts a daemon for our own server; a running server (--url) has its own setup")
        if resolve_device(args.device) != "gpu":
            raise SystemExit("--mps needs a GPU deployment")
        try:  # a measurement that asks for MPS must not quietly run without it
            daemon = mps.start(mps.folder_for("perf"))
        except mps.MpsUnavailable as exc:
            raise SystemExit(f"--mps: {exc}") from None
    try:
        return measure(args, argv, plan, daemon)  # stops the daemon itself once the server is gone
    finally:
        if daemon is not None:
            daemon.stop()  # a no-op after measure's own stop; the stop on an error


def preflight(args) -> argparse.Namespace:
    """The run's settings, read and checked: what can be refused without starting anything."""
    shm_modes = parse_list(args.shared_memory, SHM_MODES, "--shared-memory")
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise SystemExit(f"--concurrency takes a comma-separated list of integers; got {args.concurrency!r}") from None
    if "cuda" in shm_modes and gpu_count() == 0:
        raise SystemExit("--shared-memory cuda needs a CUDA GPU on this host (perf_analyzer allocates the regions)")
    binary = args.perf_dir / "bin" / "perf_analyzer"
    if not binary.exists():
        raise SystemExit(f"{binary} not found: run `make perf` (it installs perf_analyzer) or pass --perf-dir")
    return argparse.Namespace(device=resolve_device(args.device), shm_modes=shm_modes, levels=levels, binary=binary,
                              ensembles=parse_list(args.ensembles, tuple(ENSEMBLES), "--ensembles"),
                              images=request_images(args.images))


def measure(args, argv, plan: argparse.Namespace, daemon: mps.Daemon | None = None) -> int:
    device, ensembles, shm_modes, levels, binary, images = (plan.device, plan.ensembles, plan.shm_modes, plan.levels,
                                                             plan.binary, plan.images)
    args.out.mkdir(parents=True, exist_ok=True)
    # One request for every mode of the run, so that the modes compare like for like.
    with_frames = shm_modes != ["none"]
    data = write_input_data(args.out / "input_data.json", images, media_frames=with_frames)
    served = RunningServer(args.url) if args.url else None
    if served:
        device = served.device
    # perf_analyzer resends one request: with the embedding cache on, every request after the first would
    # be a hit and the encoder would not run. Off by default, so that what is measured is the pipeline
    # (the cache's own figures: lab/bench/multiturn.py).
    dep = Deployment(device=device, checkpoint=args.checkpoint, encoder_instances=args.encoder_instances,
                     preprocess_instances=args.preprocess_instances, cache_bytes=args.cache_bytes)
    sizes = output_byte_sizes(dep, chat_prompt_ids(len(images)), images, served)
    # perf_analyzer gives every variable-shape output its own region of this size (x batch size 1).
    output_region = max(sizes.values())
    if max(levels) > dep.max_queue:
        print(f"note: concurrency {max(levels)} exceeds the queue bound ({dep.max_queue} waiting for moonvit3d); "
              f"the server refuses what does not fit, so expect errors there")
    # Under --mps the server and perf_analyzer are the daemon's clients; this process is not (its own
    # CUDA context, for the encoder alone, would keep the daemon from quitting).
    mps_env = daemon.env() if daemon else {}
    server = served or deployment_server(dep, f"perf-{device}", env=mps_env)
    runs = [(ENSEMBLES[e], shm, level) for e in ensembles for shm in shm_modes for level in levels]
    rows = []
    # The GPU's clock while each run goes (lab/bench/gpu_clocks.py): near the power limit it follows the load,
    # so a served figure and the encoder alone's are read with their clocks beside them.
    clocks = ClockSampler() if device == "gpu" else None
    t0 = time.monotonic()
    with server:
        # A few requests per ensemble first, so that no measurement window pays for first-call work
        # (kernel compilation for this image size, the encoder's CUDA graph capture on the second
        # sighting of a grid list, lazy imports in the stubs).
        for name in ensembles:
            client = KimiVisionClient(server.grpc_url, model=ENSEMBLES[name], batched=name == "batched")
            for _ in range(3):
                client.infer(chat_prompt_ids(len(images)), images)
            client.close()
        hung = None  # the run that timed out: the server may be stuck, so the later runs are not started
        for model, shm, level in runs:
            if hung is not None:
                rows.append({"model": model, "shm": shm, "Concurrency": str(level), "failed": f"not run after {hung}"})
                continue
            csv_path = args.out / f"perf_{device}_{model}_{args.images}_shm-{shm}_c{level}.csv"
            cmd = [str(binary), "-m", model, "-b", "1", "-i", "grpc", "-u", server.grpc_url,
                   "--input-data", str(data), "--concurrency-range", f"{level}:{level}",
                   "--measurement-interval", str(args.measurement_ms), "--percentile", "99",
                   "-f", str(csv_path), "--verbose-csv"]
            cmd += ["--stability-percentage", str(args.stability), "--max-trials", "10"]
            if shm != "none":
                cmd += ["--shared-memory", shm, "--output-shared-memory-size", str(output_region)]
            print("$", shlex.join(cmd), flush=True)
            counts_before = encoder_counts(server.grpc_url)
            run_start = time.perf_counter()
            try:
                # At most --max-trials windows plus start-up and draining. A run past that is taken as hung
                # and the later runs are not started (the server may be stuck).
                proc = subprocess.run(cmd, env={**perf_analyzer_env(args.perf_dir), **mps_env}, capture_output=True, text=True,
                                      timeout=args.run_timeout or 12 * args.measurement_ms / 1000 + 120)
            except subprocess.TimeoutExpired as exc:
                print(f"perf_analyzer timed out after {exc.timeout:.0f}s ({model}, shm {shm}, concurrency {level})")
                rows.append({"model": model, "shm": shm, "Concurrency": str(level), "failed": "timeout"})
                hung = f"the timeout at {model} c={level}"
                continue
            if proc.returncode != 0:
                # e.g. exit 2: no stable window within --max-trials (a busy 2-core machine)
                print(f"perf_analyzer exited {proc.returncode} ({model}, shm {shm}, concurrency {level}):\n"
                      f"{proc.stdout[-1500:]}{proc.stderr[-800:]}")
                rows.append({"model": model, "shm": shm, "Concurrency": str(level), "failed": proc.returncode})
                continue
            counts_after = encoder_counts(server.grpc_url)
            batch = float("nan")
            if counts_before and counts_after and counts_after[1] > counts_before[1]:
                batch = (counts_after[0] - counts_before[0]) / (counts_after[1] - counts_before[1])
            with open(csv_path) as f:
                clock = clocks.between(run_start, time.perf_counter()) if clocks else "-"
                rows += [{**row, "model": model, "shm": shm, "encoder_batch": batch, "clock": clock}
                         for row in csv.DictReader(f)]
    wall = time.monotonic() - t0
    if daemon is not None and not daemon.stop():
        print(f"warning: the MPS daemon was still running {mps.STOP_TIMEOUT_S:.0f} s after the server stopped")
    encoder_line = (encoder_alone_line(dep, images, clocks, args.alone_seconds)
                    if args.encoder_alone and not served else "")
    clock_complaint = clocks.close() if clocks else ""
    if encoder_line and daemon is not None:
        encoder_line += " (no MPS)"

    lines = [f"$ python -m lab.bench.perf {shlex.join(sys.argv[1:] if argv is None else list(argv))}",
             f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, device={device}, "
             f"checkpoint={args.checkpoint or 'embedded demo'}, images={args.images} ({len(images)} per request), "
             f"{time.strftime('%Y-%m-%d %H:%M')}, wall {wall:.0f}s"
             + ("" if served else f", instances{' per GPU' if dep.device == 'gpu' else ''}: moonvit3d {dep.encoder_instances}, "
                                  f"kimi_preprocess {dep.preprocess_instances}, embedding cache "
                                  + (f"{dep.cache_bytes:,} B" if dep.cache_bytes else "off"))
             + (", MEDIA_FRAMES sent as zeros (perf_analyzer's shared memory needs every input)" if with_frames else ""),
             "outputs per request: " + ", ".join(f"{k} {v:,} B" for k, v in sizes.items())
             + (f"; shared-memory region per output {output_region:,} B" if shm_modes != ["none"] else ""),
             "out ms = server compute output (avg), net ms = network + server send/recv (avg), "
             "enc batch = requests per moonvit3d execution over perf_analyzer's whole run at that level",
             f"{'ensemble':>24} {'shm':>6} {'concurrency':>11} {'infer/s':>9} {'images/s':>9} {'p50 ms':>9} "
             f"{'p99 ms':>9} {'out ms':>8} {'net ms':>8} {'enc batch':>9}"]
    if encoder_line:
        lines.insert(3, encoder_line)
    for row in rows:
        head = f"{row['model']:>24} {row['shm']:>6} {row['Concurrency']:>11}"
        if "failed" in row:
            lines.append(f"{head}   perf_analyzer failed ({row['failed']}; its output is printed above)")
            continue
        rps = float(row["Inferences/Second"])
        lines.append(f"{head} {rps:9.2f} {len(images) * rps:9.2f} {_ms(row, 'p50 latency'):9.1f} "
                     f"{_ms(row, 'p99 latency'):9.1f} {_ms(row, 'Server Compute Output'):8.1f} "
                     f"{_ms(row, 'Network+Server Send/Recv'):8.1f} {row.get('encoder_batch', float('nan')):9.2f}")
    if clocks is not None:
        lines.append("GPU SM clock and power while each run went (medians of nvidia-smi's 100 ms samples, warm-up "
                     "and drain included): " + (clock_complaint or "; ".join(
                         f"{row['model']} c={row['Concurrency']}: {row['clock']}" for row in rows if "failed" not in row)))
    text = "\n".join(lines)
    print("\n" + text)
    (args.out / "perf_summary.md").write_text("```\n" + text + "\n```\n")
    if args.section:
        page = write_section(device, args.section, "```\n" + text + "\n```")
        print(f"written to {page}")
    failed = [row for row in rows if "failed" in row]
    if failed:  # a level that gave no figure fails the run (make perf, CI), after the table says which
        print(f"{len(failed)} of {len(rows)} perf_analyzer runs failed", file=sys.stderr)
        return 1
    return 0


def encoder_counts(url: str) -> tuple[int, int] | None:
    """moonvit3d's (requests, executions) so far, from tritonserver's statistics API: their ratio over
    a run is the batch size the dynamic batcher formed. None if the statistics could not be read."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics(ENCODER, as_json=True)["model_stats"][0]
        return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))
    except Exception:  # noqa: BLE001 - a column of the report, never a reason to stop
        return None
    finally:
        client.close()


def encoder_workload(model, cfg, images: list[bytes], cuda_graphs: int, batch: int):
    """The encoder as moonvit3d runs it (bf16, CUDA graphs) on the request's pixels: (encoder, one
    request's (pixels, grids), a full dynamic batch of `batch` such requests in one forward's inputs;
    eager once it passes the graphs' patch bound)."""
    import numpy as np
    import torch

    from backends.encoder.graphs import GraphedEncoder
    from backends.preprocess import Preprocessor

    encoder = GraphedEncoder(model, max_graphs=cuda_graphs)
    pixels, grids, _ = Preprocessor(cfg.media, device="cuda", out_dtype=torch.bfloat16)(images)
    full = (torch.cat([pixels] * batch), np.concatenate([np.asarray(grids)] * batch))
    return encoder, (pixels, grids), full


def encoder_alone_line(dep: Deployment, images: list[bytes], clocks=None, seconds: float = 0.0) -> str:
    """The encoder alone in this process, as the server runs it (bf16, CUDA graphs), on the request's
    pixels: the images/s it allows, to compare the served images/s with in the same run. With `seconds`,
    also the same forward back to back for that long (no host wait between forwards, as a loaded server
    queues them), timed over its second half: the rate under sustained load, clock beside it."""
    import statistics

    import torch

    from backends.checkpoint import load_model
    from lab.bench.gpu_timing import back_to_back, timed

    model, cfg = load_model(dep.checkpoint, "cuda", torch.bfloat16)
    full = dep.max_batch
    encoder, (pixels, grids), (batch_pixels, batch_grids) = encoder_workload(model, cfg, images, dep.cuda_graphs, full)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ms = statistics.median(timed(lambda: encoder(pixels, grids), 20, warmup=3))
    burst_clock = f" ({clocks.between(t0, time.perf_counter())})" if clocks else ""
    # What moonvit3d runs under load: a full dynamic batch in one forward, per request.
    batch_ms = statistics.median(timed(lambda: encoder(batch_pixels, batch_grids), 5, warmup=2)) / full
    line = (f"encoder alone (this process, same weights and pixels, CUDA graphs): {ms:.2f} ms per request = "
            f"{1000 / ms * len(images):.1f} images/s{burst_clock}; {full} requests in one forward (a full moonvit3d batch"
            f"{', eager' if not encoder.applies(batch_pixels.shape[0]) else ''}): {batch_ms:.2f} ms per request")
    if seconds > 0:
        sustained_ms, clock = back_to_back(lambda: encoder(pixels, grids), seconds, clocks)
        line += (f"; back to back for {seconds:g} s (second half): {sustained_ms:.2f} ms per request = "
                 f"{1000 / sustained_ms * len(images):.1f} images/s ({clock})")
    return line


if __name__ == "__main__":
    raise SystemExit(main())
