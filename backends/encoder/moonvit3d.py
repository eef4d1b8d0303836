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
from backends.kernels import add_norm
from backends.kernels import rope as fused_rope


def sincos_time_table(dim: int, frames: int) -> torch.Tensor:
    """(frames, dim) float32: [sin(p * w_k), cos(p * w_k)] with w_k = 10000^(-2k/dim)."""
    omega = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    angles = torch.outer(torch.arange(frames, dtype=torch.float32), omega)
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class Kernels:
    """One forward's kernels: fused ones for bf16/fp16 on CUDA (RoPE in place on the QKV projection; the
    residual add and the next LayerNorm in one pass; fc0's bias + GELU(tanh) in cuBLASLt's GEMM epilogue),
    the portable torch reference otherwise (`fused=False` asks for the reference anywhere). The RoPE table
    is prepared once here and reused by every layer. docs/encoder.md#fused-passes says what each saves."""

    def __init__(self, freqs: torch.Tensor, device: torch.device, dtype: torch.dtype, fused: bool | None = None):
        # The fused kernels apply to bf16/fp16 on CUDA; elsewhere, fused=None and fused=True alike run the
        # reference (fused=True means "wherever they apply", not "or fail").
        applies = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and fused_rope.triton is not None
        self.freqs = freqs
        self.fused = applies and fused is not False
        self.prepared = fused_rope.prepare_rope(freqs) if self.fused else None

    def rope(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prepared is not None:
            return fused_rope.apply_rope_inplace(q, k, self.prepared)
        return fused_rope.apply_rope_portable(q, k, self.freqs)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta))."""
        if self.fused and x.is_cuda and add_norm.fusable(x, delta, norm.weight, norm.bias):
            return add_norm.add_layernorm(x, delta, norm.weight, norm.bias, norm.eps)
        s = x + delta
        return s, norm(s)

    def linear_gelu(self, fc: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(fc(x)); fused, the bias and GELU run in the GEMM's epilogue (torch's
        `_addmm_activation`, whose CUDA path applies the tanh form, as cuBLASLt's GELU_BIAS epilogue does)."""
        if self.fused and x.dim() == 2 and x.is_cuda and fc.bias is not None:
            return torch._addmm_activation(fc.bias, x, fc.weight.t(), use_gelu=True)
        return F.gelu(fc(x), approximate="tanh")


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

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        return self.fc1(kernels.linear_gelu(self.fc0, x))


class EncoderBlock(nn.Module):
    """x += wo(Attn(RoPE(wqkv(norm0 x)))); x += mlp(norm1 x). The residual adds and the norms that follow
    them are run by MoonViT3d.layers, one fused pass each, across block boundaries."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.norm0 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.wqkv = nn.Linear(d, 3 * d)
        self.wo = nn.Linear(d, d)
        self.norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.mlp = MLP(d, cfg.intermediate_size)

    def attend(self, h: torch.Tensor, meta: ForwardMetadata, kernels: Kernels, attn_backend: str) -> torch.Tensor:
        """h = norm0(x) -> what attention adds to x."""
        L = h.shape[0]
        qkv = self.wqkv(h)  # (L, 3D)
        q, k, v = qkv.view(L, 3, self.num_heads, self.head_dim).unbind(1)  # [q | k | v], head-major views
        q, k = kernels.rope(q, k)  # the fused kernel rotates the views in place inside qkv
        return self.wo(varlen_attention(q, k, v, meta, attn_backend).reshape(L, -1))


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

    def forward(self, pixels: torch.Tensor, meta: ForwardMetadata, kernels: Kernels,
                attn_backend: str | None = None) -> torch.Tensor:
        """pixels: (L, 3, p, p) -> (L, D) after the final layer norm."""
        backend = attn_backend or pick_backend(pixels.device, pixels.dtype, meta)
        return self.layers(self.patch_embed(pixels, meta.grids), meta, kernels, backend)

    def layers(self, x: torch.Tensor, meta: ForwardMetadata, kernels: Kernels, attn_backend: str) -> torch.Tensor:
        """The blocks and the final layer norm over embedded patches (L, D). Reads of `meta` are its
        device tensors and host ints only (cu_seqlens, max_seqlen; seq_lens for per-media backends):
        what a CUDA graph over padded buckets feeds in (backends/encoder/graphs.py).

        Each residual add runs with the norm that reads its sum (norm1, the next block's norm0, the final
        norm): h is always the normed stream a block's next step reads."""
        blocks = self.encoder.blocks
        if not len(blocks):
            return self.encoder.final_layernorm(x)
        following = [b.norm0 for b in list(blocks)[1:]] + [self.encoder.final_layernorm]
        h = blocks[0].norm0(x)
        for block, norm in zip(blocks, following):
            x, h = kernels.add_norm(x, block.attend(h, meta, kernels, attn_backend), block.norm1)
            x, h = kernels.add_norm(x, block.mlp(h, kernels), norm)
        return h


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
    def forward(self, pixel_values: torch.Tensor, grid_thws, *, fused: bool | None = None,
                attn_backend: str | None = None) -> torch.Tensor:
        """pixel_values: (sum t*h*w, 3, p, p); grid_thws: host (M, 3). Returns (sum tokens, text_hidden)
        in media order, in the model's dtype. `fused`/`attn_backend` None = fastest available."""
        meta = grid_thws if isinstance(grid_thws, ForwardMetadata) else self.metadata(grid_thws)
        check_pixels(self.cfg, tuple(pixel_values.shape), meta.grids)
        if not meta.grids:
            return pixel_values.new_empty((0, self.cfg.text_hidden_size), dtype=self.dtype)
        kernels = Kernels(meta.rope, self.device, self.dtype, fused)
        x = self.vision_tower(pixel_values.to(self.dtype), meta, kernels, attn_backend)
        return self.merge_and_project(x, meta)

    def merge_and_project(self, x: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        """The tower's output rows (sum t*h*w, D) -> embeddings (sum tokens, text_hidden)."""
        return self.mm_projector(tpool_patch_merge(x, meta, self.cfg.merge_kernel_size))
