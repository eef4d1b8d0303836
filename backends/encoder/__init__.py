from backends.encoder.metadata import ForwardMetadata, build_metadata
from backends.encoder.moonvit3d import KimiVisionModel

__all__ = ["ForwardMetadata", "KimiVisionModel", "build_metadata"]
