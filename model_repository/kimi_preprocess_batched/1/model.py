"""Triton entry point for `kimi_preprocess`; the logic lives in backends.serving (importable, tested without a server)."""

from backends.serving.triton_models import PreprocessModel as TritonPythonModel  # noqa: F401
