"""Per-forward metadata, computed once on the host and shared by all layers (docs/kimi_k25.md#per-forward-metadata).

`grid_thws` never goes to the device: sequence lengths, max_seqlen, the RoPE angle table and the merge
layout are derived from the host copy, so no layer ever has to sync the device to learn a shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backends.config import EncoderConfig
from backends.encoder.cache import TensorCache


def as_grid_list(grid_thws) -> list[tuple[int, int, int]]:
    """Host (t, h, w) triples from a list, numpy array or CPU tensor. Refuses device tensors."""
    if isinstance(grid_thws, torch.Tensor):
        if grid_thws.device.type != "cpu":
            raise ValueError("grid_thws must stay on the host; a device copy costs a sync per read")
        grid_thws = grid_thws.numpy()
    arr = np.asarray(grid_thws, dtype=np.int64).reshape(-1, 3)
    return [(int(t), int(h), int(w)) for t, h, w in arr]


def rope_angles_table(cfg: EncoderConfig, h: int, w: int) -> torch.Tensor:
    """(h*w, head_dim/2) complex64 rotations for an h x w patch grid, raster order.

    Complex slot 2i rotates by column * f_i and slot 2i+1 by row * f_i, f_i = theta^(-4i/head_dim).
    Built with the same float32 ops as the reference table (positions as float, outer product,
    polar), so each entry equals the reference's bit for bit.
    """
    if not (1 <= h <= cfg.rope_max_height and 1 <= w <= cfg.rope_max_width):
        raise ValueError(f"patch grid {h}x{w} exceeds the RoPE table {cfg.rope_max_height}x{cfg.rope_max_width}")
    dim = cfg.head_dim
    dim_range = torch.arange(0, dim, 4)[: dim // 4].float()
    freqs = 1.0 / (cfg.rope_theta ** (dim_range / dim))
    flat = torch.arange(h * w)
    # Reference positions come from a 512-wide flat index; x = i % W, y = i // W give the same values.
    x_pos = (flat % w).float()
    y_pos = (flat // w).float()
    x_cis = torch.polar(torch.ones(h * w, dim // 4), torch.outer(x_pos, freqs).float())
    y_cis = torch.polar(torch.ones(h * w, dim // 4), torch.outer(y_pos, freqs).float())
    return torch.stack([x_cis, y_cis], dim=-1).reshape(h * w, dim // 2)


@dataclass
class ForwardMetadata:
    """Everything shape-dependent for one encoder forward over a packed batch of media."""

    grids: list[tuple[int, int, int]]
    seq_lens: list[int]  # t*h*w per media (host)
    max_seqlen: int  # host int: attention kernels need it without reading the device
    cu_seqlens: torch.Tensor  # (M+1,) int32 on device
    rope: torch.Tensor  # (sum t*h*w, head_dim/2) complex64 on device

    @property
    def num_patches(self) -> int:
        return sum(self.seq_lens)


_ROPE_CACHE = TensorCache(max_bytes=256 << 20)


def _rope_for_grid(cfg: EncoderConfig, h: int, w: int, device: torch.device) -> torch.Tensor:
    """The (h*w, D/2) table for one grid, built once per (grid, device) and kept there: a forward
    only concatenates device tensors, no host-to-device copy of the table."""
    key = (cfg.head_dim, cfg.rope_theta, h, w, str(device))
    return _ROPE_CACHE.get(key, lambda: rope_angles_table(cfg, h, w).to(device))


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    if device.type == "cuda":
        t = t.pin_memory()  # a truly asynchronous copy; the stream never waits on the host
    return t.to(device, non_blocking=True)


def check_grids(cfg: EncoderConfig, grids: Sequence[tuple[int, int, int]]) -> None:
    """The encoder's rules for (t, h, w), on the host: ValueError naming the first violation."""
    kh, kw = cfg.merge_kernel_size
    for t, h, w in grids:
        if min(t, h, w) < 1:
            raise ValueError(f"entries must be positive, got {[list(g) for g in grids]}")
        if t > cfg.init_pos_emb_time:
            raise ValueError(f"media with t={t} frames; the encoder takes 1..{cfg.init_pos_emb_time} frames per chunk")
        if h % kh or w % kw:
            raise ValueError(f"grid {h}x{w} is not a multiple of the merge kernel {kh}x{kw}")
        if h > cfg.rope_max_height or w > cfg.rope_max_width:
            raise ValueError(f"patch grid {h}x{w} exceeds the RoPE table {cfg.rope_max_height}x{cfg.rope_max_width}")


def check_pixels(cfg: EncoderConfig, pixel_shape: tuple[int, ...], grids: Sequence[tuple[int, int, int]]) -> None:
    """The one check that pixels and grids belong together: (N, 3, p, p) pixels, N = sum of t*h*w, and
    every grid valid for this encoder. ValueError in the client's terms (tensor names)."""
    p = cfg.patch_size
    if len(pixel_shape) != 4 or tuple(pixel_shape[1:]) != (3, p, p):
        raise ValueError(f"PIXEL_VALUES must have shape [N, 3, {p}, {p}], got {list(pixel_shape)}")
    try:
        check_grids(cfg, grids)
    except ValueError as exc:
        raise ValueError(f"GRID_THWS: {exc}") from None
    patches = sum(t * h * w for t, h, w in grids)
    if patches != pixel_shape[0]:
        raise ValueError(f"GRID_THWS describes {patches} patches but PIXEL_VALUES has {pixel_shape[0]}")


def rope_parts(cfg: EncoderConfig, grids: Sequence[tuple[int, int, int]], device: torch.device) -> list[torch.Tensor]:
    """Each media's (t*h*w, head_dim/2) rotations, in order (every frame of a chunk rotates alike)."""
    parts = [_rope_for_grid(cfg, h, w, device) for _, h, w in grids]
    return [p.repeat(t, 1) if t > 1 else p for p, (t, _, _) in zip(parts, grids)]


def build_metadata(cfg: EncoderConfig, grid_thws: Sequence, device: torch.device | str) -> ForwardMetadata:
    grids = as_grid_list(grid_thws)
    check_grids(cfg, grids)
    seq_lens = [t * h * w for t, h, w in grids]
    cu = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)
    device = torch.device(device)
    if grids:
        rope = torch.cat(rope_parts(cfg, grids, device))
    else:
        rope = torch.empty((0, cfg.head_dim // 2), dtype=torch.complex64, device=device)
    return ForwardMetadata(
        grids=grids,
        seq_lens=seq_lens,
        max_seqlen=max(seq_lens, default=0),
        cu_seqlens=_to_device(cu, device),
        rope=rope,
    )
