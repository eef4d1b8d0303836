"""End to end, JPEG bytes to image embeddings, side by side in one run, for 1x1024^2, 1x3000^2 and
8x448^2 JPEGs (quality 90), median and min of N wall-clock runs after two warm-ups:

(a) ours through tritonserver (GPU deployment of --checkpoint, the embedding cache off: every call
    encodes) over gRPC: the embeddings come back
    in the gRPC response (BF16; tritonclient returns ml_dtypes.bfloat16, KimiVisionClient widens it
    to a float32 numpy array);
(a2) as (a) with `KimiVisionClient(embeds_dtype="bf16")`: the response's BF16 bits as they came;
(a3) as (a2) over HTTP with binary tensor data;
(b2) as (a), the images and IMAGE_EMBEDS through POSIX shared memory (`infer(..., shm="system")`, regions
    from the client's pool);
(b) the same server, IMAGE_EMBEDS written into client CUDA shared memory by
    `KimiVisionClient.infer(..., shm="cuda")`, which takes a region from the client's pool (registered
    at the first call), copies the embeddings out of it on the GPU and to a host float32 array;
(c) the same server, IMAGE_EMBEDS written into one CUDA region registered once and reused
    (`KimiVisionClient.infer_into` with a `CudaOutputRegion`), the embeddings left there (what a
    co-located LLM process does);
(e) the same server, a NIXL descriptor instead of IMAGE_EMBEDS (`infer(..., nixl=True)`), then this
    process READs the rows with `clients.nixl_pull.NixlPuller` into one GPU buffer registered once (UCX
    between GPUs of one host: CUDA IPC); the server frees its copy on the READ's notification. The
    report sets it against (c), the registered CUDA region;
(d) the reference, in this process: the checkpoint processor's arithmetic on the CPU
    (`oracles.checkpoint_processor`: Pillow decode + BICUBIC resize, numpy
    pad/normalize/patchify), then transformers' Kimi_K25 vision tower + projector (SDPA, bf16) on the
    GPU with the same checkpoint's weights, ending with the embeddings on the GPU (synchronized).

Before timing, each path's output is compared with a first (a) call: (a) again, (b) and (c) must be
equal, (d) differs by the bf16 arithmetic of two implementations. A path that fails is reported in
its row and the others still run; (d) is skipped with a note when transformers lacks Kimi_K25.

    python -m lab.bench.e2e_bench --checkpoint /tmp/kimi-random --out lab/out
"""

from __future__ import annotations

import argparse
import statistics
import traceback
from pathlib import Path

import numpy as np
import torch

from backends.checkpoint import load_config
from backends.deploy.repository import Deployment
from backends.deploy.launcher import deployment_server
from backends.errors import first_line
from lab.bench.cases import CASES, case_jpegs
from lab.bench.gpu_timing import machine_line, timed, write_report
from lab.bench.perf import output_byte_sizes
from oracles.checkpoint_processor import reference_pixels
from clients.kimi_client import CudaOutputRegion, KimiVisionClient, chat_prompt_ids

# key: (table label, where the embeddings are when the clock stops, what the end to end contains)
IMPLEMENTATIONS = {
    "grpc": ("(a) ours, tritonserver, gRPC", "host float32 array",
             "gRPC request (ids + JPEG bytes) over loopback; server: 1:1 check and resize plan, Pillow decode, "
             "GPU resize + normalize/patchify, MoonViT3d + projector (BF16); the BF16 embeddings back in the "
             "gRPC response, widened to float32 by KimiVisionClient"),
    "grpc_bf16": ("(a2) ours, tritonserver, gRPC, embeds_dtype='bf16'", "host BF16 bits (uint16 array)",
                  "as (a), but KimiVisionClient(embeds_dtype='bf16') hands back the response's BF16 bits as they "
                  "came (no widening)"),
    "http_bf16": ("(a3) ours, tritonserver, HTTP binary data, embeds_dtype='bf16'", "host BF16 bits (uint16 array)",
                  "as (a2), over HTTP with binary tensor data (tritonclient.http)"),
    "system_shm": ("(b2) ours, tritonserver, system shm (KimiVisionClient.infer, pooled regions)",
                   "host float32 array",
                   "as (a), but the images and IMAGE_EMBEDS go through two POSIX shared-memory regions from the "
                   "client's pool (registered at the first call); the embeddings copied out and widened"),
    "cuda_shm_per_call": ("(b) ours, tritonserver, CUDA shm (KimiVisionClient.infer, pooled region)",
                          "client GPU buffer + host float32 copy",
                          "as (a), but the server writes IMAGE_EMBEDS into a CUDA buffer of the client: "
                          "KimiVisionClient.infer(shm='cuda') takes it from the client's pool (registered at "
                          "the first call), copies the embeddings to a torch tensor and to a host float32 array"),
    "cuda_shm_registered": ("(c) ours, tritonserver, CUDA shm (region registered once)", "client GPU buffer (BF16)",
                            "as (a), but the server writes IMAGE_EMBEDS into one CUDA buffer registered once "
                            "before timing; the embeddings stay there (what a co-located LLM does)"),
    "nixl_pull": ("(e) ours, tritonserver, NIXL descriptor + READ into a GPU buffer registered once",
                  "client GPU buffer (BF16)",
                  "as (a), but the response carries a NIXL descriptor instead of IMAGE_EMBEDS (the encoder copied "
                  "the rows into its registered arena); this process READs them with clients.nixl_pull into one GPU "
                  "buffer registered before timing (UCX, CUDA IPC on one host) and the server frees them on the "
                  "READ's notification (what an LLM on another host does, here on the same one)"),
    "reference": ("(d) reference: checkpoint processor (CPU) + transformers SDPA (GPU), in process",
                  "GPU tensor (BF16)",
                  "in this process, no server: the checkpoint processor's arithmetic on the CPU (Pillow "
                  "decode + BICUBIC resize, numpy pad/normalize/patchify), fp32 pixels to the GPU as BF16, "
                  "transformers' Kimi_K25 vision tower + projector (SDPA, BF16, the checkpoint's weights), "
                  "torch.cuda.synchronize()"),
}


def case_requests(dep: Deployment) -> dict[str, tuple]:
    """case -> (prompt ids, JPEG bytes (quality 90, 4:2:0), IMAGE_EMBEDS bytes as `dep` serves them)."""
    requests = {}
    for case in CASES:
        blobs = case_jpegs(case)
        ids = chat_prompt_ids(len(blobs))
        requests[case] = (ids, blobs, output_byte_sizes(dep, ids, blobs)["IMAGE_EMBEDS"])
    return requests


class Reference:
    """The checkpoint processor's semantics on the CPU, then transformers' vision tower + projector
    (SDPA, bf16) on the GPU, with the weights of the checkpoint the server serves."""

    def __init__(self, checkpoint: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
        from transformers.models import kimi_k25

        from oracles.transformers_kimi import hf_config_from, load_checkpoint_into_hf

        cfg = load_config(checkpoint)
        self.media, self.device, self.dtype = cfg.media, torch.device(device), dtype
        torch.manual_seed(0)
        model = kimi_k25.Kimi_K25Model(hf_config_from(cfg.encoder, attn="sdpa")).eval()
        load_checkpoint_into_hf(model, checkpoint)
        self.model = model.to(self.device, dtype)

    def __call__(self, images: list[bytes]) -> torch.Tensor:
        """(tokens, text_hidden) in `dtype` on `device`, computed when this returns."""
        patches, grids = [], []
        for blob in images:
            pixels, grid = reference_pixels(blob, self.media)
            patches.append(pixels)
            grids.append(grid)
        pixels = torch.from_numpy(np.concatenate(patches)).to(self.device, self.dtype)
        with torch.inference_mode():
            per_image = self.model.get_image_features(pixels, image_grid_thw=torch.tensor(grids, device=self.device))
        embeds = torch.cat(list(per_image.pooler_output))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return embeds


def max_rel_diff(got: torch.Tensor, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref|, in float64 on the host."""
    ref_t = torch.from_numpy(ref).double()
    return float((got.double().cpu() - ref_t).abs().max() / ref_t.abs().max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", type=Path, default=Path("lab/out"))
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    # Each path sends the same images again and again: the embedding cache off, so that every call runs
    # the encoder as a first sending does (the cache's own figures: lab/bench/multiturn.py).
    dep = Deployment(device="gpu", checkpoint=args.checkpoint, cache_bytes=0)
    requests = case_requests(dep)

    notes = []
    try:
        reference = Reference(args.checkpoint)
    except Exception as exc:  # noqa: BLE001 - transformers without Kimi_K25, or an API it changed
        reference = None
        notes.append(f"(d) not run: could not build transformers' Kimi_K25 reference: {type(exc).__name__}: {exc}")
        print(notes[-1])

    results, rows = {}, []
    server = deployment_server(dep, "e2e")
    with server:
        client = KimiVisionClient(server.grpc_url)
        bits = KimiVisionClient(server.grpc_url, embeds_dtype="bf16")
        try:  # tritonclient's HTTP half needs gevent, which a slim install may lack: the gRPC rows still run
            http = KimiVisionClient(server.http_url, protocol="http", embeds_dtype="bf16")
        except Exception as exc:  # noqa: BLE001
            http = None
            notes.append(f"(http) not run: {type(exc).__name__}: {first_line(exc)}")
            print(notes[-1])
        try:
            registered = CudaOutputRegion(client, max(nbytes for *_, nbytes in requests.values()))
        except Exception as exc:  # noqa: BLE001
            registered = None
            notes.append(f"(c) not run: {type(exc).__name__}: {exc}")
            print(notes[-1])
        puller = nixl_buffer = None
        try:
            from clients.nixl_pull import NixlPuller

            puller = NixlPuller()
            nixl_buffer = torch.empty(max(nbytes for *_, nbytes in requests.values()), dtype=torch.uint8, device="cuda")
            puller.register(nixl_buffer)
        except Exception as exc:  # noqa: BLE001 - NIXL not installed: the other rows still run
            puller = None
            notes.append(f"(e) not run: {type(exc).__name__}: {exc}")
            print(notes[-1])
        for case, (ids, blobs, nbytes) in requests.items():
            first = np.array(client.infer(ids, blobs).image_embeds)  # what every path is compared with (a copy)
            # Each path returns its embeddings: a host array (a), a GPU tensor (b, c, d).
            paths = {"grpc": lambda: client.infer(ids, blobs).image_embeds,
                     "grpc_bf16": lambda: bits.infer(ids, blobs).embeds_torch(),
                     "system_shm": lambda: client.infer(ids, blobs, shm="system", output_capacity=nbytes).image_embeds,
                     "cuda_shm_per_call": lambda: client.infer(ids, blobs, shm="cuda", output_capacity=nbytes).cuda_embeds}
            if http:
                paths["http_bf16"] = lambda: http.infer(ids, blobs).embeds_torch()
            if registered:
                paths["cuda_shm_registered"] = lambda: client.infer_into(registered, ids, blobs).cuda_embeds
            if puller:
                paths["nixl_pull"] = lambda: puller.pull(client.infer(ids, blobs, nixl=True), nixl_buffer)
            if reference:
                paths["reference"] = lambda: reference(blobs)
            results[case] = {"embeds_shape": list(first.shape), "embeds_bytes": nbytes}
            for key, path in paths.items():
                try:
                    got = path()
                    got = (torch.from_numpy(np.array(got)) if isinstance(got, np.ndarray) else got).float().cpu()
                    if key == "reference":  # another implementation: bf16 arithmetic differs
                        check = f"max rel diff {max_rel_diff(got, first):.1e}"
                    elif torch.equal(got, torch.from_numpy(first)):
                        check = "equal"
                    else:
                        check = f"DIFFERENT (max rel diff {max_rel_diff(got, first):.1e})"
                    times = timed(path, args.iters)
                except Exception as exc:  # noqa: BLE001 - one failing path must not cost the others
                    traceback.print_exc()
                    results[case][key] = {"error": f"{type(exc).__name__}: {exc}"}
                    rows.append((case, key, None, None, f"failed: {type(exc).__name__}: {str(exc)[:120]}"))
                    continue
                results[case][key] = {"median_ms": statistics.median(times), "min_ms": min(times),
                                      "times_ms": times, "output_vs_first_a": check}
                rows.append((case, key, statistics.median(times), min(times), check))
            torch.cuda.empty_cache()
        if registered:
            registered.close()
        if puller:
            puller.close()
        for c in (client, bits, http):
            if c:
                c.close()

    lines = ["# End to end: JPEG bytes to image embeddings, tritonserver (GPU deployment) vs in-process reference\n",
             f"{machine_line()}\n",
             f"checkpoint {args.checkpoint}; {args.iters} runs per row after 2 warm-ups, wall clock with "
             "torch.cuda.synchronize() around each run; client and server on this machine, gRPC over loopback.\n",
             "| case | implementation | median ms | min ms | speed-up vs (d) | output vs a first (a) call | embeddings end in |",
             "|---|---|---|---|---|---|---|"]
    for case, key, median, low, check in rows:
        label, ends_in, _ = IMPLEMENTATIONS[key]
        ref = results[case].get("reference", {}).get("median_ms")
        speedup = f"{ref / median:.2f}x" if (ref and median) else "n/a"
        timing = f"{median:.1f} | {low:.1f}" if median is not None else "- | -"
        lines.append(f"| {case} | {label} | {timing} | {speedup} | {check} | {ends_in} |")
        if median is not None:
            results[case][key]["speedup_vs_reference"] = (ref / median) if ref else None
    for case in requests:  # the NIXL pull against the registered CUDA region (target: within 1.2x)
        nixl, region = (results[case].get(k, {}).get("median_ms") for k in ("nixl_pull", "cuda_shm_registered"))
        if nixl and region:
            results[case]["nixl_vs_registered_region"] = nixl / region
            lines.append(f"\n{case}: (e) NIXL pull / (c) registered CUDA region = {nixl / region:.2f}x (median)")
    lines.append("\nWhat each end to end contains (all start from the encoded JPEG bytes in the client):")
    lines += [f"- {label}: {contains}" for label, _, contains in IMPLEMENTATIONS.values()]
    lines += [f"\n{note}" for note in notes]
    write_report(args.out, "e2e_bench", lines, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
