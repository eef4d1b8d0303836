"""The model repository's single source of truth: every config.pbtxt is rendered from `Deployment`.

The CPU and GPU deployments differ only in settings derived here (instance kind, tensor dtypes, GPU
input placement), never in hand-copied files. `model_repository/` in git holds the model.py adapters
plus the CPU rendering of the embedded default (so the configs can be read and diffed); servers run
from a fresh rendering under build/ (`python -m backends.deploy.repository --help`).
"""

from __future__ import annotations

import argparse
import functools
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from backends import topology
from backends.cache.keys import KEY_BYTES
from backends.checkpoint import load_config
from backends.config import Limits, VisionConfig
from backends.serving.settings import ModelSettings
from contract import (BATCHED_ENSEMBLE, ENCODER, ENCODER_FOLLOWS, ENSEMBLE, EXPANDED_IDS, FORWARD_SUFFIX, GRID_THWS, IMAGE_EMBEDS,
                      IMAGE_EMBEDS_NIXL, IMAGE_TOKEN_COUNTS, IMAGES, INPUT_IDS, MEDIA_CACHED, MEDIA_FRAMES, MEDIA_KEYS, PIXEL_VALUES,
                      PLACEHOLDER, PREPROCESS)

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE_REPOSITORY = REPO_ROOT / "model_repository"
# Every model the repository holds (backends/topology.py), and whose version folder each twin copies:
# a batching twin runs its base model's model.py; the batched ensemble's folder holds what the plain one's does.
MODELS = topology.MODELS
SOURCE_OF = {**topology.TWINS, BATCHED_ENSEMBLE: ENSEMBLE}


# What an HTTP request carries besides its IMAGES bytes, for the HTTP front end's size limit: the prompt's
# ids (8 bytes each: 64 MiB is 8 M of them), MEDIA_FRAMES, the 4-byte length of each IMAGES entry and
# the JSON header.
HTTP_INPUT_SLACK_BYTES = 64 << 20

# The embedding cache's default budget per encoder instance: a few hundred 1024^2 images' rows of the
# real model on a GPU (19.6 MB each in BF16), host memory on CPU.
CACHE_DEFAULT_BYTES = {"gpu": 4 << 30, "cpu": 1 << 30}
# The NIXL arena's default per encoder instance, taken only once a client asks for a descriptor: on a GPU,
# about fifty 1024^2 requests' rows of the real model (19.6 MB each in BF16) unread at once, or two at
# max_patches (448 MiB each).
NIXL_DEFAULT_BYTES = {"gpu": 1 << 30, "cpu": 256 << 20}


@dataclass(frozen=True)
class Deployment:
    device: str = "cpu"  # "cpu" or "gpu"
    checkpoint: str = ""  # empty: the embedded demo model
    limits: Limits = field(default_factory=Limits)
    gpus: int = 1  # GPU deployment: GPUs 0..gpus-1 as this process sees them (CUDA_VISIBLE_DEVICES applies)
    encoder_instances: int = 1  # per GPU (GPU deployment) or in all (CPU)
    # 0: 1 on CPU, 2 per GPU, so that one request's preprocessing overlaps another's encoder forward.
    preprocess_instances: int = 0
    max_batch: int = 8  # requests per dynamic batch (composing models and the batched ensemble)
    # How long moonvit3d's batcher waits for more requests. 0: no window; requests that queue while the
    # encoder is busy are still batched, and nobody pays for waiting when there is nothing to batch.
    batch_delay_us: int = 0
    max_queue: int = 16  # requests waiting for moonvit3d; beyond, refused
    cuda_graphs: int = 16  # encoder CUDA graphs kept per instance (per exact grid list; 0 = off; GPU only)
    # The embedding cache's budget per encoder instance (backends/cache), in its memory (GPU memory on a
    # GPU); None: CACHE_DEFAULT_BYTES for the device; 0: off.
    cache_bytes: int | None = None
    # The NIXL arena per encoder instance (backends/nixl_export); None: NIXL_DEFAULT_BYTES for the device;
    # 0: no descriptors. A descriptor's rows wait unread at most nixl_lifetime_ms.
    nixl_bytes: int | None = None
    nixl_lifetime_ms: int = 30_000

    def __post_init__(self):
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {self.device!r}")
        if self.preprocess_instances == 0:
            object.__setattr__(self, "preprocess_instances", 2 if self.device == "gpu" else 1)
        if self.cache_bytes is None:
            object.__setattr__(self, "cache_bytes", CACHE_DEFAULT_BYTES[self.device])
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be 0 (off) or more, got {self.cache_bytes}")
        if self.nixl_bytes is None:
            object.__setattr__(self, "nixl_bytes", NIXL_DEFAULT_BYTES[self.device])
        if self.nixl_bytes < 0 or self.nixl_lifetime_ms < 1:
            raise ValueError(f"nixl_bytes must be 0 (off) or more and nixl_lifetime_ms at least 1, got "
                             f"{self.nixl_bytes}, {self.nixl_lifetime_ms}")
        if self.gpus < 1 or self.encoder_instances < 1 or self.preprocess_instances < 1:
            raise ValueError(f"gpus and instance counts must be at least 1, got gpus={self.gpus}, "
                             f"encoder_instances={self.encoder_instances}, preprocess_instances={self.preprocess_instances}")

    def instance_group(self, kind: str, count: int) -> list[dict]:
        """CPU: `count` instances. GPU: `count` instances on each GPU, each group pinned to its device."""
        if kind == "KIND_GPU":
            return [{"kind": kind, "count": count, "gpus": [gpu]} for gpu in range(self.gpus)]
        return [{"kind": kind, "count": count}]

    def cuda_pools(self) -> dict[int, int]:
        """GPU id -> Triton CUDA pool bytes (every GPU holds tensors between steps); empty on CPU."""
        size = self.cuda_pool_bytes()
        return {gpu: size for gpu in range(self.gpus)} if size else {}

    @functools.cached_property
    def vision(self) -> VisionConfig:
        """The checkpoint's config, read once; rendered into every model's parameters."""
        return load_config(self.checkpoint)

    @property
    def float_type(self) -> str:
        """Pixels and embeddings: FP32 on CPU, BF16 on GPU."""
        return "TYPE_BF16" if self.device == "gpu" else "TYPE_FP32"

    @property
    def kind(self) -> str:
        return "KIND_GPU" if self.device == "gpu" else "KIND_CPU"

    def cuda_pool_bytes(self) -> int | None:
        """Triton's CUDA pool holds the tensors between steps; too small a pool silently hands the
        next step zeros (docs/triton_runtime.md#gpu-tensors-between-steps). Sized for the worst case the limits
        allow (BF16 pixels and embeddings of `max_patches`) times the requests that can hold such
        tensors at once: a full batch per encoder instance, moonvit3d's bounded queue, and one
        request per preprocessing instance. Per GPU: a request's tensors stay on the GPU that
        preprocessed it, and in the worst case the whole queue waits on one GPU."""
        if self.device != "gpu":
            return None
        pixels, embeds = self._largest_tensors_bytes(2)  # BF16
        grids = self.limits.max_images * 3 * 8
        in_flight = self.encoder_instances * self.max_batch + self.max_queue + self.preprocess_instances
        return in_flight * (pixels + embeds + grids)

    def _largest_tensors_bytes(self, bytes_per_value: int) -> tuple[int, int]:
        """Bytes of one request's PIXEL_VALUES and IMAGE_EMBEDS at `max_patches`."""
        enc = self.vision.encoder
        pixels = self.limits.max_patches * 3 * enc.patch_size**2 * bytes_per_value
        embeds = self.limits.max_patches // enc.merge_tokens * enc.text_hidden_size * bytes_per_value
        return pixels, embeds

    def http_max_input_bytes(self) -> int:
        """The HTTP front end's limit on one request's inputs (--http-max-input-size, where the server has
        it): the most IMAGES bytes the limits let through, plus the rest of a request."""
        return self.limits.max_request_bytes + HTTP_INPUT_SLACK_BYTES

    def images_shm_bytes(self) -> int:
        """The most encoded image bytes the Python backend's regions can come to hold under the limits,
        on a CPU or a GPU deployment alike (BYTES inputs always pass through them): tritonserver copies a
        request's IMAGES into its preprocessing instance's region, whose next request's are copied in
        before the last one's are let go (two requests' worth, measured), and into moonvit3d's, which
        takes a full batch of requests (the ensemble hands it IMAGES for the media its cache lost)."""
        per_gpu = 2 * self.preprocess_instances + self.encoder_instances * self.max_batch
        return per_gpu * (self.gpus if self.device == "gpu" else 1) * self.limits.max_request_bytes

    def shm_ceiling_bytes(self) -> int:
        """The most /dev/shm the Python backend can come to hold under the limits.

        Every tensor a CPU deployment passes between steps goes through the Python backend's
        shared-memory regions, which grow to the largest exchange and never shrink in tritonserver
        2.51 (docs/triton_runtime.md#known-server-limitations). Bound: each preprocessing instance's
        largest PIXEL_VALUES, and moonvit3d taking a full batch of such requests plus their
        embeddings. The limits enforce it; a GPU deployment passes the tensors between steps on the
        GPU, so its regions hold a few MiB (0 here). Encoded image bytes come on top (images_shm_bytes)."""
        if self.device == "gpu":
            return 0
        pixels, embeds = self._largest_tensors_bytes(4)  # FP32
        return self.preprocess_instances * pixels + self.encoder_instances * self.max_batch * (pixels + embeds)


def _tensor(name, dtype, dims, optional=False):
    t = {"name": name, "data_type": dtype, "dims": dims}
    if optional:
        t["optional"] = True
    return t


def _ragged(tensors):
    # Requests of different sizes may share a batch; the Python models receive them as a list and
    # never need them concatenated by Triton.
    return [{**t, "allow_ragged_batch": True} for t in tensors]


# Optional everywhere: absent means every IMAGES entry is a still image; else one entry per media,
# 0 for an image and t (1..4) for a video chunk of t consecutive IMAGES entries.
MEDIA_FRAMES_SPEC = _tensor(MEDIA_FRAMES, "TYPE_INT64", [-1], optional=True)


def _python_model(dep: Deployment, name: str, inputs, outputs, *, kind: str, count: int, max_batch: int) -> dict:
    """One Python-backend model; `count` instances (per GPU for KIND_GPU)."""
    # The encoder keeps CUDA graphs on a GPU (backends/encoder/graphs.py).
    graphs = dep.cuda_graphs if name == ENCODER and dep.device == "gpu" else 0
    params = {
        **ModelSettings(checkpoint=dep.checkpoint, limits=dep.limits, cuda_graphs=graphs, cache_bytes=dep.cache_bytes,
                        nixl_bytes=dep.nixl_bytes, nixl_lifetime_ms=dep.nixl_lifetime_ms, vision=dep.vision).parameters(),
        # Triton's own: GPU instances take their inputs where the previous step left them (no host round-trip).
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no" if kind == "KIND_GPU" else "yes",
    }
    return {
        "name": name,
        "backend": "python",
        "max_batch_size": max_batch,
        "input": _ragged(inputs) if max_batch else inputs,
        "output": outputs,
        "instance_group": dep.instance_group(kind, count),
        "parameters": {k: {"string_value": v} for k, v in params.items()},
    }


def _io(dep: Deployment) -> dict[str, tuple[list, list]]:
    """Each step's inputs and outputs, and the contract's (the ensembles'), for `dep`'s dtypes and sizes."""
    p = dep.vision.encoder.patch_size
    hidden = dep.vision.encoder.text_hidden_size
    fp = dep.float_type
    counts, grids = IMAGE_TOKEN_COUNTS, GRID_THWS
    return {
        PLACEHOLDER: (
            # IMAGES or IMAGE_TOKEN_COUNTS: the ensemble sends the counts kimi_preprocess found; a direct
            # caller may send the images instead (their headers are read).
            [_tensor(INPUT_IDS, "TYPE_INT64", [-1]), _tensor(IMAGES, "TYPE_STRING", [-1], optional=True),
             MEDIA_FRAMES_SPEC, _tensor(counts, "TYPE_INT64", [-1], optional=True)],
            [_tensor(EXPANDED_IDS, "TYPE_INT64", [-1]), _tensor(counts, "TYPE_INT64", [-1])],
        ),
        PREPROCESS: (
            [_tensor(IMAGES, "TYPE_STRING", [-1]), MEDIA_FRAMES_SPEC,
             # Optional: the prompt, checked for the 1:1 rule before any image is read (the ensemble sends it).
             _tensor(INPUT_IDS, "TYPE_INT64", [-1], optional=True),
             # Optional: the prompt again, sent by the ensembles alone: an encoder with a cache follows.
             _tensor(ENCODER_FOLLOWS, "TYPE_INT64", [-1], optional=True),
             # Optional: counts a direct caller already has, cross-checked.
             _tensor(counts, "TYPE_INT64", [-1], optional=True)],
            [_tensor(PIXEL_VALUES, fp, [-1, 3, p, p]), _tensor(grids, "TYPE_INT64", [-1, 3]),
             _tensor(grids + FORWARD_SUFFIX, "TYPE_INT64", [-1, 3]), _tensor(counts, "TYPE_INT64", [-1]),
             _tensor(counts + FORWARD_SUFFIX, "TYPE_INT64", [-1]),
             _tensor(MEDIA_KEYS, "TYPE_UINT8", [-1, KEY_BYTES]), _tensor(MEDIA_CACHED, "TYPE_BOOL", [-1])],
        ),
        ENCODER: (
            [_tensor(PIXEL_VALUES, fp, [-1, 3, p, p]), _tensor(GRID_THWS, "TYPE_INT64", [-1, 3]),
             # The embedding cache: optional, so that a direct caller may send pixels and grids alone.
             _tensor(MEDIA_KEYS, "TYPE_UINT8", [-1, KEY_BYTES], optional=True),
             _tensor(MEDIA_CACHED, "TYPE_BOOL", [-1], optional=True),
             _tensor(IMAGES, "TYPE_STRING", [-1], optional=True), MEDIA_FRAMES_SPEC],
            # IMAGE_EMBEDS, or with the request parameter contract.NIXL_PARAMETER the descriptor alone.
            [_tensor(IMAGE_EMBEDS, fp, [-1, hidden]), _tensor(IMAGE_EMBEDS_NIXL, "TYPE_UINT8", [-1])],
        ),
        "contract": (
            [_tensor(INPUT_IDS, "TYPE_INT64", [-1]), _tensor(IMAGES, "TYPE_STRING", [-1]), MEDIA_FRAMES_SPEC],
            [_tensor(EXPANDED_IDS, "TYPE_INT64", [-1]), _tensor(IMAGE_EMBEDS, fp, [-1, hidden]),
             _tensor(GRID_THWS, "TYPE_INT64", [-1, 3]), _tensor(IMAGE_TOKEN_COUNTS, "TYPE_INT64", [-1]),
             _tensor(IMAGE_EMBEDS_NIXL, "TYPE_UINT8", [-1])],
        ),
    }


def _placement(dep: Deployment, base: str) -> tuple[str, int]:
    """(instance kind, instances) of a step: the id expansion is host arithmetic (one CPU instance);
    preprocessing and the encoder run where the deployment computes."""
    if base == PLACEHOLDER:
        return "KIND_CPU", 1
    return dep.kind, dep.preprocess_instances if base == PREPROCESS else dep.encoder_instances


def model_configs(dep: Deployment) -> dict[str, mc.ModelConfig]:
    """name -> ModelConfig for every model of one deployment (backends/topology.py names them)."""
    io = _io(dep)
    dicts = {}
    for name in topology.PYTHON_MODELS:
        base = topology.base_model(name)
        kind, count = _placement(dep, base)
        dicts[name] = _python_model(dep, name, *io[base], kind=kind, count=count,
                                    max_batch=dep.max_batch if topology.batching(name) else 0)
    # The encoder's dynamic batcher: its batching window and its bounded queue. The queue is bounded so
    # that the CUDA pool (sized from it) can never run short under load: an overloaded server refuses
    # requests ("Exceeds maximum queue size") instead of computing on zeros.
    dicts[ENCODER]["dynamic_batching"] = {"max_queue_delay_microseconds": dep.batch_delay_us,
                                          "default_queue_policy": {"max_queue_size": dep.max_queue}}
    for ensemble in topology.ENSEMBLES:
        dicts[ensemble.name] = {
            "name": ensemble.name,
            "platform": "ensemble",
            "max_batch_size": dep.max_batch if ensemble.batched else 0,
            "input": io["contract"][0],
            "output": io["contract"][1],
            "ensemble_scheduling": {"step": ensemble.steps()},
        }
    return {name: json_format.ParseDict(d, mc.ModelConfig()) for name, d in dicts.items()}


def render_config(config: mc.ModelConfig) -> str:
    header = "# Rendered by backends/deploy/repository.py from one Deployment; edit that file, not this one.\n"
    return header + text_format.MessageToString(config)


def render_repository(dep: Deployment, out: Path, *, clean: bool = True) -> Path:
    """Write a complete, loadable model repository for `dep` to `out` (model.py files copied).

    Writable by its owner only (the server's user), whatever the umask: the server runs the model.py
    files it finds there."""
    out = Path(out)
    if clean and out.exists():
        shutil.rmtree(out)
    for name, config in model_configs(dep).items():
        version = out / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        (out / name / "config.pbtxt").write_text(render_config(config))
        for src in (SOURCE_REPOSITORY / name / "1").iterdir():
            if src.is_file():
                shutil.copy2(src, version / src.name)
    for path in [out, *out.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return out


# The committed rendering: the CPU deployment of the embedded default.
SOURCE_DEPLOYMENT = Deployment()


def write_source_configs() -> None:
    """Refresh the committed CPU configs of the embedded default in model_repository/."""
    for name, config in model_configs(SOURCE_DEPLOYMENT).items():
        (SOURCE_REPOSITORY / name).mkdir(exist_ok=True)
        (SOURCE_REPOSITORY / name / "config.pbtxt").write_text(render_config(config))
    for twin, base in SOURCE_OF.items():
        (SOURCE_REPOSITORY / twin / "1").mkdir(parents=True, exist_ok=True)
        for src in (SOURCE_REPOSITORY / base / "1").iterdir():
            if src.is_file():
                shutil.copy2(src, SOURCE_REPOSITORY / twin / "1" / src.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--checkpoint", default="")
    ap.add_argument("--out", type=Path, help="render a full repository here")
    ap.add_argument("--write-source", action="store_true", help="refresh model_repository/*/config.pbtxt")
    args = ap.parse_args(argv)
    if args.write_source:
        write_source_configs()
    if args.out:
        print(render_repository(Deployment(device=args.device, checkpoint=args.checkpoint), args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
