"""The normalization table: the normalized value of every uint8 level, per channel.

Built with the checkpoint processor's arithmetic (`(x/255).astype(float32)`, then `-= mean`, then
`*= 1/std`, each rounded to float32; docs/kimi_k25.md#normalization), so a table lookup equals the
reference bit for bit on any device. Padding is zero in uint8 space and therefore lands on
table[c][0] = -mean/std (-1 for K2.5), never 0.
"""

from __future__ import annotations

import numpy as np

from backends.config import MediaConfig


def normalization_table(media: MediaConfig) -> np.ndarray:
    """(3, 256) float32."""
    levels = (np.arange(256, dtype=np.float64) / 255.0).astype(np.float32)
    mean = np.asarray(media.image_mean, dtype=np.float64)
    std_inv = 1.0 / np.asarray(media.image_std, dtype=np.float64)
    table = np.empty((3, 256), dtype=np.float32)
    for c in range(3):
        x = levels.copy()
        x -= mean[c]  # in-place into float32, as the reference does
        x *= std_inv[c]
        table[c] = x
    return table
