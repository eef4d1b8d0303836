"""Triton entry point for `moonvit3d`; the logic lives in backends.serving (importable, tested without a server)."""

from backends.serving.triton_models import EncoderModel as TritonPythonModel  # noqa: F401
