"""Triton entry point for `kimi_k25_vision_fused`; the logic lives in backends.serving (importable, tested without a server)."""

from backends.serving.triton_models import FusedModel as TritonPythonModel  # noqa: F401
