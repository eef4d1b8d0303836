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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 37, 5476, 16900])
def test_fused_add_layernorm_against_the_two_torch_ops(rows, dtype):
    """The sum is torch's add exactly; the norm within one ulp of torch's LayerNorm (only the order of
    the fp32 sums differs)."""
    from backends.kernels.add_norm import add_layernorm

    torch.manual_seed(rows)
    x = (torch.randn(rows, 1152, device=DEV) * 4).to(dtype)
    delta = torch.randn(rows, 1152, device=DEV).to(dtype)
    w, b = torch.randn(1152, device=DEV).to(dtype), torch.randn(1152, device=DEV).to(dtype)
    s, y = add_layernorm(x, delta, w, b, 1e-5)
    ref_s = x + delta  # the rule restated: torch's add, then torch's LayerNorm of that sum
    ref_y = torch.nn.functional.layer_norm(ref_s, (1152,), w, b, 1e-5)
    assert torch.equal(s, ref_s)
    ulp = torch.finfo(dtype).eps * ref_y.float().abs().clamp_min(1.0)
    diff = (y.float() - ref_y.float()).abs()
    assert (diff <= ulp).all(), f"{(diff / ulp).max():.2f} ulp"
    assert (diff == 0).float().mean() > 0.9  # mostly the very same bits


def test_fc0_gelu_epilogue_is_the_tanh_form():
    """torch._addmm_activation(use_gelu=True), the encoder's fused fc0 + bias + GELU: in fp32 it equals
    the tanh GELU of the linear to fp32 accuracy and is measurably not the erf GELU; in bf16 nearly every
    value is within two ulps of the exact value, and its largest error is at most twice the unfused bf16
    path's (which rounds the linear's output before the GELU)."""
    torch.manual_seed(0)
    x = torch.randn(5476, 1152, device=DEV)
    w, b = torch.randn(4304, 1152, device=DEV) / 34, torch.randn(4304, device=DEV)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        fused = torch._addmm_activation(b, x, w.t(), use_gelu=True)
        lin = torch.nn.functional.linear(x, w, b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    tanh, erf = torch.nn.functional.gelu(lin, approximate="tanh"), torch.nn.functional.gelu(lin)
    torch.testing.assert_close(fused, tanh, rtol=1e-4, atol=1e-4)
    assert (fused - tanh).abs().max() < (erf - tanh).abs().max() / 4
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    got = torch._addmm_activation(bb, xb, wb.t(), use_gelu=True).float()
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(xb, wb, bb), approximate="tanh").float()
    exact = torch.nn.functional.gelu(torch.nn.functional.linear(xb.float(), wb.float(), bb.float()), approximate="tanh")
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-2)
    assert ((got - exact).abs() <= 2 * ulp + 1e-3).float().mean() > 0.999
    assert (got - ref).abs().max() <= (ref - exact).abs().max() * 2 + 1e-2


def test_the_position_table_resizes_inside_a_graph_capture():
    """Its weights are made by device kernels (no host-to-device copy), so a table made while a CUDA
    graph captures (a cache miss there) is the same table."""
    from backends.encoder.pos_resize import resize_table

    table = torch.randn(64, 64, 1152, device=DEV).to(torch.bfloat16)
    want = resize_table(table, 37, 74)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = resize_table(table, 37, 74)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def _variants(kernel) -> int:
    """Compiled variants of a Triton kernel on the current device."""
    caches = kernel.device_caches.get(torch.cuda.current_device())
    return len(caches[0]) if caches else 0


def test_preprocessing_kernels_compile_once_for_any_size_and_plane_offset():
    """Planes at offsets that are and are not 16-byte aligned, odd and even sizes (a 619 x 968 JPEG's
    first request once spent 210 ms compiling a variant): one compiled variant per kernel."""
    from backends.kernels import jpeg_color, patchify

    buf = torch.randint(0, 256, (1 << 21,), dtype=torch.uint8, device=DEV)
    table = torch.from_numpy(normalization_table(MediaConfig())).to(DEV)
    for kernel in (jpeg_color._ycc_rgb_kernel, patchify._patchify_kernel):  # forget what earlier tests compiled
        kernel.device_caches.clear()
    counts = []
    for (h, w), off in [((448, 448), 0), ((968, 619), 0), ((37, 53), 5), ((100, 101), 8), ((600, 800), 3)]:
        dh, dw = -(-h // 2), -(-w // 2)
        y = buf[off:off + h * w].view(1, h, w)
        cb = buf[off + h * w:off + h * w + dh * dw].view(1, dh, dw)
        cr = buf[off + h * w + dh * dw:off + h * w + 2 * dh * dw].view(1, dh, dw)
        rgb = jpeg_color.ycc_to_rgb_batch(y, cb, cr, 2, 2)
        assert torch.equal(rgb[0], jpeg_color.ycc_to_rgb_reference(y[0], cb[0], cr[0], 2, 2))
        frame = buf[off:off + h * w * 3].view(h, w, 3)
        ph, pw = -(-h // 14) * 14, -(-w // 14) * 14
        got = patchify.normalize_patchify(frame, table, 14, ph, pw, torch.bfloat16)
        assert torch.equal(got, patchify.pad_normalize_patchify(frame, table, 14, ph, pw, torch.bfloat16))
        counts.append((_variants(jpeg_color._ycc_rgb_kernel), _variants(patchify._patchify_kernel)))
    assert counts == [(1, 1)] * len(counts), counts


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
