"""Writes the committed 4:4:0 (h1v2) JPEGs, which Pillow can decode but not write: OpenCV writes them.

    pip install --target /tmp/cv opencv-python-headless && PYTHONPATH=/tmp/cv .venv/bin/python -m lab.tools.make_440_jpegs

(the project's environment: the self-check's picture comes from backends/preprocess/jpeg_gpu.py)

- oracles/data/440_259x97_q50.jpg, 440_259x97_q95.jpg: the exact-decode corpus's 4:4:0 files
  (oracles/jpeg_corpus.py), the same picture as its other files;
- backends/preprocess/selfcheck_440.jpg: the GPU decoder's start-up self-check's 4:4:0 file, 67x45 (an
  odd height, so the last chroma row is replicated).
Committed once, so that tests and the self-check never depend on OpenCV being installed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SAMPLING_440 = 0x121111  # OpenCV: Y 1x2, Cb 1x1, Cr 1x1


def self_check_picture(w: int = 67, h: int = 45) -> np.ndarray:
    """RGB like the self-check's other images (its own gradients with some noise)."""
    from backends.preprocess.jpeg_gpu import gradient_picture

    return gradient_picture(w, h, np.random.default_rng(440))


def encode_440(rgb: np.ndarray, quality: int) -> bytes:
    import cv2

    ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(rgb[..., ::-1]),
                           [cv2.IMWRITE_JPEG_QUALITY, quality, cv2.IMWRITE_JPEG_SAMPLING_FACTOR, SAMPLING_440])
    if not ok:
        raise RuntimeError("OpenCV could not write the JPEG")
    return buf.tobytes()


def main() -> int:
    from oracles.jpeg_corpus import photo

    out = {ROOT / "backends/preprocess/selfcheck_440.jpg": encode_440(self_check_picture(), 75)}
    for q in (50, 95):
        out[ROOT / f"oracles/data/440_259x97_q{q}.jpg"] = encode_440(np.asarray(photo(259, 97, seed=5)), q)
    for path, blob in out.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
        print(f"{path.relative_to(ROOT)}: {len(blob)} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
