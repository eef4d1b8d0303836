"""The request cases the stage table, the end-to-end bench and the host-time probes share: JPEGs (quality
90, 4:2:0) that are the same every run. A light module, so a probe need not import a whole bench."""

from __future__ import annotations

import numpy as np

from clients.samples import encode, photo_like

CASES = {"1x1024^2": [(1024, 1024)], "1x3000^2": [(3000, 3000)], "8x448^2": [(448, 448)] * 8}


def case_jpegs(case: str) -> list[bytes]:
    """The JPEGs of one of CASES."""
    return [encode(photo_like(w, h, seed=i), "JPEG", quality=90) for i, (w, h) in enumerate(CASES[case])]


def random_sizes(n: int, seed: int = 7, low: int = 500, high: int = 1500) -> list[tuple[int, int]]:
    """`n` distinct (width, height) pairs, each side in [low, high]: sizes a server has not seen."""
    rng = np.random.default_rng(seed)
    out: list[tuple[int, int]] = []
    while len(out) < n:
        wh = (int(rng.integers(low, high + 1)), int(rng.integers(low, high + 1)))
        if wh not in out:
            out.append(wh)
    return out


def jpeg(w: int, h: int, seed: int) -> bytes:
    """A photo-like JPEG of w x h (quality 90, 4:2:0)."""
    return encode(photo_like(w, h, seed=seed), "JPEG", quality=90)
