"""Seeded random weights: the embedded default model is the small DEMO_CONFIG tower filled by them.

Untrained: its embeddings are deterministic but meaningless. It exists so that `make run` and the tests
exercise the full pipeline in seconds without a 600 GB checkpoint.
"""

from __future__ import annotations

import torch

from backends.config import EncoderConfig
from backends.encoder.moonvit3d import KimiVisionModel

DEMO_SEED = 20260130


def init_random_(model: torch.nn.Module, seed: int = DEMO_SEED, std: float = 0.02) -> torch.nn.Module:
    """Fill every parameter from one CPU generator, in parameter-name order, so the result is the same
    on every machine. Norm scales are 1 + noise; everything else is N(0, std)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            if "norm" in name and name.endswith("weight"):
                noise += 1.0
            param.copy_(noise.to(param.dtype))
    return model


def seeded_model(cfg: EncoderConfig, seed: int = DEMO_SEED) -> KimiVisionModel:
    return init_random_(KimiVisionModel(cfg), seed).eval()
