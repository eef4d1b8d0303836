"""Deterministic sample images (made in memory, so the repo carries no binaries)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw


def photo_like(width: int, height: int, seed: int = 0) -> np.ndarray:
    """(H, W, 3) uint8: smooth gradients, a checker edge pattern and mild noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    plane = 128 + 90 * np.sin(x / 40) * np.cos(y / 55) + 40 * (((x // 37 + y // 41) % 2) - 0.5)
    plane = plane + rng.normal(0, 6, plane.shape)
    rgb = np.stack([plane, np.roll(plane, 7, axis=0), np.roll(plane, 13, axis=1)], axis=-1)
    return np.clip(rgb, 0, 255).astype(np.uint8)


def encode(pixels: np.ndarray | Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    img = pixels if isinstance(pixels, Image.Image) else Image.fromarray(pixels)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def text_card(width: int = 300, height: int = 200) -> Image.Image:
    img = Image.new("RGB", (width, height), (250, 250, 245))
    draw = ImageDraw.Draw(img)
    draw.rectangle((10, 10, width - 10, height // 2), outline=(20, 40, 200), width=3)
    draw.text((20, 20), "Kimi-K2.5 vision", fill=(0, 0, 0))
    draw.ellipse((width // 2, height // 2, width - 20, height - 10), fill=(200, 30, 30))
    return img


def sample_images() -> list[bytes]:
    """The `make run` request: a 640x480 JPEG photo and a 300x200 PNG drawing."""
    return [encode(photo_like(640, 480), "JPEG", quality=90), encode(text_card(), "PNG")]
