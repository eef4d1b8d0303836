"""Where the encoder's weights come from: the embedded seeded demo, or a checkpoint directory."""

from __future__ import annotations

import torch

from backends.config import DEMO_CONFIG, VisionConfig


def load_model(checkpoint: str, device: str = "cpu", dtype: torch.dtype | None = None,
               config: VisionConfig | None = None):
    """(KimiVisionModel in eval mode on `device`, VisionConfig). Empty `checkpoint` = the demo model;
    `config` = the checkpoint's config when the caller has it already."""
    if not checkpoint:
        from backends.weights.seeded import seeded_model

        model = seeded_model(DEMO_CONFIG.encoder)
        return model.to(device=device, dtype=dtype or torch.float32), DEMO_CONFIG
    from backends.weights.checkpoint import load_vision_model

    return load_vision_model(checkpoint, device=device, dtype=dtype, config=config)


__all__ = ["load_model"]
