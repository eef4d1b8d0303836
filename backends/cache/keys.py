"""A media's cache key: what makes two media give the same embedding rows.

The rows depend on the media's encoded bytes (every frame of a video chunk, in order), on whether it is
a still image or a chunk (a chunk is resized with the per-frame patch limit and its frames pooled, so
the same bytes give other rows as a one-frame chunk than as an image), and on everything the service
computes them with: the checkpoint, the preprocessing settings (patch limits, mean and std: the resolved
VisionConfig), and the dtype of the embeddings. The last three are the same for every request of a
model instance: `context` hashes them once; `media_key` adds a media's own part.

SHA-256: a collision would serve one image's rows for another, so the key is a cryptographic hash, and
every length is hashed in front of its bytes so that no two splits of the same bytes into frames
collide. SHA-256 rather than BLAKE2b because CPUs hash it in hardware (SHA-NI): 0.72 against 2.02 ms
for 1.3 MB on our CPU machine (lab/results/cpu.md, section key_hash), on the path of every request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

KEY_BYTES = 32
# Bumped whenever the pixels or the encoder's arithmetic change for the same settings (a new resize or
# decode path that is not bit-exact with the last): an old key must never name new rows.
RULES_VERSION = b"kimi-vision-cache-1"


def context(checkpoint_identity: str, vision_config_json: str, dtype: str) -> bytes:
    """The part of every key a model instance shares: the checkpoint, the resolved config, the dtype."""
    h = hashlib.sha256()
    for part in (RULES_VERSION, checkpoint_identity.encode(), vision_config_json.encode(), dtype.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def media_key(ctx: bytes, frames: Sequence[bytes], is_video: bool) -> bytes:
    """One media's key: the shared context, still image or chunk, and each frame's bytes in order."""
    h = hashlib.sha256(ctx + (b"chunk" if is_video else b"image"))
    h.update(len(frames).to_bytes(8, "little"))
    for frame in frames:
        h.update(len(frame).to_bytes(8, "little"))
        h.update(frame)
    return h.digest()
