"""Stand-ins for the Python backend's `triton_python_backend_utils`, shared by the unit tests: a
recording metric API (pb_utils.MetricFamily) for the tests of our metrics and of the phase clock, and
the request-path API (tensors, responses, errors) with a way to import our adapters against it. Not a
test module (no test_ prefix): pytest imports it from this folder as the tests do their own modules."""

import contextlib
import importlib
import sys
import threading
import types

import numpy as np
import torch

FINAL = 1  # pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL in the stand-in


class FakePbUtils:
    """Records what reaches 'the server', and from which thread."""

    def __init__(self, fail_first: bool = False):
        self.sent, self.threads, self.fail_first = [], set(), fail_first
        outer = self

        class Metric:
            def __init__(self, labels, **extra):
                self.labels = labels

            def increment(self, value):
                outer.threads.add(threading.current_thread().name)
                if outer.fail_first:
                    outer.fail_first = False
                    raise RuntimeError("server busy")
                outer.sent.append(("inc", self.family, tuple(sorted(self.labels.items())), value))

            def set(self, value):
                outer.sent.append(("set", self.family, tuple(sorted(self.labels.items())), value))

            def observe(self, value):
                outer.threads.add(threading.current_thread().name)
                outer.sent.append(("obs", self.family, tuple(sorted(self.labels.items())), value))

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

            def __init__(self, name, description, kind):
                self.name = name

            def Metric(self, labels, **extra):  # noqa: N802 - pb_utils' name
                m = Metric(labels, **extra)
                m.family = self.name
                return m

        self.MetricFamily = MetricFamily


def request_path_stand_in() -> types.ModuleType:
    """`triton_python_backend_utils` as far as our adapters answer requests with it: Tensor (from numpy
    or DLPack; its value kept as numpy), InferenceResponse (outputs by name, or an error), TritonError
    and the FINAL flag."""
    pb = types.ModuleType("triton_python_backend_utils")

    class TritonError:
        INVALID_ARG, CANCELLED, UNAVAILABLE, INTERNAL = "invalid", "cancelled", "unavailable", "internal"

        def __init__(self, message, code):
            self.message, self.code = message, code

    class Tensor:
        def __init__(self, name, array):
            self.name, self.value = name, np.asarray(array)

        @classmethod
        def from_dlpack(cls, name, capsule):
            return cls(name, torch.utils.dlpack.from_dlpack(capsule).float().numpy())

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.outputs = {t.name: t.value for t in output_tensors}
            self.error = error

    pb.TritonError, pb.Tensor, pb.InferenceResponse = TritonError, Tensor, InferenceResponse
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    return pb


@contextlib.contextmanager
def triton_models_against_stand_in():
    """backends.serving.triton_models imported against request_path_stand_in(); afterwards that import
    goes and whatever sys.modules held before comes back."""
    names = ("triton_python_backend_utils", "backends.serving.triton_models")
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules["triton_python_backend_utils"] = request_path_stand_in()
    sys.modules.pop("backends.serving.triton_models", None)
    try:
        yield importlib.import_module("backends.serving.triton_models")
    finally:
        for name, module in saved.items():
            sys.modules.pop(name, None)
            if module is not None:
                sys.modules[name] = module
