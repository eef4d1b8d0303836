"""Thin Triton Python-backend adapters. Imported only inside tritonserver's Python stub.

Each adapter: read settings from the model config, build its step once in `initialize`, and in
`execute` return exactly one response per request - an error response for a bad request, so the
rest of the batch is unaffected. Tensors cross the boundary through DLPack (zero-copy, GPU too);
empty tensors go through numpy because DLPack export of empty tensors fails in the 2.51 stub.
"""

from __future__ import annotations

import json
import logging
import traceback

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack

from backends.errors import RequestError
from backends.serving.steps import EncoderRequest, EncoderStep, ModelSettings, PlaceholderStep, PreprocessStep

log = logging.getLogger("kimi_vision")

_NUMPY_EMPTY = {torch.float32: np.float32, torch.int64: np.int64, torch.float16: np.float16}


def _settings(args: dict) -> tuple[ModelSettings, dict]:
    config = json.loads(args["model_config"])
    params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    device = "cpu"
    if args.get("model_instance_kind") == "GPU":
        device = f"cuda:{args['model_instance_device_id']}"
    return ModelSettings.from_parameters(params, device=device), config


def _bytes_list(tensor) -> list[bytes]:
    return [bytes(x) for x in tensor.as_numpy().reshape(-1)]


def _to_torch(tensor) -> torch.Tensor:
    shape = tuple(tensor.shape())
    if 0 in shape:  # an empty tensor has no pointer to share; its dtype is fixed by the consumer
        return torch.empty(shape)
    return from_dlpack(tensor.to_dlpack())


def _optional_numpy(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _output(name: str, value) -> "pb_utils.Tensor":
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
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
    log.error("%s: internal error\n%s", model, "".join(traceback.format_exception(exc)))
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(f"internal error: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)
    )


class _FailureCounter:
    """Per-request errors count as successes in Triton's own metrics; this counts them."""

    def __init__(self, model: str):
        self.counters = {}
        try:
            self.family = pb_utils.MetricFamily(
                name="kimi_vision_request_failures_total",
                description="Requests answered with an error, by model and kind",
                kind=pb_utils.MetricFamily.COUNTER,
            )
        except Exception:  # noqa: BLE001 - metrics are optional
            self.family = None
        self.model = model

    def inc(self, exc: Exception) -> None:
        if self.family is None:
            return
        kind = "invalid_input" if isinstance(exc, RequestError) else "internal"
        if kind not in self.counters:
            self.counters[kind] = self.family.Metric(labels={"model": self.model, "kind": kind})
        self.counters[kind].increment(1)


class _Adapter:
    name = "model"

    def initialize(self, args):
        self.settings, self.config = _settings(args)
        self.failures = _FailureCounter(self.name)
        self.setup()

    def setup(self):
        raise NotImplementedError

    def respond(self, request) -> dict:
        raise NotImplementedError

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = self.respond(request)
                responses.append(pb_utils.InferenceResponse(output_tensors=[_output(k, v) for k, v in outputs.items()]))
            except Exception as exc:  # noqa: BLE001 - one response per request, always
                self.failures.inc(exc)
                responses.append(_error(exc, self.name))
        return responses


class PlaceholderModel(_Adapter):
    name = "kimi_placeholder"

    def setup(self):
        self.step = PlaceholderStep(self.settings.vision_config(), self.settings.limits)

    def respond(self, request):
        ids = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS").as_numpy()
        images = _bytes_list(pb_utils.get_input_tensor_by_name(request, "IMAGES"))
        return self.step(ids, images, _optional_numpy(request, "MEDIA_FRAMES"))


def _out_dtype(config: dict, tensor: str) -> torch.dtype:
    for out in config["output"]:
        if out["name"] == tensor:
            return {"TYPE_FP32": torch.float32, "TYPE_BF16": torch.bfloat16, "TYPE_FP16": torch.float16}[out["data_type"]]
    raise KeyError(tensor)


class PreprocessModel(_Adapter):
    name = "kimi_preprocess"

    def setup(self):
        self.step = PreprocessStep(self.settings.vision_config(), self.settings.limits, device=self.settings.device,
                                   out_dtype=_out_dtype(self.config, "PIXEL_VALUES"))

    def respond(self, request):
        images = _bytes_list(pb_utils.get_input_tensor_by_name(request, "IMAGES"))
        return self.step(images, _optional_numpy(request, "IMAGE_TOKEN_COUNTS"), _optional_numpy(request, "MEDIA_FRAMES"))


class EncoderModel(_Adapter):
    name = "moonvit3d"

    def setup(self):
        from backends.weights import load_model

        model, cfg = load_model(self.settings.checkpoint, self.settings.device,
                                dtype=_out_dtype(self.config, "IMAGE_EMBEDS"))
        self.step = EncoderStep(model, cfg.encoder.patch_size, cfg.encoder.merge_tokens)

    def execute(self, requests):
        parsed: list[EncoderRequest | Exception] = []
        for request in requests:
            try:
                pv = _to_torch(pb_utils.get_input_tensor_by_name(request, "PIXEL_VALUES"))
                grid = pb_utils.get_input_tensor_by_name(request, "GRID_THWS").as_numpy()
                parsed.append(EncoderRequest(pv, grid))
            except Exception as exc:  # noqa: BLE001
                parsed.append(exc)
        ok = [p for p in parsed if isinstance(p, EncoderRequest)]
        results = iter(self.step.run_batch(ok))
        responses = []
        for p in parsed:
            result = next(results) if isinstance(p, EncoderRequest) else p
            if isinstance(result, Exception):
                self.failures.inc(result)
                responses.append(_error(result, self.name))
            else:
                responses.append(pb_utils.InferenceResponse(output_tensors=[_output("IMAGE_EMBEDS", result)]))
        return responses
