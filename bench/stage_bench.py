"""Where a request's time goes: one row per stage, per case, all in one run (GPU).

    python -m bench.stage_bench --checkpoint /tmp/kimi-random --out bench/out [--profile]

Cases: 1x1024^2, 1x3000^2, 8x448^2 JPEGs (quality 90, 4:2:0). Per case:
- end to end: the client's wall time, IMAGE_EMBEDS written into one CUDA region registered once
  (`KimiVisionClient.infer_into`, what a co-located LLM does), median of --iters; and, alternating with
  those, with the images in one registered host region as well (`ImagesRegion`: no image bytes
  through gRPC);
- per composing model, from tritonserver's statistics API over those same requests: queue, compute
  input, compute infer and compute output per request (ms);
- the encoder alone, in this process on the same weights and pixels, as the server runs it (bf16,
  CUDA graphs for grid lists seen before): median of CUDA-synchronized wall times;
- decode alone: the exact GPU decode (nvJPEG hardware planes + our upsampling/colour kernel, waiting
  for the scan checks), the scan check alone (backends/preprocess/scan_check.c: a large scan on
  several threads, the images of a request one after another), and
  Pillow's `Image.open(f).convert("RGB")` on one core, per request's images.
Then end to end / encoder alone, the issue's target (<= 1.25x). Then, per case, --trace-requests more
requests traced by tritonserver itself (clients/tracing.py): the request cut into consecutive stretches
(client send, front end, each step's queue, inputs, stub and hand-on, the response): each request's
stretches add up to its wall time exactly, their medians to about the median wall time. Beside them,
our code's own host time in each stub over the same requests (sent the lean way, images in the
registered region), and that time by phase (the server runs with KIMI_PHASES=1, backends/phases.py).
Then, for the issue's concurrency-16 cases, --batch-trace-requests sent --batch-trace-concurrency at a
time, all traced: moonvit3d's executions (batches), what each spends on inputs, in its stub, on the
responses, and the gap to the next, beside images/s (over the whole pass, and the steady rate of the
executions between the first and the last: clients.tracing.steady_rate) and the encoder alone's.
--profile also writes the stubs' torch-profiler tables (backends/serving/profiling.py) under
--out/profile, from extra requests of the first case sent after the measured ones.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from backends.config import env_int
from backends.deploy.launcher import deployment_server
from backends.deploy.repository import Deployment
from backends.deploy.supervisor import scrape
from backends.encoder.graphs import GraphedEncoder
from backends.preprocess import Preprocessor, scan_check
from backends.preprocess.jpeg_gpu import GpuJpegDecoder
from backends.serving.profiling import cuda_device_flags, python_table
from backends.weights.load import load_model
from bench.e2e_bench import case_requests
from bench.gpu_timing import machine_line, timed, write_report
from clients.kimi_client import CudaOutputRegion, ImagesRegion, KimiVisionClient
from clients.tracing import Tracer, batch_stretches, batches, off_path, spans, steady_rate, stub_label
from clients.tracing import clear as clear_traces
from contract import ENCODER, ENSEMBLE, PLACEHOLDER, PREPROCESS

STAGES = ("queue", "compute_input", "compute_infer", "compute_output")


def model_stats(client, model: str) -> dict[str, float]:
    """Cumulative (count, ns per stage) of one model, from tritonserver's statistics API."""
    s = client.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
    out = {"count": float(s.get("success", {}).get("count", 0))}
    for stage in STAGES:
        out[stage] = float(s.get(stage, {}).get("ns", 0))
    return out


def model_table(stats_client, metrics_url: str) -> dict[str, dict[str, float]]:
    ours, _ = our_seconds(metrics_url)
    table = {m: model_stats(stats_client, m) for m in (ENSEMBLE, PLACEHOLDER, PREPROCESS, ENCODER)}
    for m, row in table.items():
        row["our_code_s"] = ours.get(m, 0.0)
    return table


def our_seconds(metrics_url: str) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """One scrape: model -> cumulative seconds our code spent in execute (kimi_vision_step_seconds_sum:
    host time, GPU work may still run after it; Triton's compute infer minus this is the Python
    backend's own share, moving tensors and messages between server and stub, plus waiting for the
    GPU), and (model, phase) -> cumulative seconds (kimi_vision_phase_seconds_total; KIMI_PHASES=1 in
    the stubs, backends/phases.py)."""
    steps, phase = {}, {}
    for name, labels, value in scrape(metrics_url, timeout_s=10):
        if name == "kimi_vision_step_seconds_sum" and "model" in labels:
            steps[labels["model"]] = value
        elif name == "kimi_vision_phase_seconds_total" and "model" in labels and "phase" in labels:
            phase[(labels["model"], labels["phase"])] = value
    return steps, phase


def per_request_ms(before: dict, after: dict) -> dict[str, float]:
    n = max(after["count"] - before["count"], 1.0)
    out = {stage: (after[stage] - before[stage]) / n / 1e6 for stage in STAGES}
    out["our_code"] = (after.get("our_code_s", 0.0) - before.get("our_code_s", 0.0)) / n * 1e3
    return out


PATH = [PREPROCESS, ENCODER]  # the steps one request runs one after another (kimi_placeholder runs beside ENCODER)


def traced_pass(send, tracer: Tracer, metrics_url: str, n: int) -> dict:
    """n requests (`send()` sends one) traced by the server: median ms per stretch (in order), the
    median client wall time, our code's mean host time per stub over them, and how early
    kimi_placeholder answered."""
    time.sleep(1.0)  # the stubs send their step times every 0.2 s: the requests before are all counted
    before, phases_before = our_seconds(metrics_url)
    tracer.trace(n)
    try:
        times = []
        for _ in range(n):
            sent = time.monotonic_ns()
            send()
            times.append((sent, time.monotonic_ns()))
        traced = tracer.read()
    finally:
        tracer.stop()
    time.sleep(1.0)  # the step-time metric is counted as each execute returns
    after, phases_after = our_seconds(metrics_url)
    if len(traced) != n:
        raise RuntimeError(f"{len(traced)} traced requests read, {n} sent")
    cut = [spans(req, PATH, sent, received) for req, (sent, received) in zip(traced, times)]
    labels = [label for label, _ in cut[0]]
    return {"stretches": {label: statistics.median(c[k][1] for c in cut) for k, label in enumerate(labels)},
            "stretch_means": {label: statistics.mean(c[k][1] for c in cut) for k, label in enumerate(labels)},
            "wall_ms": statistics.median((b - a) / 1e6 for a, b in times),
            "our_code_ms": {m: (after.get(m, 0.0) - before.get(m, 0.0)) / n * 1e3 for m in PATH},
            # "model|phase" -> mean ms per request (moonvit3d counts per batch: one request per batch here)
            "phases_ms": {f"{m}|{p}": (v - phases_before.get((m, p), 0.0)) / n * 1e3
                          for (m, p), v in phases_after.items() if m in PATH},
            "placeholder_early_ms": statistics.median(off_path(req, PATH)[PLACEHOLDER] for req in traced)}


def traced_concurrent(make_send, tracer: Tracer, n: int, concurrency: int) -> dict:
    """n requests from `concurrency` threads at once, all traced: moonvit3d's executions (batches) and
    the medians of their stretches, how much of the run the encoder's executions covered, and requests
    per second. Each thread sends with its own `make_send(held)`, made before the clock starts; a
    sender enters what it holds (its own client and regions) into `held`, an ExitStack closed when the
    pass ends."""
    left, lock, errors = [n], threading.Lock(), []

    def worker(send):
        try:
            while True:
                with lock:
                    if left[0] == 0:
                        return
                    left[0] -= 1
                send()
        except Exception as exc:  # noqa: BLE001 - reported after the run
            errors.append(exc)

    tracer.trace(n)
    try:
        with contextlib.ExitStack() as held:
            threads = [threading.Thread(target=worker, args=(make_send(held),)) for _ in range(concurrency)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
        if errors:
            raise errors[0]
        traced = tracer.read(timeout_s=30)
    finally:
        tracer.stop()
    found = batches(traced, ENCODER)
    rows = batch_stretches(found)
    span = (found[-1].end - found[0].start) / 1e9 if found else 0.0

    def med(key):
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if values else float("nan")

    return {"requests": len(traced), "concurrency": concurrency, "requests_per_s": n / wall,
            "steady_requests_per_s": steady_rate(found),
            "batches": len(found), "batch_sizes": [b.size for b in found],
            "median": {k: med(k) for k in ("size", "inputs", "stub", "responses", "gap")},
            "encoder_busy": sum(b.end - b.start for b in found) / 1e9 / span if span else float("nan")}


def profile_alone(path: Path, fn, calls: int = 5) -> None:
    """cProfile over `calls` calls of fn in this process (each ends with a device sync), written like the
    stubs' windows (backends/serving/profiling.py), to set function by function beside theirs."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
        torch.cuda.synchronize()
    prof.disable()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"in-process: {calls} calls; CUDA device flags: {cuda_device_flags()}\n"
                    f"Python, by cumulative time:\n{python_table(prof)}\n")


def measure_alone(args, dep: Deployment, requests: dict) -> dict:
    """In this process: the encoder as the server runs it (bf16, CUDA graphs), preprocessing, and
    decoding alone (exact GPU decode, Pillow on one core), per case."""
    model, cfg = load_model(args.checkpoint, "cuda", torch.bfloat16)
    encoder = GraphedEncoder(model, max_graphs=dep.cuda_graphs)
    pre = Preprocessor(cfg.media, dep.limits, device="cuda", out_dtype=torch.bfloat16)
    jpeg = GpuJpegDecoder(torch.device("cuda"))
    alone = {}
    for case, (ids, blobs, _) in requests.items():
        pixels, grids, _ = pre(blobs)
        enc_ms = statistics.median(timed(lambda: encoder(pixels, grids), args.iters, warmup=3))
        gpu_ms = (statistics.median(timed(lambda: jpeg.decode(blobs, [Image.open(io.BytesIO(b)) for b in blobs]), args.iters))
                  if jpeg.enabled else float("nan"))
        pil_ms = statistics.median(timed(lambda: [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in blobs],
                                         max(3, args.iters // 4), warmup=1))
        check_ms = statistics.median(timed(lambda: [scan_check.check(b) for b in blobs], args.iters, warmup=1))
        pre_ms = statistics.median(timed(lambda: pre(blobs), args.iters))
        if args.profile and case == (args.profile_case or next(iter(requests))):  # as the stubs profile it
            profile_alone(args.out / "profile" / "alone-preprocess.txt", lambda: pre(blobs))
        alone[case] = {"encoder_ms": enc_ms, "gpu_decode_ms": gpu_ms, "pillow_decode_ms": pil_ms,
                       "scan_check_ms": check_ms, "preprocess_ms": pre_ms, "images": len(blobs)}
    return alone


def trace_table(results: dict, n: int) -> list[str]:
    """The traced stretches, one column per case."""
    traced = {case: r["trace"] for case, r in results.items() if "trace" in r}
    if not traced:
        return []
    cases = list(traced)
    labels = list(next(iter(traced.values()))["stretches"])
    lines = ["", f"Traced by tritonserver ({n} more requests per case, clients/tracing.py): medians in ms of "
             "consecutive stretches; a step hands on when its stub's answer is back. `our code`: our execute's "
             "host time in that stub (kimi_vision_step_seconds), set beside the mean of the stretch it runs in, "
             "and taken apart by phase below it, largest first (backends/phases.py).", "",
             "| stretch | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(f"{traced[c]['stretches'].get(label, float('nan')):.3f}" for c in cases) + " |")
        model = next((m for m in PATH if label == stub_label(m)), None)
        if model is not None:
            lines.append(f"| {model}'s our code, mean / this stretch's mean | "
                         + " | ".join(f"{traced[c]['our_code_ms'][model]:.3f} / {traced[c]['stretch_means'][label]:.3f}" for c in cases) + " |")
            found = {k.partition("|")[2] for c in cases for k in traced[c].get("phases_ms", {}) if k.startswith(model + "|")}
            # Largest first (by the cases' total): where the time goes, in order.
            for phase in sorted(found, key=lambda ph: -sum(traced[c].get("phases_ms", {}).get(f"{model}|{ph}", 0.0)
                                                            for c in cases)):
                lines.append(f"| - of which {phase} (mean) | "
                             + " | ".join(f"{traced[c].get('phases_ms', {}).get(model + '|' + phase, 0.0):.3f}" for c in cases) + " |")
    lines.append("| sum of the medians | " + " | ".join(f"{sum(traced[c]['stretches'].values()):.3f}" for c in cases) + " |")
    lines.append("| median wall time of the traced requests | " + " | ".join(f"{traced[c]['wall_ms']:.3f}" for c in cases) + " |")
    lines.append(f"| {PLACEHOLDER} answered before {ENCODER} by | " + " | ".join(f"{traced[c]['placeholder_early_ms']:.3f}" for c in cases) + " |")
    return lines


def batch_table(results: dict) -> list[str]:
    """moonvit3d's executions under concurrent load, one row per case."""
    rows = {case: r for case, r in results.items() if "batches" in r}
    if not rows:
        return []
    c = next(iter(rows.values()))["batches"]["concurrency"]
    lines = ["", f"moonvit3d's executions with {c} requests in flight, all traced (clients/tracing.batches): medians "
             "in ms per execution of its inputs to the stub, the stub until its answer, the answer until the execution "
             "ends (the responses; their output copies wait for the kernels), and the gap to the next execution; "
             "`executing`: the share of the run from the first execution's start to the last one's end that "
             "moonvit3d was executing. images/s beside the encoder alone's (1000 / its ms x images per request); "
             "`steady`: images/s of the executions between the first and the last (clients/tracing.steady_rate), "
             "without the run's start and end.", "",
             "| case | requests | images/s | steady images/s | encoder alone images/s | executions | batch size | inputs | stub | responses | gap | executing |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, r in rows.items():
        b, m = r["batches"], r["batches"]["median"]
        steady = b.get("steady_requests_per_s")
        steady_cell = f"{steady * r['images']:.1f}" if steady is not None else "-"
        lines.append(f"| {case} | {b['requests']} | {b['requests_per_s'] * r['images']:.1f} | {steady_cell} | "
                     f"{1000 / r['encoder_ms'] * r['images']:.1f} | "
                     f"{b['batches']} | {m['size']:.0f} | {m['inputs']:.2f} | {m['stub']:.2f} | {m['responses']:.2f} | "
                     f"{m['gap']:.2f} | {b['encoder_busy']:.3f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--trace-requests", type=int, default=10, help="requests per case traced by the server (0: none)")
    ap.add_argument("--batch-trace-requests", type=int, default=96,
                    help="requests per case sent at --batch-trace-concurrency and traced, for moonvit3d's batches (0: none)")
    ap.add_argument("--batch-trace-concurrency", type=int, default=16)
    ap.add_argument("--batch-trace-cases", default="1x1024^2,8x448^2", help="the cases of the batch trace (the issue's c=16 cases)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-case", default="", help="the case the profile windows see (default: the first)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    dep = Deployment(device="gpu", checkpoint=args.checkpoint)
    requests = case_requests(dep)
    if args.profile_case and args.profile_case not in requests:  # before the measurements, not after
        ap.error(f"--profile-case {args.profile_case!r}: the cases are {', '.join(requests)}")
    trigger = (args.out / "profile" / "START").resolve()
    if args.profile:
        # The stubs profile a window of execute calls that opens once `trigger` exists, after every
        # measured request, so the statistics never include the profiler's cost.
        trigger.unlink(missing_ok=True)
        os.environ.update(KIMI_PROFILE_DIR=str(trigger.parent), KIMI_PROFILE_SKIP="0",
                          KIMI_PROFILE_TRIGGER=str(trigger))

    alone = measure_alone(args, dep, requests)  # its model is freed on return
    torch.cuda.empty_cache()

    results, lines = {}, []
    trace_file = args.out / "trace" / "trace.json"
    clear_traces(trace_file)  # a warm machine's earlier run
    # KIMI_PHASES: the stubs take their own host time apart by phase (a few microseconds per request).
    with deployment_server(dep, "stages", trace_file=trace_file, env={"KIMI_PHASES": "1"}) as server, \
            contextlib.ExitStack() as held:
        import tritonclient.grpc as grpcclient

        # Closed in reverse on any way out: a host region left behind outlives this process in /dev/shm.
        client = KimiVisionClient(server.grpc_url)
        held.callback(client.close)
        stats_client = grpcclient.InferenceServerClient(server.grpc_url)
        held.callback(stats_client.close)
        region = held.enter_context(CudaOutputRegion(client, max(n for *_, n in requests.values())))
        inputs = held.enter_context(ImagesRegion(client))  # grown, where a case needs it, in that case's warm-up
        tracer = Tracer(stats_client, server.trace_file)
        ways = {"body": {}, "region": {"images_region": inputs}}
        for case, (ids, blobs, capacity) in requests.items():
            for k in range(3):  # warm-up: first-call compilation, the graph capture on a second sighting
                client.infer_into(region, ids, blobs, **ways["region" if k == 0 else "body"])  # both ways warm
            time.sleep(1.0)  # tritonserver records a request's statistics as it releases it, after the reply
            before = model_table(stats_client, server.metrics_url)
            # Side by side: the images in the request body and in the registered region, alternately, each
            # first every other time.
            walls = {way: [] for way in ways}
            for i in range(args.iters):
                for way in (("body", "region") if i % 2 == 0 else ("region", "body")):
                    walls[way] += timed(lambda: client.infer_into(region, ids, blobs, **ways[way]), 1, warmup=0)
            time.sleep(1.0)
            after = model_table(stats_client, server.metrics_url)
            stages = {m: per_request_ms(before[m], after[m]) for m in before}
            e2e, lean_ms = statistics.median(walls["body"]), statistics.median(walls["region"])
            results[case] = {"end_to_end_ms": e2e, "stages": stages, **alone[case],
                             "end_to_end_over_encoder": e2e / alone[case]["encoder_ms"],
                             "images_region_ms": lean_ms, "images_region_over_encoder": lean_ms / alone[case]["encoder_ms"]}

            def lean():
                return client.infer_into(region, ids, blobs, images_region=inputs)

            if args.trace_requests > 0:  # after the statistics' window: tracing costs a little
                results[case]["trace"] = traced_pass(lean, tracer, server.metrics_url, args.trace_requests)
            if args.batch_trace_requests > 0 and case in args.batch_trace_cases.split(","):
                def make_send(held, ids=ids, blobs=blobs, capacity=capacity):
                    # Each thread its own client and regions (one request at a time per region).
                    own = KimiVisionClient(server.grpc_url)
                    held.callback(own.close)
                    out = held.enter_context(CudaOutputRegion(own, capacity))
                    images = held.enter_context(ImagesRegion(own))
                    return lambda: own.infer_into(out, ids, blobs, images_region=images)

                results[case]["batches"] = traced_concurrent(make_send, tracer, args.batch_trace_requests,
                                                             args.batch_trace_concurrency)
        if args.profile:  # the profile window: one case again; windows still open close at shutdown
            trigger.parent.mkdir(parents=True, exist_ok=True)
            trigger.touch()
            ids, blobs, _ = requests[args.profile_case or next(iter(requests))]
            for _ in range(2 * env_int("KIMI_PROFILE_CALLS", 5)):
                client.infer_into(region, ids, blobs)
        held.close()
        if args.profile:
            server.stop()  # unloading writes the windows that are still open

    lines += ["# Stage breakdown: where a request's time goes (GPU deployment)\n", f"{machine_line()}\n",
              f"checkpoint {args.checkpoint}; {args.iters} requests per case after 3 warm-ups; end to end = client wall "
              "time (median) with IMAGE_EMBEDS written into one registered CUDA region, the images in the request "
              "body; `images region`: the same with the images in one registered host region too (ImagesRegion), "
              "the two sent alternately, each first every other time; per-model times from tritonserver's statistics over both kinds of request "
              "(ms per request); encoder and decode alone in this process.\n",
              "| case | end to end | encoder alone | e2e / encoder | images region | its e2e / encoder | preprocessing alone | GPU decode alone | scan check alone | Pillow decode (1 core) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for case, r in results.items():
        lines.append(f"| {case} | {r['end_to_end_ms']:.1f} | {r['encoder_ms']:.1f} | {r['end_to_end_over_encoder']:.2f}x | "
                     f"{r['images_region_ms']:.1f} | {r['images_region_over_encoder']:.2f}x | "
                     f"{r['preprocess_ms']:.1f} | {r['gpu_decode_ms']:.2f} | {r['scan_check_ms']:.2f} | "
                     f"{r['pillow_decode_ms']:.1f} |")
    lines += ["", "`our code` = host time of our execute per request (kimi_vision_step_seconds; the ensemble has none).",
              "", "| case | model | queue | compute input | compute infer | compute output | our code |",
              "|---|---|---|---|---|---|---|"]
    for case, r in results.items():
        for m, st in r["stages"].items():
            lines.append(f"| {case} | {m} | " + " | ".join(f"{st[s]:.2f}" for s in (*STAGES, "our_code")) + " |")
    lines += trace_table(results, args.trace_requests)
    lines += batch_table(results)
    write_report(args.out, "stage_bench", lines, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
