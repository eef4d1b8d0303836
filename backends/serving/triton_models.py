"""Thin Triton Python-backend adapters. Imported only inside tritonserver's Python stub.

Each adapter: read settings from the model config, build its step once in `initialize`, and in
`execute` return exactly one response per request - an error response for a bad request, so the
rest of the batch is unaffected. Device tensors cross the boundary through DLPack (zero-copy);
host numpy arrays, and empty tensors (whose DLPack export fails in the 2.51 stub), through numpy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import traceback

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack

from backends.cache import keys as cache_keys
from backends.cache.index import SHM, KeyTable, KeyTables, server_prefix
from backends.cache.store import EmbeddingCache
from backends.errors import RequestCancelled, RequestError
from backends.nixl_export.arena import NixlExport, nixl_requested
from backends.preprocess.media import largest_media_patches, split_media
from backends.serving import bytes_inputs
from backends.serving.metrics import ModelMetrics, allocator_gauges
from backends.serving.profiling import ExecuteProfiler
from backends.serving.settings import ModelSettings
from backends.serving.steps import EncoderRequest, EncoderStep, PlaceholderStep, PreprocessStep, throttled
from contract import (DEADLINE_PARAMETER, ENCODER_FOLLOWS, FORWARD_SUFFIX, GRID_THWS, IMAGE_EMBEDS, IMAGE_EMBEDS_NIXL,
                      IMAGE_TOKEN_COUNTS, IMAGES, INPUT_IDS, MEDIA_CACHED, MEDIA_FRAMES, MEDIA_KEYS, PIXEL_VALUES)

log = logging.getLogger("kimi_vision")

# How often preprocessing asks whether its request was cancelled (each question is an IPC round trip).
CANCEL_CHECK_S = 0.02

_NUMPY_EMPTY = {torch.float32: np.float32, torch.int64: np.int64, torch.float16: np.float16}


def _settings(args: dict) -> tuple[ModelSettings, dict]:
    config = json.loads(args["model_config"])
    params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    device = "cpu"
    if args.get("model_instance_kind") == "GPU":
        device = f"cuda:{args['model_instance_device_id']}"
    return ModelSettings.from_parameters(params, device=device), config


def _bytes_list(tensor) -> list[bytes]:
    array = tensor.as_numpy()
    if bytes_inputs.refusal(array) is not None:  # over a byte limit: the stub copied none of it (bytes_inputs.py)
        # Raised as made, never held in a local of this frame, which holds the input: the cycle would keep
        # the input's shared memory until Python's cycle collector runs.
        raise bytes_inputs.refusal(array)
    return [bytes(x) for x in array.reshape(-1)]


def _to_torch(tensor) -> torch.Tensor:
    shape = tuple(tensor.shape())
    if 0 in shape:  # an empty tensor has no pointer to share; its dtype is fixed by the consumer
        return torch.empty(shape)
    return from_dlpack(tensor.to_dlpack())


class _Inputs:
    """One request's inputs without the batch dimension.

    The plain ensemble sends tensors as the contract declares them; the batched ensemble puts a batch
    dimension of 1 in front (Triton batches requests, never rows of one request). `batched` says which,
    so the outputs can be shaped to match.
    """

    def __init__(self, request, probe: str, rank: int):
        self.request = request
        shape = list(pb_utils.get_input_tensor_by_name(request, probe).shape())
        if len(shape) == rank + 1 and shape[0] == 1:
            self.batched = True
        elif len(shape) == rank:
            self.batched = False
        else:
            raise RequestError(f"{probe} has shape {shape}: expected {rank} dimension(s), or a batch dimension of 1 "
                               f"in front of them (one prompt per request)", "bad_tensor")

    def _get(self, name):
        return pb_utils.get_input_tensor_by_name(self.request, name)

    def gave_up(self, ask_server):
        """Whether the client stopped waiting: its deadline parameter (contract.DEADLINE_PARAMETER, read once)
        has passed, or `ask_server()` (the request's is_cancelled, an IPC round trip) says it cancelled."""
        deadline = _deadline_ms(self.request)

        def check() -> bool:
            if deadline is not None and time.time() * 1000 > deadline:
                return True
            return bool(ask_server())

        return check

    def numpy(self, name: str, optional: bool = False):
        tensor = self._get(name)
        if tensor is None:
            if optional:
                return None
            raise RequestError(f"missing input {name}", "bad_tensor")
        # A GPU instance may receive small tensors in device memory (client CUDA shm, the previous step).
        array = tensor.as_numpy() if tensor.is_cpu() else from_dlpack(tensor.to_dlpack()).cpu().numpy()
        return array[0] if self.batched else array

    def bytes_list(self, name: str, optional: bool = False) -> list[bytes] | None:
        tensor = self._get(name)
        if tensor is None:
            if optional:
                return None
            raise RequestError(f"missing input {name}", "bad_tensor")
        return _bytes_list(tensor)

    def torch(self, name: str) -> torch.Tensor:
        t = _to_torch(self._get(name))
        return t[0] if self.batched else t

    def shape_outputs(self, outputs: dict) -> dict:
        if not self.batched:
            return outputs
        return {k: (v[None] if isinstance(v, np.ndarray) else v.unsqueeze(0)) for k, v in outputs.items()}


def _parameters(request) -> dict:
    """The request's parameters ({} if it has none or unreadable ones)."""
    try:
        params = json.loads(request.parameters() or "{}")
    except (ValueError, TypeError, AttributeError):
        return {}
    return params if isinstance(params, dict) else {}


def _deadline_ms(request) -> float | None:
    """The request's deadline parameter (contract.DEADLINE_PARAMETER), None if it has none or an unreadable one."""
    try:
        value = _parameters(request).get(DEADLINE_PARAMETER)
        return float(value) if value is not None else None
    except (ValueError, TypeError):
        return None


def _output(name: str, value) -> "pb_utils.Tensor":
    if isinstance(value, np.ndarray):
        # The stub's own numpy path (numpy < 2 is enforced by backends.deploy.stub_env), without a
        # detour through torch and DLPack for small host arrays.
        return pb_utils.Tensor(name, np.ascontiguousarray(value))
    value = value.contiguous()
    if value.numel() == 0:
        # Empty tensors have no device pointer to export; numpy where it has the dtype, else an empty
        # host tensor through DLPack (bfloat16).
        if value.dtype in _NUMPY_EMPTY:
            return pb_utils.Tensor(name, np.zeros(tuple(value.shape), dtype=_NUMPY_EMPTY[value.dtype]))
        value = torch.empty(tuple(value.shape), dtype=value.dtype)
    return pb_utils.Tensor.from_dlpack(name, to_dlpack(value))


def _error(exc: Exception, model: str) -> "pb_utils.InferenceResponse":
    if isinstance(exc, RequestError):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG))
    if isinstance(exc, RequestCancelled):
        code = getattr(pb_utils.TritonError, "CANCELLED", pb_utils.TritonError.UNAVAILABLE)
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), code))
    log.error("%s: internal error\n%s", model, "".join(traceback.format_exception(exc)))
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(f"internal error: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)
    )


def _stub_logging() -> None:
    """Our INFO lines (start-up facts: what was captured, which decoder, a missing fast kernel) to the stub's
    stderr, which tritonserver's log holds; the stub configures no Python logging of its own."""
    for name in ("kimi_vision", "backends"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)


class _Adapter:
    name = "model"

    def initialize(self, args):
        _stub_logging()
        self.settings, self.config = _settings(args)
        if self.settings.device.startswith("cuda"):
            # Triton kernels launch on the current device: make it this instance's GPU.
            torch.cuda.set_device(torch.device(self.settings.device))
        self.name = args.get("model_name", self.name)  # twins (…_batched) share the class
        self.instance_name = args.get("model_instance_name", self.name)
        memory = self._cuda_memory if self.settings.device.startswith("cuda") else None
        self.metrics = ModelMetrics(pb_utils, self.name, instance=args.get("model_instance_name", ""), memory=memory)
        self.profiler = ExecuteProfiler(self.name)
        if any(i["name"] == IMAGES for i in self.config["input"]):
            # IMAGES over the byte limits is refused before the stub copies it (bytes_inputs.py).
            if not bytes_inputs.install(pb_utils, self.settings.limits):
                log.warning("%s: this Python backend has no deserialize_bytes_tensor; IMAGES over the byte limits "
                            "are copied before they are refused", self.name)
        first = self.config["input"][0]  # tells a batched request from a plain one by its rank
        self.probe = (first["name"], len(first["dims"]))
        # Outputs the repository declares twice, the copy for the next step (contract.FORWARD_SUFFIX).
        self.forwarded = [o["name"][: -len(FORWARD_SUFFIX)] for o in self.config["output"]
                          if o["name"].endswith(FORWARD_SUFFIX)]
        self.setup()

    def _cuda_memory(self) -> dict[str, float]:
        """The allocator's gauges, and what our bounded caches hold where the step has any (the sender
        thread calls this; the step may not exist yet)."""
        out = allocator_gauges(torch.cuda.memory_stats_as_nested_dict(torch.device(self.settings.device)))
        cached = getattr(getattr(self, "step", None), "cached_bytes", None)
        if cached is not None:
            out["cached"] = float(cached())
        return out

    def inputs(self, request) -> _Inputs:
        return _Inputs(request, *self.probe)

    def setup(self):
        raise NotImplementedError

    def respond(self, inputs: _Inputs) -> dict:
        raise NotImplementedError

    def execute(self, requests):
        with self.profiler():
            return self._execute(requests)

    def _execute(self, requests):
        responses = []
        for request in requests:
            t0 = time.perf_counter()
            try:
                inputs = self.inputs(request)
                outputs = self.respond(inputs)
                responses.append(self.response(inputs, outputs))
            except Exception as exc:  # noqa: BLE001 - one response per request, always
                responses.append(self.error_response(exc))
            self.metrics.step_time(time.perf_counter() - t0)
        return responses

    def response(self, inputs: _Inputs, outputs: dict):
        """The request's answer: its outputs shaped as it sent its inputs, with the copies the next step reads."""
        outputs = inputs.shape_outputs(outputs)
        outputs.update({name + FORWARD_SUFFIX: outputs[name] for name in self.forwarded})
        return pb_utils.InferenceResponse(output_tensors=[_output(k, v) for k, v in outputs.items()])

    def finalize(self):
        profiler = getattr(self, "profiler", None)  # None if initialize failed before making it
        if profiler is not None:
            profiler.close()  # a profiling window still open when the model unloads is written now
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()  # counts not yet sent

    def error_response(self, exc: Exception):
        self.metrics.failure(exc)
        return _error(exc, self.name)


class PlaceholderModel(_Adapter):
    name = "kimi_placeholder"

    def setup(self):
        self.step = PlaceholderStep(self.settings.vision, self.settings.limits)

    def respond(self, inputs: _Inputs):
        return self.step(inputs.numpy(INPUT_IDS), inputs.bytes_list(IMAGES, optional=True),
                         inputs.numpy(MEDIA_FRAMES, optional=True),
                         token_counts=inputs.numpy(IMAGE_TOKEN_COUNTS, optional=True))


def _out_dtype(config: dict, tensor: str) -> torch.dtype:
    for out in config["output"]:
        if out["name"] == tensor:
            return {"TYPE_FP32": torch.float32, "TYPE_BF16": torch.bfloat16, "TYPE_FP16": torch.float16}[out["data_type"]]
    raise KeyError(tensor)


@contextlib.contextmanager
def _decodes_counted(metrics: ModelMetrics, pre):
    """Counts the images `pre` (a Preprocessor) decodes inside the block, by path and reason, also when
    the block raises (a request that fails after some of its images were decoded)."""
    before = dict(pre.decode_stats)
    try:
        yield
    finally:
        after = pre.decode_stats
        metrics.decodes({k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)})


def _cache_context(settings: ModelSettings, dtype: torch.dtype) -> bytes | None:
    """The part of every media's cache key this deployment shares (None: the cache is off)."""
    if settings.cache_bytes <= 0:
        return None
    from backends.checkpoint import identity

    return cache_keys.context(identity(settings.checkpoint), settings.vision.to_json(), str(dtype))


class PreprocessModel(_Adapter):
    name = "kimi_preprocess"

    def setup(self):
        dtype = _out_dtype(self.config, PIXEL_VALUES)
        context = _cache_context(self.settings, dtype)
        prefix = server_prefix() if context is not None else None
        # Which media the encoders hold, so that those are not decoded (a hint: backends/cache/index.py).
        held = KeyTables(prefix).held if prefix else None
        self.step = PreprocessStep(self.settings.vision, self.settings.limits, device=self.settings.device,
                                   out_dtype=dtype, cache_context=context, held=held)
        log.info("%s: %s", self.name, self.step.prepare())

    def respond(self, inputs: _Inputs):
        images = inputs.bytes_list(IMAGES)
        counts, frames = inputs.numpy(IMAGE_TOKEN_COUNTS, optional=True), inputs.numpy(MEDIA_FRAMES, optional=True)
        input_ids = inputs.numpy(INPUT_IDS, optional=True)
        encoder_follows = inputs.numpy(ENCODER_FOLLOWS, optional=True) is not None
        with _decodes_counted(self.metrics, self.step.pre):
            # Checked between media, at most every CANCEL_CHECK_S: a client that gave up (deadline,
            # cancel) stops the rest of the work. Only when kimi_preprocess is called directly: inside
            # an ensemble a running step is not told (docs/triton_runtime.md#known-server-limitations).
            out = self.step(images, counts, frames, cancelled=inputs.gave_up(throttled(inputs.request.is_cancelled, CANCEL_CHECK_S)),
                            input_ids=input_ids, encoder_follows=encoder_follows)
        self.metrics.preprocessed(len(images), int(out[PIXEL_VALUES].shape[0]))
        return out


def _load_encoder(settings: ModelSettings, config: dict):
    from backends.checkpoint import load_model

    model, _ = load_model(settings.checkpoint, settings.device, dtype=_out_dtype(config, IMAGE_EMBEDS),
                          config=settings.vision)
    return model


class EncoderModel(_Adapter):
    name = "moonvit3d"

    def setup(self):
        self.table = None
        cache = None
        if self.settings.cache_bytes > 0:
            prefix = server_prefix()
            if prefix:  # the keys it holds, published for preprocessing (backends/cache/index.py)
                try:
                    self.table = KeyTable(SHM / f"{prefix}cache_{self.instance_name}")
                except OSError as exc:  # a hint only: without it every media is decoded, and hits still skip the encoder
                    log.warning("%s: cannot publish the cache's keys in %s (%s); preprocessing decodes every media",
                                self.name, SHM, exc)
            cache = EmbeddingCache(self.settings.cache_bytes, on_put=self.table and self.table.add,
                                   on_evict=self.table and self.table.remove)
        model = _load_encoder(self.settings, self.config)
        # Every single media in a CUDA-graph bucket, 1x3000^2 (16,900 patches after padding) included.
        top = largest_media_patches(self.settings.vision.media) if model.device.type == "cuda" else 16384
        self.step = EncoderStep(model, cuda_graphs=self.settings.cuda_graphs, cache=cache, max_patches=top)
        for line in self.step.prepare():
            log.info("%s: %s", self.name, line)
        self._fallback_step = None
        self.metrics.watch_cache(cache)
        # Descriptors instead of IMAGE_EMBEDS for requests that ask (contract.NIXL_PARAMETER); the agent and
        # its arena are made at the first such request.
        self.nixl = None
        if self.settings.nixl_bytes > 0:
            self.nixl = NixlExport(self.settings.nixl_bytes, self.settings.nixl_lifetime_ms / 1000,
                                   self.step.model.device, self.instance_name)
        self.metrics.watch_nixl(self.nixl)

    def _cuda_memory(self) -> dict[str, float]:
        out = super()._cuda_memory()
        nixl = getattr(self, "nixl", None)
        if nixl is not None and "cached" in out:  # the arena is bounded too: not a leak
            out["cached"] += float(nixl.arena_bytes)
        return out

    def _wants_nixl(self, request) -> bool:
        if not nixl_requested(_parameters(request)):
            return False
        if self.nixl is None:
            raise RequestError("this server hands out no NIXL descriptors: its nixl_bytes is 0 (the launcher's "
                               "--nixl-bytes, KIMI_NIXL_BYTES)", "nixl_off")
        return True

    def _fallback(self, inputs: _Inputs):
        """media index -> its patches, preprocessed here from the request's IMAGES: for a media that
        preprocessing left out because the encoder held its rows, which are gone by now."""
        def patches(m: int) -> torch.Tensor:
            if self._fallback_step is None:
                model = self.step.model
                self._fallback_step = PreprocessStep(self.settings.vision, self.settings.limits,
                                                     device=str(model.device), out_dtype=model.dtype)
            images = inputs.bytes_list(IMAGES, optional=True)
            if images is None:
                raise RequestError(f"media {m} was sent without its patches and without IMAGES", "bad_tensor")
            frames = inputs.numpy(MEDIA_FRAMES, optional=True)
            indices, is_video = split_media(len(images), frames, self.settings.vision.media)[m]
            out = self._fallback_step([images[i] for i in indices], media_frames=[len(indices)] if is_video else None)
            return out[PIXEL_VALUES]
        return patches

    def _request(self, inputs: _Inputs, cancelled=None) -> EncoderRequest:
        keys = inputs.numpy(MEDIA_KEYS, optional=True)
        cached = inputs.numpy(MEDIA_CACHED, optional=True)
        return EncoderRequest(inputs.torch(PIXEL_VALUES), inputs.numpy(GRID_THWS),
                              keys=[k.tobytes() for k in keys] if keys is not None and len(keys) else None,
                              cached=cached, fallback=self._fallback(inputs), cancelled=cancelled)

    def finalize(self):
        table = getattr(self, "table", None)
        if table is not None:
            table.close()
        nixl = getattr(self, "nixl", None)
        if nixl is not None:
            nixl.close()
        super().finalize()

    def _execute(self, requests):
        """All requests of a dynamic batch go through one varlen forward (EncoderStep.run_batch)."""
        t0 = time.perf_counter()
        parsed: list[tuple[_Inputs, EncoderRequest, bool] | Exception] = []
        for request in requests:
            try:
                inputs = self.inputs(request)
                wants_nixl = self._wants_nixl(request)  # refused before the encoder runs for it
                # Asked (an IPC round trip) only of a request that has media to encode: one the cache
                # answers whole costs nothing more to finish than to drop.
                parsed.append((inputs, self._request(inputs, cancelled=inputs.gave_up(request.is_cancelled)), wants_nixl))
            except Exception as exc:  # noqa: BLE001
                parsed.append(exc)
        results = [p if isinstance(p, Exception) else None for p in parsed]
        done = iter(self.step.run_batch([p[1] for p in parsed if isinstance(p, tuple)]))
        for i, p in enumerate(parsed):
            if isinstance(p, tuple):
                results[i] = next(done)
        # Rows into the NIXL arena, one descriptor each, for the requests that asked (one stream sync for all).
        asked = [i for i, p in enumerate(parsed) if isinstance(p, tuple) and p[2] and not isinstance(results[i], Exception)]
        descriptors = dict(zip(asked, self.nixl.export([results[i] for i in asked]))) if asked else {}
        responses = []
        for i, p in enumerate(parsed):
            result = descriptors.get(i, results[i])
            try:
                if isinstance(result, Exception):
                    raise result
                # The descriptor alone for a NIXL request: the ensemble drops the outputs a step leaves out,
                # and the rows never travel through Triton.
                name = IMAGE_EMBEDS_NIXL if i in descriptors else IMAGE_EMBEDS
                value = np.frombuffer(result, dtype=np.uint8).copy() if i in descriptors else result
                outputs = p[0].shape_outputs({name: value})
                responses.append(pb_utils.InferenceResponse(output_tensors=[_output(name, outputs[name])]))
            except Exception as exc:  # noqa: BLE001 - this request alone
                responses.append(self.error_response(exc))
        elapsed = time.perf_counter() - t0
        for _ in requests:
            self.metrics.step_time(elapsed)  # every request of the batch waited for the whole batch
        return responses
