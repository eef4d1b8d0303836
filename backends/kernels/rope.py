"""In-place fused QK complex RoPE (Triton) for bf16/fp16 q, k on CUDA.

Reference: `backends.encoder.moonvit3d.apply_rope_portable` (view adjacent pairs as complex64, multiply
by the per-token rotation, cast back once). The kernel reproduces that arithmetic operation for
operation - fp32 loads of (re, im), the complex product with the same fused multiply-adds CUDA's
complex<float> multiply compiles to, one rounding to the input dtype - so its output is
`torch.equal` to the portable path on the GPU, not merely close.

Prepared once per encoder forward (`prepare_rope`): the rotation table as interleaved fp32 (cos, sin)
pairs, shared by all layers. The kernel reads q and k through their strides (token, head, 1), so it
works in place on the q/k views of the packed QKV projection: RoPE costs one read and one write of q
and k, and no extra copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton use the portable path
    triton = None


@dataclass(frozen=True)
class PreparedRope:
    """cos_sin: (L, D/2, 2) float32 contiguous, [..., 0] = cos, [..., 1] = sin."""

    cos_sin: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.cos_sin.shape[0]

    @property
    def num_pairs(self) -> int:
        return self.cos_sin.shape[1]


def prepare_rope(freqs: torch.Tensor) -> PreparedRope:
    """freqs: (L, D/2) complex64 rotations (the portable path's table) -> PreparedRope."""
    if not torch.is_complex(freqs):
        raise ValueError(f"prepare_rope takes the complex64 rotation table, got {freqs.dtype}")
    return PreparedRope(torch.view_as_real(freqs.to(torch.complex64)).contiguous())


if triton is not None:

    @triton.jit(do_not_specialize=["n_rows"])  # random image sizes must not recompile
    def _rope_inplace_kernel(
        q_ptr, k_ptr, cs_ptr,
        n_rows,
        q_stride_t, q_stride_h, k_stride_t, k_stride_h,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
        ARITH: tl.constexpr,
    ):
        # Rows are (token, head) pairs of q (program_id(1) == 0) or k (== 1); each row's HEAD_DIM values
        # are one contiguous, coalesced load. Element e pairs with e ^ 1 (its complex partner, read
        # again from L1), and uses the rotation (cos_j, sin_j) of pair j = e // 2.
        row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]  # (R, 1)
        e = tl.arange(0, BLOCK_D)[None, :]  # (1, D)
        mask = (row < n_rows) & (e < HEAD_DIM)
        tok = (row // NUM_HEADS).to(tl.int64)  # int64: long videos overflow int32 offsets
        head = row % NUM_HEADS
        if tl.program_id(1) == 0:
            base = q_ptr + tok * q_stride_t + head * q_stride_h
        else:
            base = k_ptr + tok * k_stride_t + head * k_stride_h
        x = tl.load(base + e, mask=mask, other=0.0).to(tl.float32)
        partner = tl.load(base + (e ^ 1), mask=mask, other=0.0).to(tl.float32)
        pair = tok * HEAD_DIM + (e // 2) * 2  # cos_sin is (L, D/2, 2): cos at 2j, sin at 2j + 1
        c = tl.load(cs_ptr + pair, mask=mask, other=0.0)
        s = tl.load(cs_ptr + pair + 1, mask=mask, other=0.0)
        even = (e % 2) == 0
        a = tl.where(even, x, partner)  # the pair's real part
        b = tl.where(even, partner, x)  # its imaginary part
        # (a + bi)(c + di), with the roundings of the portable path on this device (ARITH).
        if ARITH == 0:  # two rounded products, then the sum (needs fp fusion off)
            re = a * c - b * s
            im = a * s + b * c
        elif ARITH == 1:  # the first product fused: fma(a, c, -(b*d)), fma(a, d, b*c)
            re = tl.fma(a, c, -(b * s))
            im = tl.fma(a, s, b * c)
        else:  # the second product fused: fma(-b, d, a*c), fma(b, c, a*d)
            re = tl.fma(-b, s, a * c)
            im = tl.fma(b, c, a * s)
        tl.store(base + e, tl.where(even, re, im).to(base.dtype.element_ty), mask=mask)


# How torch's complex64 multiply rounds, per device type: ATen's CPU kernel rounds both products
# (ARITH 0); CUDA's complex<float> operator* is contracted by nvcc into FMAs (ARITH 1, checked on
# an H200 with torch 2.11: 0 mismatches for ARITH 1, 59 and 70 of 1.2M for 0 and 2, by
# tests/gpu/test_gpu_kernels.py, which tries all three).
PORTABLE_ARITH = {"cpu": 0, "cuda": 1}


def apply_rope_inplace(q: torch.Tensor, k: torch.Tensor, prepared: PreparedRope,
                       block_r: int = 64, arith: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (L, H, D) in place; returns them. Strided views are fine (last stride 1)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    L, H, D = q.shape
    if k.shape != q.shape or q.dtype != k.dtype:
        raise ValueError(f"q and k must match: {tuple(q.shape)} {q.dtype} vs {tuple(k.shape)} {k.dtype}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the fused RoPE takes bf16/fp16, got {q.dtype}; fp32 uses the portable path")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a unit stride in the head dimension")
    if prepared.num_tokens != L or prepared.num_pairs * 2 != D:
        raise ValueError(f"rotation table is for {prepared.num_tokens} tokens x {2 * prepared.num_pairs} dims, "
                         f"q is {L} x {D}")
    if L == 0:
        return q, k
    if arith is None:
        arith = PORTABLE_ARITH.get(q.device.type, 1)
    grid = (triton.cdiv(L * H, block_r), 2)
    _rope_inplace_kernel[grid](
        q, k, prepared.cos_sin, L * H,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        NUM_HEADS=H, HEAD_DIM=D, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(D),
        ARITH=arith, enable_fp_fusion=arith != 0,
    )
    return q, k
