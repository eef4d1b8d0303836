"""MoonViT3d (the Kimi-K2.5 vision tower) and its patch-merger projector, top to bottom.

Module and parameter names are the original checkpoint's (`vision_tower.encoder.blocks.N.wqkv`, ...),
so the original layout loads without renaming. Math follows docs/kimi_k25.md#encoder:

    x = Linear_588->D(pixels) + bicubic(pos_emb)[h, w] (+ sincos time for t > 1)
    27 x [ x += wo(Attn(RoPE2D(wqkv(LN0 x)))) ;  x += fc1(gelu_tanh(fc0(LN1 x))) ]
    x = final_layernorm(x)
    tokens = mean over t of 2x2 blocks -> (h/2 * w/2, 4, D)        # tpool_patch_merger
    out = proj.2(gelu(proj.0(LN(tokens).view(-1, 4D))))             # (tokens, text_hidden)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from backends.config import EncoderConfig
from backends.encoder.attention import pick_backend, varlen_attention
from backends.encoder.cache import TensorCache
from backends.encoder.metadata import ForwardMetadata, build_metadata, check_pixels
from backends.encoder.pos_resize import resize_table
from backends.kernels import rope as fused_rope


def sincos_time_table(dim: int, frames: int) -> torch.Tensor:
    """(frames, dim) float32: [sin(p * w_k), cos(p * w_k)] with w_k = 10000^(-2k/dim)."""
    omega = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    angles = torch.outer(torch.arange(frames, dtype=torch.float32), omega)
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class Rope:
    """The 2-D RoPE of one forward: the in-place Triton kernel for bf16/fp16 on CUDA (its table is
    prepared once here and reused by every layer), the portable complex multiply otherwise."""

    def __init__(self, freqs: torch.Tensor, device: torch.device, dtype: torch.dtype, fused: bool | None = None):
        if fused is None:
            fused = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and fused_rope.triton is not None
        self.freqs = freqs
        self.prepared = fused_rope.prepare_rope(freqs) if fused else None

    @property
    def fused(self) -> bool:
        return self.prepared is not None

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prepared is not None:
            return fused_rope.apply_rope_inplace(q, k, self.prepared)
        return fused_rope.apply_rope_portable(q, k, self.freqs)


class PosEmbDivided(nn.Module):
    """Learnable (H0, W0, D) grid, bicubically resized to each media's (h, w); sincos over time."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.hidden_size))
        self.register_buffer("time_weight", sincos_time_table(cfg.hidden_size, cfg.init_pos_emb_time), persistent=False)
        self._resized = TensorCache(max_bytes=512 << 20)

    def grid(self, h: int, w: int) -> torch.Tensor:
        """(h*w, D) in the weight's dtype: the reference's bicubic resize (no antialias,
        align_corners=False) as two small GEMMs (pos_resize.py: torch's kernel took ~8 ms per new grid).

        Cached per grid size, since in serving the weights do not change. The key holds the weight's
        storage and version, so a weight update is never served a stale table."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        def resize():
            return resize_table(self.weight.detach(), h, w).flatten(0, 1).contiguous()

        return self._resized.get((h, w, self.weight.data_ptr(), self.weight._version, self.weight.dtype), resize)

    def parts(self, grids: Sequence[tuple[int, int, int]], dtype: torch.dtype) -> list[torch.Tensor]:
        """Each media's (t*h*w, D) addend in `dtype`, in order (join them for the packed batch)."""
        parts, resized = [], {}
        for t, h, w in grids:
            if (h, w) not in resized:  # one interpolation per distinct grid in the batch
                resized[(h, w)] = self.grid(h, w)
            pos = resized[(h, w)]
            if t > 1:  # frame 0 of a chunk gets [0..0, 1..1]; single images get no time term
                pos = (pos[None] + self.time_weight[:t, None, :]).flatten(0, 1)
            parts.append(pos.to(dtype))
        return parts

    def forward(self, x: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        parts = self.parts(grids, x.dtype)
        return x + torch.cat(parts) if parts else x


class PatchEmbed(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=p, stride=p)
        self.pos_emb = PosEmbDivided(cfg)

    def project(self, pixels: torch.Tensor) -> torch.Tensor:
        # A stride-p conv over p x p patches is one matmul over the flattened (C, py, px) vector.
        return F.linear(pixels.flatten(1), self.proj.weight.flatten(1), self.proj.bias)  # (L, D)

    def forward(self, pixels: torch.Tensor, grids) -> torch.Tensor:
        return self.pos_emb(self.project(pixels), grids)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden)
        self.fc1 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class EncoderBlock(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.norm0 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.wqkv = nn.Linear(d, 3 * d)
        self.wo = nn.Linear(d, d)
        self.norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.mlp = MLP(d, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, meta: ForwardMetadata, rope: Rope, attn_backend: str) -> torch.Tensor:
        L = x.shape[0]
        qkv = self.wqkv(self.norm0(x))  # (L, 3D)
        q, k, v = qkv.view(L, 3, self.num_heads, self.head_dim).unbind(1)  # [q | k | v], head-major views
        q, k = rope(q, k)  # the fused kernel rotates the views in place inside qkv
        x = x + self.wo(varlen_attention(q, k, v, meta, attn_backend).reshape(L, -1))
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


class MoonViT3d(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, pixels: torch.Tensor, meta: ForwardMetadata, rope: Rope,
                attn_backend: str | None = None) -> torch.Tensor:
        """pixels: (L, 3, p, p) -> (L, D) after the final layer norm."""
        backend = attn_backend or pick_backend(pixels.device, pixels.dtype, meta)
        return self.layers(self.patch_embed(pixels, meta.grids), meta, rope, backend)

    def layers(self, x: torch.Tensor, meta: ForwardMetadata, rope: Rope, attn_backend: str) -> torch.Tensor:
        """The blocks and the final layer norm over embedded patches (L, D). Reads of `meta` are its
        device tensors and host ints only (cu_seqlens, max_seqlen; seq_lens for per-media backends):
        what a CUDA graph over padded buckets feeds in (backends/encoder/graphs.py)."""
        for block in self.encoder.blocks:
            x = block(x, meta, rope, attn_backend)
        return self.encoder.final_layernorm(x)


def tpool_patch_merge(x: torch.Tensor, meta: ForwardMetadata, kernel: tuple[int, int]) -> torch.Tensor:
    """(sum t*h*w, D) -> (sum h/kh * w/kw, kh*kw, D): 2x2 blocks in raster order, frames averaged."""
    kh, kw = kernel
    d = x.shape[-1]
    out, start = [], 0
    for (t, h, w), n in zip(meta.grids, meta.seq_lens):
        seg = x[start:start + n].view(t, h // kh, kh, w // kw, kw, d).permute(0, 1, 3, 2, 4, 5)
        out.append(seg.mean(dim=0).reshape(-1, kh * kw, d))
        start += n
    return torch.cat(out) if out else x.new_empty((0, kh * kw, d))


class PatchMergerProjector(nn.Module):
    """LN per 1152-vector, then the 2x2 group flattened to 4608 -> 4608 -> GELU(erf) -> text_hidden."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d, merged = cfg.hidden_size, cfg.hidden_size * cfg.merge_tokens
        self.pre_norm = nn.LayerNorm(d, eps=cfg.projector_ln_eps)
        self.proj = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, cfg.text_hidden_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        z = self.pre_norm(tokens)
        return self.proj(z.reshape(z.shape[0], -1))


class KimiVisionModel(nn.Module):
    """Tower + projector with the checkpoint's top-level names (`vision_tower.*`, `mm_projector.*`)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = MoonViT3d(cfg)
        self.mm_projector = PatchMergerProjector(cfg)

    @property
    def device(self) -> torch.device:
        return self.mm_projector.pre_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.mm_projector.pre_norm.weight.dtype

    def metadata(self, grid_thws) -> ForwardMetadata:
        return build_metadata(self.cfg, grid_thws, self.device)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thws, *, fused_rope: bool | None = None,
                attn_backend: str | None = None) -> torch.Tensor:
        """pixel_values: (sum t*h*w, 3, p, p); grid_thws: host (M, 3). Returns (sum tokens, text_hidden)
        in media order, in the model's dtype. `fused_rope`/`attn_backend` None = fastest available."""
        meta = grid_thws if isinstance(grid_thws, ForwardMetadata) else self.metadata(grid_thws)
        check_pixels(self.cfg, tuple(pixel_values.shape), meta.grids)
        if not meta.grids:
            return pixel_values.new_empty((0, self.cfg.text_hidden_size), dtype=self.dtype)
        rope = Rope(meta.rope, self.device, self.dtype, fused_rope)
        x = self.vision_tower(pixel_values.to(self.dtype), meta, rope, attn_backend)
        return self.merge_and_project(x, meta)

    def merge_and_project(self, x: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        """The tower's output rows (sum t*h*w, D) -> embeddings (sum tokens, text_hidden)."""
        return self.mm_projector(tpool_patch_merge(x, meta, self.cfg.merge_kernel_size))
