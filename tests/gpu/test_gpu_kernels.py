"""Kernels on the GPU: bit-identical to their references (torch.equal), at real sizes."""

import numpy as np
import pytest
import torch

from backends.config import EncoderConfig, MediaConfig
from backends.encoder.metadata import rope_angles_table
from backends.kernels import rope as fused_rope
from backends.kernels.patchify import normalize_patchify, pad_normalize_patchify
from backends.kernels.rope import apply_rope_portable
from backends.preprocess import Preprocessor
from backends.preprocess.normalize import normalization_table
from backends.preprocess.resize_rule import navit_resize
from clients.samples import encode, photo_like, text_card

DEV = "cuda"


def _freqs(tokens, head_dim):
    cfg = EncoderConfig(hidden_size=16 * head_dim, num_heads=16)
    side = int(np.ceil(np.sqrt(tokens)))
    return rope_angles_table(cfg, side, side)[:tokens].to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [72, 64, 128])
@pytest.mark.parametrize("tokens", [1, 37, 1024, 5476, 16900])
def test_fused_rope_is_bit_identical_to_portable(tokens, head_dim, dtype):
    torch.manual_seed(tokens)
    freqs = _freqs(tokens, head_dim)
    qkv = torch.randn(tokens, 3, 16, head_dim, device=DEV).to(dtype)
    ref_q, ref_k = apply_rope_portable(qkv[:, 0].clone(), qkv[:, 1].clone(), freqs)
    v = qkv[:, 2].clone()
    fused_rope.apply_rope_inplace(qkv[:, 0], qkv[:, 1], fused_rope.prepare_rope(freqs))
    assert torch.equal(qkv[:, 0], ref_q) and torch.equal(qkv[:, 1], ref_k)
    assert torch.equal(qkv[:, 2], v)


@pytest.mark.parametrize("size", [(4032, 3024), (1024, 1024), (640, 480), (33, 1), (1500, 40)])
def test_gpu_preprocessing_equals_pillow_path(size):
    blob = encode(photo_like(*size, seed=size[0]), "JPEG", quality=90)
    ref, ref_grid, _ = Preprocessor(MediaConfig())([blob])
    got, grid, _ = Preprocessor(MediaConfig(), device=DEV, out_dtype=torch.bfloat16)([blob])
    assert grid.tolist() == ref_grid.tolist()
    assert torch.equal(got.cpu(), ref.to(torch.bfloat16))
    got32, _, _ = Preprocessor(MediaConfig(), device=DEV, out_dtype=torch.float32)([blob])
    assert torch.equal(got32.cpu(), ref)


def test_gpu_preprocessing_of_a_video_chunk_and_a_drawing():
    blobs = [encode(photo_like(1200, 900, seed=s), "PNG") for s in range(3)] + [encode(text_card(), "PNG")]
    ref, g1, _ = Preprocessor(MediaConfig())(blobs, media_frames=[3, 0])
    got, g2, _ = Preprocessor(MediaConfig(), device=DEV, out_dtype=torch.float32)(blobs, media_frames=[3, 0])
    assert g1.tolist() == g2.tolist() and torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_patchify_kernel_equals_torch_reference(dtype):
    media = MediaConfig()
    table = torch.from_numpy(normalization_table(media)).to(DEV)
    for w, h, t in [(1794, 1794, 1), (57, 41, 4), (7167, 7, 1)]:
        plan = navit_resize(w, h, media, frames=t)
        img = torch.randint(0, 256, (t, plan.height, plan.width, 3), dtype=torch.uint8, device=DEV)
        shape = (plan.patch_size, plan.padded_height, plan.padded_width)
        assert torch.equal(normalize_patchify(img, table, *shape, dtype), pad_normalize_patchify(img, table, *shape, dtype))
