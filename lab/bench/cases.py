"""The request cases the stage table, the end-to-end bench and the host-time probes share: JPEGs (quality
90, 4:2:0) that are the same every run. A light module, so a probe need not import a whole bench."""

from __future__ import annotations

from clients.samples import encode, photo_like

CASES = {"1x1024^2": [(1024, 1024)], "1x3000^2": [(3000, 3000)], "8x448^2": [(448, 448)] * 8}


def case_jpegs(case: str) -> list[bytes]:
    """The JPEGs of one of CASES."""
    return [encode(photo_like(w, h, seed=i), "JPEG", quality=90) for i, (w, h) in enumerate(CASES[case])]
