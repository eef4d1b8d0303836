"""Thin Triton Python-backend adapters. Imported only inside tritonserver's Python stub.

Each adapter: read settings from the model config, build its step once in `initialize`, and in
`execute` return exactly one response per request - an error response for a bad request, so the
rest of the batch is unaffected. Device tensors cross the boundary through DLPack (zero-copy);
host numpy arrays, and empty tensors (whose DLPack export fails in the 2.51 stub), through numpy.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import signal
import threading
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack

from backends import phases
from backends.errors import RequestCancelled, RequestError
from backends.serving.metrics import ModelMetrics, allocator_gauges
from backends.serving.pipeline import Pipeline, Streams
from backends.serving.profiling import ExecuteProfiler
from contract import (FORWARD_SUFFIX, FUSED, GRID_THWS, IMAGE_EMBEDS, IMAGE_TOKEN_COUNTS, IMAGES, INPUT_IDS, MEDIA_FRAMES,
                      PIXEL_VALUES)
from backends.serving.steps import (EncoderRequest, EncoderStep, FusedStep, ModelSettings, PlaceholderStep,
                                    PreprocessStep, throttled)

log = logging.getLogger("kimi_vision")

# How often preprocessing asks whether its request was cancelled (each question is an IPC round trip).
CANCEL_CHECK_S = 0.02
# The fused pipeline's watchdog on a GPU (FusedModel._stalled): no forward launched or answer sent for this
# long while requests are held, or one request's preprocessing this long. On the H200 a 3000^2 forward
# takes ~0.1 s and a graph capture a few seconds.
PIPELINE_STALL_S = 30.0

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


class _Adapter:
    name = "model"

    def initialize(self, args):
        self.settings, self.config = _settings(args)
        if self.settings.device.startswith("cuda"):
            # Triton kernels launch on the current device: make it this instance's GPU.
            torch.cuda.set_device(torch.device(self.settings.device))
        self.name = args.get("model_name", self.name)  # twins (…_batched) share the class
        self.instance_name = args.get("model_instance_name", self.name)
        memory = self._cuda_memory if self.settings.device.startswith("cuda") else None
        self.metrics = ModelMetrics(pb_utils, self.name, instance=args.get("model_instance_name", ""), memory=memory,
                                    phases_on=phases.ENABLED)
        self.profiler = ExecuteProfiler(self.name)
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
            phases.begin()  # the phases add up to the step time, but for the microseconds around them
            try:
                inputs = self.inputs(request)
                outputs = self.respond(inputs)
                phases.mark("step")  # what the step's own marks left (the whole step where it has none)
                responses.append(self.response(inputs, outputs))
                phases.mark("output tensors")
            except Exception as exc:  # noqa: BLE001 - one response per request, always
                responses.append(self.error_response(exc))
                phases.mark("failed")
            self.count(t0, phases.end())
        return responses

    def response(self, inputs: _Inputs, outputs: dict):
        """The request's answer: its outputs shaped as it sent its inputs, with the copies the next step reads."""
        outputs = inputs.shape_outputs(outputs)
        outputs.update({name + FORWARD_SUFFIX: outputs[name] for name in self.forwarded})
        return pb_utils.InferenceResponse(output_tensors=[_output(k, v) for k, v in outputs.items()])

    def count(self, t0: float, seconds: dict) -> None:
        """One request's phases and its step time (from t0, when the model took it)."""
        self.metrics.phases(seconds)
        self.metrics.step_time(time.perf_counter() - t0)

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


class PreprocessModel(_Adapter):
    name = "kimi_preprocess"

    def setup(self):
        self.step = PreprocessStep(self.settings.vision, self.settings.limits, device=self.settings.device,
                                   out_dtype=_out_dtype(self.config, PIXEL_VALUES))

    def respond(self, inputs: _Inputs):
        images = inputs.bytes_list(IMAGES)
        counts, frames = inputs.numpy(IMAGE_TOKEN_COUNTS, optional=True), inputs.numpy(MEDIA_FRAMES, optional=True)
        input_ids = inputs.numpy(INPUT_IDS, optional=True)
        phases.mark("read inputs")
        with _decodes_counted(self.metrics, self.step.pre):
            # Checked between media, at most every CANCEL_CHECK_S: a client that gave up (deadline,
            # cancel) stops the rest of the work. Only when kimi_preprocess is called directly: inside
            # an ensemble a running step is not told (docs/triton_runtime.md#known-server-limitations).
            out = self.step(images, counts, frames, cancelled=throttled(inputs.request.is_cancelled, CANCEL_CHECK_S),
                            input_ids=input_ids)
        self.metrics.preprocessed(len(images), int(out[PIXEL_VALUES].shape[0]))
        return out


def _load_encoder(settings: ModelSettings, config: dict):
    from backends.weights.load import load_model

    model, _ = load_model(settings.checkpoint, settings.device, dtype=_out_dtype(config, IMAGE_EMBEDS),
                          config=settings.vision)
    return model


@dataclass
class _FusedJob:
    """One request between the fused model's two stages (backends/serving/pipeline.py)."""

    inputs: _Inputs
    sender: object  # the request's response sender: its one answer goes out through it
    out: dict  # FusedStep.prepare's outputs, PIXEL_VALUES still in
    ready: object  # CUDA event: the preprocessing that wrote PIXEL_VALUES (None on CPU)
    t0: float  # when execute took the request: the step time runs until the answer is sent
    phases: dict  # its phases so far (name -> seconds); the worker adds its own


class FusedModel(_Adapter):
    """kimi_k25_vision_fused: the ensemble's contract, its three steps in this one instance (FusedStep).

    With its pipeline on (parameter `pipeline`), `execute` preprocesses a request on one CUDA stream and
    hands it to a worker thread that runs the encoder on another and answers through the request's
    response sender, so that the next request's preprocessing runs beside this one's forward
    (backends/serving/pipeline.py). Off, each request is answered from `execute`."""

    name = FUSED

    def setup(self):
        params = {k: v.get("string_value", "") for k, v in self.config.get("parameters", {}).items()}
        self.pipelined = params.get("pipeline", "no") == "yes"
        # Encoder lanes: forwards that may run side by side on their own streams (Streams); a GPU pipeline's.
        lanes = int(params.get("encoder_lanes") or 1)
        if lanes < 1:
            raise ValueError(f"parameter encoder_lanes must be at least 1, got {lanes}")
        if not (self.pipelined and self.settings.device.startswith("cuda")):
            lanes = 1
        # Graph captures wait for the preprocessing thread's GPU work and keep it out meanwhile.
        self.gpu_lock = threading.Lock() if self.pipelined else contextlib.nullcontext()
        self.step = FusedStep(self.settings.vision, _load_encoder(self.settings, self.config), self.settings.limits,
                              cuda_graphs=self.settings.cuda_graphs,
                              capture_lock=self.gpu_lock if self.pipelined else None, lanes=lanes)
        if self.pipelined:
            # Every thread's stack into the server's log on SIGUSR1 (tools/lanes_probe.py sends it when a
            # request passes its deadline): where a stuck request waits.
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            self.streams = Streams(torch.device(self.settings.device), lanes=lanes)
            self._next_lane = 0
            self.pipeline = Pipeline(self._launch, self._finish, in_flight=lanes + 1,
                                     context=self.streams.device_context, name=f"{self.name}-encoder",
                                     # GPU only: a CPU forward of a large request can take minutes.
                                     stall_s=PIPELINE_STALL_S if self.streams.cuda else None,
                                     on_stall=self._stalled)

    def _stalled(self, seconds: float, what: str) -> None:
        """The pipeline's watchdog: no progress for a while. Twice on the H200 a pipelined run stopped
        answering without an error (bench/results/h200-2026-12-02-seventeenth.md); this puts where every
        thread of this instance's stub waits into the server's log (the stub's stderr is the server's)."""
        log.error("%s (%s): %s for %.0f s (a stalled pipeline); every thread's stack follows",
                  self.name, self.instance_name, what, seconds)
        faulthandler.dump_traceback(all_threads=True)

    def _prepare(self, inputs: _Inputs):
        images = inputs.bytes_list(IMAGES)
        ids, frames = inputs.numpy(INPUT_IDS), inputs.numpy(MEDIA_FRAMES, optional=True)
        # Outputs nobody asked for are dropped by the server; without IMAGE_EMBEDS the encoder does not run.
        embeds = IMAGE_EMBEDS in inputs.request.requested_output_names()
        phases.mark("read inputs")
        with _decodes_counted(self.metrics, self.step.pre):
            out = self.step.prepare(ids, images, frames, cancelled=throttled(inputs.request.is_cancelled, CANCEL_CHECK_S))
        self.metrics.preprocessed(len(images), int(sum(int(t * h * w) for t, h, w in out[GRID_THWS])))
        return out, embeds

    def respond(self, inputs: _Inputs):
        out, embeds = self._prepare(inputs)
        return self.step.encode(out, cancelled_now=inputs.request.is_cancelled) if embeds else self.step.without_embeds(out)

    def _execute(self, requests):
        if not self.pipelined:
            return super()._execute(requests)
        return [self._accept(request) for request in requests]

    def _accept(self, request):
        """The first stage: the request preprocessed, then handed to the worker (None: answered later)
        or answered now (an error, or no IMAGE_EMBEDS wanted)."""
        t0 = time.perf_counter()
        phases.begin()
        try:
            with self.pipeline.first_stage(), self.gpu_lock, self.streams.preprocessing():
                inputs = self.inputs(request)
                out, embeds = self._prepare(inputs)
                ready = self.streams.record_pre() if embeds else None
            if embeds:
                job = _FusedJob(inputs, request.get_response_sender(), out, ready, t0, phases.end())
                self.pipeline.submit(job)  # blocks while the worker is a request behind
                return None
            response = self.response(inputs, self.step.without_embeds(out))
            phases.mark("output tensors")
        except Exception as exc:  # noqa: BLE001 - one response per request, always
            response = self.error_response(exc)
            phases.mark("failed")
        self.count(t0, phases.end())
        return response

    def _launch(self, job: _FusedJob):
        """The second stage, on the worker thread: the forward launched on the next lane, queued behind
        that lane's previous one, not waited for."""
        phases.begin()
        lane, self._next_lane = self._next_lane, (self._next_lane + 1) % self.streams.lanes
        try:
            with self.streams.lane(lane):
                self.streams.hand_over(job.ready, [job.out[PIXEL_VALUES]], lane)
                side_by_side = self.step.replays(job.out, lane)
                self.streams.before_forward(lane, side_by_side)
                phases.mark("hand-over")
                out = self.step.encode(job.out, cancelled_now=job.sender.is_cancelled, lane=lane)
                return out, self.streams.after_forward(lane, side_by_side)
        finally:
            _add_phases(job.phases, phases.end())

    def _finish(self, job: _FusedJob, launched, error: BaseException | None):
        """The answer, once the forward has run: through the response sender, with the FINAL flag."""
        phases.begin()
        try:
            if error is not None:  # what the launch raised (or why the worker stopped): this request's error
                raise error if isinstance(error, Exception) else RuntimeError(f"{type(error).__name__}: {error}")
            out, done = launched
            self.streams.wait(done)
            phases.mark("encoder wait")
            response = self.response(job.inputs, out)
            phases.mark("output tensors")
        except Exception as exc:  # noqa: BLE001 - this request alone
            response = self.error_response(exc)
        try:
            job.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # noqa: BLE001
            # The server answers the client itself when it cannot place the outputs; a send that fails
            # before reaching it has closed the sender all the same (python_backend 2.51): nothing more
            # can be sent, so it is counted and logged.
            self.metrics.failure(exc)
            log.error("%s: sending a response failed: %s", self.name, exc)
        phases.mark("send")
        self.count(job.t0, _add_phases(job.phases, phases.end()))

    def finalize(self):
        pipeline = getattr(self, "pipeline", None)
        if pipeline is not None:
            pipeline.close()  # every request already handed over is answered before the model unloads
        super().finalize()


def _add_phases(into: dict, more: dict) -> dict:
    for name, seconds in more.items():
        into[name] = into.get(name, 0.0) + seconds
    return into


class EncoderModel(_Adapter):
    name = "moonvit3d"

    def setup(self):
        self.step = EncoderStep(_load_encoder(self.settings, self.config), cuda_graphs=self.settings.cuda_graphs)

    def _execute(self, requests):
        """All requests of a dynamic batch go through one varlen forward (EncoderStep.run_batch)."""
        t0 = time.perf_counter()
        # The batch taken apart, once per batch: reading the requests (is_cancelled() is an IPC round trip
        # to the server per request), the forward, the responses.
        phases.begin()
        parsed: list[tuple[_Inputs, EncoderRequest] | Exception] = []
        for request in requests:
            try:
                cancelled = request.is_cancelled()
                phases.mark("cancel check")
                if cancelled:  # dropped from the batch: nobody waits for its embeddings
                    raise RequestCancelled("cancelled by the client before the encoder ran")
                inputs = self.inputs(request)
                parsed.append((inputs, EncoderRequest(inputs.torch(PIXEL_VALUES), inputs.numpy(GRID_THWS))))
            except Exception as exc:  # noqa: BLE001
                parsed.append(exc)
            phases.mark("read inputs")
        results = iter(self.step.run_batch([p[1] for p in parsed if isinstance(p, tuple)]))
        phases.mark("step")  # what the encoder step's own marks left: checks, the split, cache bookkeeping
        responses = []
        for p in parsed:
            result = next(results) if isinstance(p, tuple) else p
            try:
                if isinstance(result, Exception):
                    raise result
                outputs = p[0].shape_outputs({IMAGE_EMBEDS: result})
                responses.append(pb_utils.InferenceResponse(output_tensors=[_output(IMAGE_EMBEDS, outputs[IMAGE_EMBEDS])]))
            except Exception as exc:  # noqa: BLE001 - this request alone
                responses.append(self.error_response(exc))
        phases.mark("output tensors")
        elapsed = time.perf_counter() - t0
        self.metrics.phases(phases.end())
        for _ in requests:
            self.metrics.step_time(elapsed)  # every request of the batch waited for the whole batch
        return responses
