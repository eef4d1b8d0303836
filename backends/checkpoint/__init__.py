"""The checkpoint in one place: its config parsed once (config.py), its vision weights read and mapped
from any of the accepted layouts (weights.py), the embedded demo's seeded weights (seeded.py), and
`load_model`, the one way a served or benchmarked encoder gets its weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

from backends.checkpoint.config import load_config


def load_model(checkpoint: str, device: str = "cpu", dtype=None, config=None):
    """(KimiVisionModel in eval mode on `device`, VisionConfig). An empty `checkpoint` is the embedded demo
    (seeded random weights, float32 unless `dtype` says otherwise); `config` = the checkpoint's config
    when the caller has it already (a served model reads it from its model config)."""
    import torch

    if not checkpoint:
        from backends.checkpoint.seeded import seeded_model

        cfg = load_config("")
        return seeded_model(cfg.encoder).to(device=device, dtype=dtype or torch.float32), cfg
    from backends.checkpoint.weights import load_vision_model

    return load_vision_model(checkpoint, device=device, dtype=dtype, config=config)


def identity(checkpoint: str) -> str:
    """What tells this checkpoint's weights from another's, cheaply: its folder, the bytes of its config
    and index files, and each weight file's name, size and modification time (a cache key includes it:
    backends/cache/keys.py). "demo" for the embedded demo."""
    if not checkpoint:
        return "demo"
    root = Path(checkpoint).resolve()
    h = hashlib.blake2b(str(root).encode(), digest_size=16)
    for path in sorted(root.iterdir()):
        if path.suffix == ".json":
            h.update(path.name.encode() + path.read_bytes())
        elif path.suffix == ".safetensors":
            stat = path.stat()
            h.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()


__all__ = ["identity", "load_config", "load_model"]
