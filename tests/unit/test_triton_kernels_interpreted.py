"""Our Triton kernels against their torch references, on CPU through Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess because the flag is read when kernels are defined).

- fused in-place RoPE vs the portable complex multiply;
- fused pad + normalize + patchify vs `pad_normalize_patchify` (bit for bit);
- JPEG chroma upsampling + YCbCr->RGB vs `ycc_to_rgb_reference` (bit for bit, row-strided planes too,
  and a batch of images in one launch).

On CPU the interpreter rounds fp32 -> bf16 by truncation, so bf16 is checked to one ulp here. The
RoPE's exact reference on CPU is the complex product written out with separately rounded products
(the kernel's non-FMA branch, taken for CPU tensors): torch's own CPU complex multiply is not one rounding rule (its vectorized body and scalar
tail differ; seen as a 1-ulp fp16 difference at a rounding midpoint), so against it we allow one ulp.
tests/gpu/test_gpu_kernels.py asserts torch.equal to the portable path for every dtype on the GPU.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import triton  # noqa: E402,F401 - pinned: its interpreter runs these kernels on CPU

ROOT = Path(__file__).resolve().parents[2]

CHECK = r"""
import torch
from backends.config import EncoderConfig
from backends.encoder.metadata import rope_angles_table
from backends.kernels.rope import apply_rope_inplace, apply_rope_portable, prepare_rope


def exact_cpu_rotate(x, freqs):
    # (a + bi)(c + si) with each product rounded to fp32, then one rounding to x's dtype.
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = xf[..., 0], xf[..., 1]
    c, s = freqs.real[:, None, :], freqs.imag[:, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2).to(x.dtype)


def check_rope(q, k, freqs, label):
    ref_q, ref_k = apply_rope_portable(q.clone(), k.clone(), freqs)
    exact_q, exact_k = exact_cpu_rotate(q, freqs), exact_cpu_rotate(k, freqs)
    apply_rope_inplace(q, k, prepare_rope(freqs))
    for got, exact, ref in ((q, exact_q, ref_q), (k, exact_k, ref_k)):
        eps = torch.finfo(q.dtype).eps
        if q.dtype == torch.float16:
            assert torch.equal(got, exact), label
        else:  # the interpreter truncates to bf16: one ulp
            torch.testing.assert_close(got, exact, rtol=eps, atol=1e-30)
        torch.testing.assert_close(got, ref, rtol=eps, atol=1e-30)


torch.manual_seed(0)
for tokens in (1, 37, 300):
    for head_dim in (72, 64, 128):
        heads = 16 if tokens < 300 else 4
        cfg = EncoderConfig(hidden_size=heads * head_dim, num_heads=heads)
        freqs = rope_angles_table(cfg, 20, 20)[:tokens]
        for dtype in (torch.float16, torch.bfloat16):
            qkv = torch.randn(tokens, 3, heads, head_dim).to(dtype)
            v_before = qkv[:, 2].clone()
            check_rope(qkv[:, 0], qkv[:, 1], freqs, (tokens, head_dim, dtype))  # in place inside qkv
            assert torch.equal(qkv[:, 2], v_before), "v must not be touched"

# Other layouts and sizes: heads not contiguous within a token (q, k, v interleaved per head), and a
# pair count (5 heads x 12 = 30 pairs) with no large power-of-two divisor (the masked tile).
for heads, head_dim, per_head_qkv in ((4, 72, True), (5, 12, False), (5, 12, True)):
    cfg = EncoderConfig(hidden_size=heads * head_dim, num_heads=heads)
    freqs = rope_angles_table(cfg, 7, 5)
    tokens = freqs.shape[0]
    shape = (tokens, heads, 3, head_dim) if per_head_qkv else (tokens, 3, heads, head_dim)
    qkv = torch.randn(shape).to(torch.float16)
    q, k = (qkv[:, :, 0], qkv[:, :, 1]) if per_head_qkv else (qkv[:, 0], qkv[:, 1])
    check_rope(q, k, freqs, (heads, head_dim, per_head_qkv))

from backends.config import MediaConfig
from backends.kernels.patchify import normalize_patchify, pad_normalize_patchify
from backends.preprocess.normalize import normalization_table
from backends.preprocess.resize_rule import navit_resize

media = MediaConfig(image_mean=(0.48, 0.46, 0.41), image_std=(0.27, 0.26, 0.28))
table = torch.from_numpy(normalization_table(media))
for w, h, t in [(30, 20, 1), (57, 41, 2), (28, 28, 1), (1, 1, 1), (100, 3, 4)]:
    plan = navit_resize(w, h, media, frames=t)
    img = torch.randint(0, 256, (t, h, w, 3), dtype=torch.uint8)
    shape = (plan.patch_size, plan.padded_height, plan.padded_width)
    ref = pad_normalize_patchify(img, table, *shape, torch.float32)
    assert torch.equal(normalize_patchify(img, table, *shape, torch.float32), ref), (w, h, t)
    # bf16: the interpreter truncates on conversion, so within one bf16 ulp here (exact on the GPU).
    got = normalize_patchify(img, table, *shape, torch.bfloat16)
    torch.testing.assert_close(got, ref.to(torch.bfloat16), rtol=torch.finfo(torch.bfloat16).eps, atol=1e-30)

from backends.kernels.jpeg_color import ycc_to_rgb_batch, ycc_to_rgb_reference

gen = torch.Generator().manual_seed(5)
for fx, fy in ((1, 1), (2, 1), (2, 2), (1, 2)):
    for h, w in ((1, 1), (3, 2), (2, 5), (7, 9), (33, 300), (20, 4)):
        dh, dw = -(-h // fy), -(-w // fx)
        y = torch.randint(0, 256, (h, w + 3), dtype=torch.uint8, generator=gen)[:, :w]  # a row pitch wider than w
        cb = torch.randint(0, 256, (dh, dw + 1), dtype=torch.uint8, generator=gen)[:, :dw]
        cr = torch.randint(0, 256, (dh, dw + 1), dtype=torch.uint8, generator=gen)[:, :dw]
        one = ycc_to_rgb_batch(y[None], cb[None], cr[None], fx, fy, block=64)[0]  # a batch of one image
        assert torch.equal(one, ycc_to_rgb_reference(y, cb, cr, fx, fy)), (fx, fy, h, w)
    # A batch as decode_planes lays it out: per image Y, Cb, Cr back to back in one buffer.
    h, w, n = 9, 14, 3
    dh, dw = -(-h // fy), -(-w // fx)
    size = h * w + 2 * dh * dw
    buf = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen)
    ys = buf.as_strided((n, h, w), (size, w, 1))
    cbs = buf.as_strided((n, dh, dw), (size, dw, 1), h * w)
    crs = buf.as_strided((n, dh, dw), (size, dw, 1), h * w + dh * dw)
    got = ycc_to_rgb_batch(ys, cbs, crs, fx, fy, block=8)
    for k in range(n):
        assert torch.equal(got[k], ycc_to_rgb_reference(ys[k], cbs[k], crs[k], fx, fy)), (fx, fy, k)

# GpuJpegDecoder.decode's runs, with the hardware decoder replaced by one that lays out random planes
# the way decode_planes does (per image Y, Cb, Cr back to back in one buffer): colour, gray and other
# sizes mixed, every image equal to the reference conversion of its own planes.
from collections import Counter
from types import SimpleNamespace

from backends.preprocess.jpeg_gpu import GpuJpegDecoder
from backends.preprocess.nvjpeg import DecodedPlanes, JpegInfo


class FakeHardware:
    def __init__(self, infos):
        self.infos, self.planes = infos, {}

    def info(self, blob):
        return self.infos[blob]

    def unsupported(self, blob, info):
        return None

    def decode_planes(self, datas, infos):
        sizes = [w * h for i in infos for w, h in zip(i.widths, i.heights)]
        buf = torch.randint(0, 256, (sum(sizes) + 5,), dtype=torch.uint8, generator=gen)[5:]  # a view with an offset
        starts, offset = [], 0
        for blob, info in zip(datas, infos):
            starts.append(offset)
            views = []
            for w, h in zip(info.widths, info.heights):
                views.append(buf[offset: offset + w * h].view(h, w))
                offset += w * h
            self.planes[blob] = views  # the reference reads each image's planes on its own
        return DecodedPlanes(buf, tuple(starts), tuple(infos))


kinds = {"420": JpegInfo(9, 5, 3, 2, (9, 5, 5), (5, 3, 3)), "444": JpegInfo(9, 5, 3, 0, (9, 9, 9), (5, 5, 5)),
         "gray": JpegInfo(9, 5, 1, 6, (9,), (5,)), "422": JpegInfo(7, 3, 3, 1, (7, 4, 4), (3, 3, 3))}
order = ["420", "420", "420", "gray", "gray", "420", "444", "444", "422", "420"]
blobs = [f"{k}{i}".encode() + b"\xff\xd9" for i, k in enumerate(order)]
hw = FakeHardware({b: kinds[k] for b, k in zip(blobs, order)})
dec = object.__new__(GpuJpegDecoder)
dec.decoder, dec.stats = hw, Counter()
images = [SimpleNamespace(size=(kinds[k].width, kinds[k].height)) for k in order]
# decode_async: these stand-in blobs are no JPEGs, so their scan checks (not asked here) would refuse them.
rgbs, pending = dec.decode_async(blobs, images)
assert sorted(pending) == list(range(len(order)))  # every decoded image awaits its check
for blob, k, rgb in zip(blobs, order, rgbs):
    y, *chroma = hw.planes[blob]
    info = kinds[k]
    want = (y.unsqueeze(-1).expand(-1, -1, 3) if info.factors is None
            else ycc_to_rgb_reference(y, chroma[0], chroma[1], *info.factors))
    assert torch.equal(rgb, want), k
assert dec.stats == Counter()  # counted only once their checks are settled

# Residual add + LayerNorm in one pass against the two torch ops: the sum equal, the norm within one ulp
# (bf16 truncated by the interpreter; the fp32 sums' order differs from torch's Welford loop).
from backends.kernels.add_norm import add_layernorm
for rows, width in ((1, 1152), (37, 1152), (5, 100)):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x, d = (torch.randn(rows, width) * 3).to(dtype), torch.randn(rows, width).to(dtype)
        w, b = torch.randn(width).to(dtype), torch.randn(width).to(dtype)
        s, y = add_layernorm(x, d, w, b, 1e-6)
        ref_s = x + d  # the rule restated: torch's add, then torch's LayerNorm of that sum
        ref_y = torch.nn.functional.layer_norm(ref_s, (width,), w, b, 1e-6)
        eps = torch.finfo(dtype).eps
        if dtype == torch.bfloat16:  # a truncated sum moves the whole row's norm: judge y against LN(s)
            torch.testing.assert_close(s, ref_s, rtol=eps, atol=1e-30)
            ref_y = torch.nn.functional.layer_norm(s, (width,), w, b, 1e-6)
        else:
            assert torch.equal(s, ref_s), (rows, width, dtype)
        scale = ref_y.float().abs().clamp_min(1.0)  # one ulp of the value, or of 1 near zero
        tol = 2 * eps if dtype != torch.float32 else 1e-5  # fp32: the sums' order shows in the last bits
        assert ((y.float() - ref_y.float()).abs() <= tol * scale).all(), (rows, width, dtype)
        assert not torch.equal(y, torch.zeros_like(y))
print("ok")
"""


def test_fused_kernels_match_their_references_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_prepare_rejects_a_real_valued_table():
    from backends.kernels.rope import prepare_rope

    with pytest.raises(ValueError, match="complex64"):
        prepare_rope(torch.randn(8, 36))


def test_rejects_fp32_and_mismatched_tables():
    from backends.kernels.rope import apply_rope_inplace, prepare_rope

    freqs = torch.polar(torch.ones(4, 36), torch.rand(4, 36))
    with pytest.raises(ValueError, match="bf16/fp16"):
        apply_rope_inplace(torch.zeros(4, 2, 72), torch.zeros(4, 2, 72), prepare_rope(freqs))
    with pytest.raises(ValueError, match="rotation table is for 4 tokens"):
        apply_rope_inplace(torch.zeros(5, 2, 72, dtype=torch.bfloat16), torch.zeros(5, 2, 72, dtype=torch.bfloat16),
                           prepare_rope(freqs))
    from backends.kernels.rope import PreparedRope

    q = torch.zeros(4, 2, 72, dtype=torch.bfloat16)
    table = prepare_rope(freqs).cos_sin
    for bad in (table.double(), table.transpose(0, 1).contiguous().transpose(0, 1)):  # float64; strided
        with pytest.raises(ValueError, match="contiguous float32"):
            apply_rope_inplace(q, q.clone(), PreparedRope(bad))
