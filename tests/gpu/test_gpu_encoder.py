"""The encoder on the GPU in bf16: within the oracle's own bf16 error, sync-free, batch-invariant.

"Within the oracle's bf16 tolerance": against transformers in fp32 (the reference), our bf16 error may
be at most 1.5x transformers' own bf16 error on the same weights and inputs (plus a small floor).
"""

import tempfile

import numpy as np
import pytest
import torch

from backends.encoder.attention import available_backends
from backends.checkpoint.weights import load_vision_model
from oracles.transformers_kimi import hf_config, hf_image_features, hf_model, rel_err

DEV = "cuda"
# Images only: transformers 5.17 (on the GPU host) fails on t > 1 chunks in get_image_features; video
# chunks are checked against transformers 5.24 on CPU (tests/unit/test_encoder_oracle.py).
GRIDS = [(1, 32, 32), (1, 74, 74), (1, 10, 36), (1, 16, 20), (1, 64, 64)]


def load_ours(model, device="cpu", dtype=None):
    """Our KimiVisionModel with the same weights, through save_pretrained and our loader (the layout
    real users have on disk): the loader is under test here, so the oracle does not call it."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        ours, _ = load_vision_model(tmp, device=device, dtype=dtype)
    return ours


@pytest.fixture(scope="module")
def setup():
    cfg = hf_config(hidden=1152, layers=4, heads=16, intermediate=4304, pos_emb=64, text_hidden=7168)
    model = hf_model(cfg)
    gen = torch.Generator().manual_seed(5)
    n = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.rand(n, 3, 14, 14, generator=gen) * 2 - 1
    grids = torch.tensor(GRIDS)
    ref = hf_image_features(model.to(DEV), pixels.to(DEV), grids.to(DEV)).float()
    hf_bf16 = hf_image_features(model.to(torch.bfloat16), pixels.to(DEV, torch.bfloat16), grids.to(DEV)).float()
    ours = load_ours(model.float().cpu(), device=DEV, dtype=torch.bfloat16)
    return ours, pixels.to(DEV, torch.bfloat16), np.asarray(GRIDS), ref, rel_err(hf_bf16, ref)


@pytest.mark.parametrize("backend", ["fa4", "cudnn_loop", "varlen", "sdpa_loop"])
@pytest.mark.parametrize("fused", [True, False])
def test_bf16_error_within_the_oracles_own(setup, backend, fused):
    ours, pixels, grids, ref, hf_err = setup
    if backend not in available_backends(pixels.device, pixels.dtype):
        pytest.skip(f"{backend} not installed")
    out = ours(pixels, grids, fused=fused, attn_backend=backend).float()
    err = rel_err(out, ref)
    assert err <= 1.5 * hf_err + 1e-3, f"ours {err:.3e}, transformers in bf16 {hf_err:.3e}"


@pytest.mark.parametrize("backend", ["fa4", "cudnn_loop", "varlen"])
def test_no_device_sync_in_a_forward(setup, backend):
    """The whole forward, metadata included, under sync debug mode "error": any device->host sync raises."""
    ours, pixels, grids, _, _ = setup
    if backend not in available_backends(pixels.device, pixels.dtype):
        pytest.skip(f"{backend} not installed")
    ours(pixels, grids, attn_backend=backend)  # warm-up: kernels compiled, RoPE tables cached
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ours(pixels, grids, attn_backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape[0] == sum(h * w // 4 for _, h, w in GRIDS)


def test_joint_batch_equals_single_forwards(setup):
    ours, pixels, grids, _, _ = setup
    joint = ours(pixels, grids, attn_backend="cudnn_loop")
    start, row = 0, 0
    for t, h, w in grids.tolist():
        alone = ours(pixels[start:start + t * h * w], np.array([[t, h, w]]), attn_backend="cudnn_loop")
        assert rel_err(joint[row:row + alone.shape[0]].float(), alone.float()) < 2e-2
        start += t * h * w
        row += alone.shape[0]
