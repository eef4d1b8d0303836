"""Triton entry point for `kimi_placeholder`; the logic lives in backends.serving (importable, tested without a server)."""

from backends.serving.triton_models import PlaceholderModel as TritonPythonModel  # noqa: F401
