"""The settings a model instance reads from its config.pbtxt `parameters`: written by the renderer
(backends/deploy/repository.py, `ModelSettings.parameters`) and read back by each adapter in `initialize`
(`ModelSettings.from_parameters`), so that the two sides cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from backends.checkpoint import load_config
from backends.config import DEMO_CONFIG, Limits, VisionConfig


@dataclass(frozen=True)
class ModelSettings:
    checkpoint: str = ""  # empty: the embedded demo model
    device: str = "cpu"  # where this instance computes: "cpu" or "cuda:<id>" (from Triton, not the parameters)
    limits: Limits = Limits()
    cuda_graphs: int = 0  # encoder graphs to keep (backends/encoder/graphs.py); 0 = eager
    cache_bytes: int = 0  # the embedding cache's budget per encoder instance (backends/cache); 0 = off
    # The NIXL arena per encoder instance (backends/nixl_export), made at the first request for a
    # descriptor; 0 = no descriptors. And how long a descriptor's rows wait unread at most.
    nixl_bytes: int = 0
    nixl_lifetime_ms: int = 30_000
    vision: VisionConfig = DEMO_CONFIG  # resolved once by the renderer, carried as JSON

    def parameters(self) -> dict[str, str]:
        """The model-config parameters that carry these settings (string values, as Triton keeps them)."""
        params = {"checkpoint": self.checkpoint,
                  **{f.name: str(getattr(self.limits, f.name)) for f in fields(Limits)},
                  # The resolved VisionConfig: instances read it here instead of parsing the checkpoint's files.
                  "vision_config": self.vision.to_json()}
        if self.cuda_graphs:
            params["cuda_graphs"] = str(self.cuda_graphs)
        params["cache_bytes"] = str(self.cache_bytes)
        params["nixl_bytes"] = str(self.nixl_bytes)
        params["nixl_lifetime_ms"] = str(self.nixl_lifetime_ms)
        return params

    @classmethod
    def from_parameters(cls, params: dict[str, str], device: str = "cpu") -> "ModelSettings":
        # A limit the parameters leave out takes its default (the byte limits: derived from the pixel limit).
        limits = Limits(**{f.name: int(params[f.name]) for f in fields(Limits) if params.get(f.name)})
        checkpoint = params.get("checkpoint", "")
        # What the renderer writes; a repository written by hand falls back to the checkpoint's own config
        # (never the demo's for a checkpoint).
        vision = VisionConfig.from_json(params["vision_config"]) if params.get("vision_config") else load_config(checkpoint)
        return cls(checkpoint=checkpoint, device=device, limits=limits,
                   cuda_graphs=int(params.get("cuda_graphs", 0)), cache_bytes=int(params.get("cache_bytes", 0)),
                   nixl_bytes=int(params.get("nixl_bytes", 0)),
                   nixl_lifetime_ms=int(params.get("nixl_lifetime_ms", cls.nixl_lifetime_ms)), vision=vision)
