"""2-D RoPE of q and k: the portable torch reference and an in-place fused QK Triton kernel (bf16/fp16 on
CUDA).

Reference: `apply_rope_portable` (view adjacent pairs as complex64, multiply by the per-token
rotation, cast back once; docs/kimi_k25.md#encoder). The kernel reproduces that arithmetic operation
for operation - fp32 loads of (re, im), the complex product with the roundings torch's complex
multiply has on the same device, one rounding to the input dtype - so its output is `torch.equal` to
the portable path, not merely close.

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


def apply_rope_portable(q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: (L, H, D); freqs: (L, D/2) complex64. Adjacent pairs (x[2j], x[2j+1]) are rotated in fp32.
    Returns new tensors in q's dtype."""
    def rotate(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs[:, None, :]).flatten(-2).to(x.dtype)

    return rotate(q), rotate(k)


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

    @triton.jit(do_not_specialize=["n_tokens"])  # random image sizes must not recompile
    def _rope_inplace_kernel(
        q_ptr, k_ptr, cs_ptr,
        n_tokens,
        q_stride_t, q_stride_h, k_stride_t, k_stride_h,
        HEAD_DIM: tl.constexpr, NUM_PAIRS: tl.constexpr, HEADS_CONTIGUOUS: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, CHUNKS: tl.constexpr, MASK_P: tl.constexpr,
        FMA: tl.constexpr,
    ):
        # A program owns BLOCK_T tokens and CHUNKS * BLOCK_P of each token's NUM_PAIRS = H * D / 2
        # complex pairs, in q and in k. A token's heads are one contiguous run in the QKV projection
        # (HEADS_CONTIGUOUS), so each chunk is a dense (BLOCK_T, BLOCK_P, 2) tile: one coalesced load,
        # split into real and imaginary parts in registers, one store. The rotation of pair p is entry
        # p % (D / 2) of the token's row in cs (L, D/2, 2); it is read once for q and k together.
        half: tl.constexpr = HEAD_DIM // 2
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]  # (T, 1, 1)
        tmask = tok < n_tokens
        tok = tok.to(tl.int64)  # int64: long videos overflow int32 offsets
        j = tl.arange(0, 2)[None, None, :]  # (1, 1, 2): real, imaginary
        for chunk in tl.static_range(CHUNKS):
            p = (tl.program_id(1) * CHUNKS + chunk) * BLOCK_P + tl.arange(0, BLOCK_P)[None, :, None]  # (1, P, 1)
            if MASK_P:
                mask = tmask & (p < NUM_PAIRS)
            else:
                mask = tmask
            if HEADS_CONTIGUOUS:
                q_off = tok * q_stride_t + 2 * p + j
                k_off = tok * k_stride_t + 2 * p + j
            else:
                head = (p // half).to(tl.int64)  # head * stride_h passes 2^31 for head-major q of ~2M tokens
                elem = 2 * (p % half) + j
                q_off = tok * q_stride_t + head * q_stride_h + elem
                k_off = tok * k_stride_t + head * k_stride_h + elem
            c, s = tl.split(tl.load(cs_ptr + tok * HEAD_DIM + 2 * (p % half) + j, mask=mask, other=0.0))
            _rotate_tile(q_ptr + q_off, mask, c, s, FMA)
            _rotate_tile(k_ptr + k_off, mask, c, s, FMA)

    @triton.jit
    def _rotate_tile(ptrs, mask, c, s, FMA: tl.constexpr):
        a, b = tl.split(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32))
        # (a + bi)(c + si), with the roundings of the portable path on this device.
        if FMA:  # CUDA's complex<float> multiply, contracted by nvcc: fma(a, c, -(b*s)), fma(a, s, b*c)
            re = tl.fma(a, c, -(b * s))
            im = tl.fma(a, s, b * c)
        else:  # ATen's CPU kernel: two rounded products, then the sum (needs fp fusion off)
            re = a * c - b * s
            im = a * s + b * c
        tl.store(ptrs, tl.join(re, im).to(ptrs.dtype.element_ty), mask=mask)


def _launch_shape(num_pairs: int, block_t: int, max_chunks: int = 3) -> tuple[dict, int]:
    """(kernel tile constants, programs per token tile) for a token's `num_pairs` pairs: the largest
    power of two dividing it (no masking; 576 = 64 x 9 for 16 heads x 72), else a masked power of
    two; chunks looped per program."""
    block_p = min(num_pairs & -num_pairs, 128)
    mask_p = block_p < 16
    if mask_p:
        block_p = min(triton.next_power_of_2(num_pairs), 128)
    n_chunks = triton.cdiv(num_pairs, block_p)
    # Loop over up to max_chunks chunks per program (the rotation row stays in L1); the rest go to the grid.
    chunks = next(c for c in range(max_chunks, 0, -1) if n_chunks % c == 0)
    return dict(BLOCK_T=block_t, BLOCK_P=block_p, CHUNKS=chunks, MASK_P=mask_p), n_chunks // chunks


def apply_rope_inplace(q: torch.Tensor, k: torch.Tensor, prepared: PreparedRope, block_t: int = 4,
                       max_chunks: int = 3, num_warps: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (L, H, D) in place; returns them. Strided views are fine (last stride 1).

    Defaults from an H200 sweep (27 x 12544 tokens x 16 x 72, kernels timed as a CUDA graph): 4 tokens
    per program, 3 chunks of 64 pairs looped per program, 2 warps: 0.908 ms, 1.18x the HBM floor (16
    tokens, 4 warps: 3.51x); docs/encoder.md#fused-rope. lab/bench/encoder_bench.py measures it again.

    How torch's complex64 multiply rounds depends on the device: CUDA's complex<float> operator* is
    contracted into FMAs (checked on an H200 with torch 2.11: 0 mismatches in 1.2M values, 59 for
    separately rounded products), ATen's CPU kernel rounds both products; the kernel follows q's
    device, so under Triton's CPU interpreter it equals the CPU reference."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    L, H, D = q.shape
    if k.shape != q.shape or q.dtype != k.dtype:
        raise ValueError(f"q and k must match: {tuple(q.shape)} {q.dtype} vs {tuple(k.shape)} {k.dtype}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the fused RoPE takes bf16/fp16, got {q.dtype}; fp32 uses the portable path")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a unit stride in the head dimension")
    cs = prepared.cos_sin
    if cs.device != q.device or cs.dtype != torch.float32 or not cs.is_contiguous():
        raise ValueError(f"the rotation table must be contiguous float32 on {q.device}, got {cs.dtype} on {cs.device}")
    if prepared.num_tokens != L or prepared.num_pairs * 2 != D:
        raise ValueError(f"rotation table is for {prepared.num_tokens} tokens x {2 * prepared.num_pairs} dims, "
                         f"q is {L} x {D}")
    if L == 0:
        return q, k
    fma = q.device.type == "cuda"
    tiles, chunk_programs = _launch_shape(H * D // 2, block_t, max_chunks)
    contiguous = (H == 1 or (q.stride(1) == D and k.stride(1) == D))
    grid = (triton.cdiv(L, block_t), chunk_programs)
    _rope_inplace_kernel[grid](
        q, k, prepared.cos_sin, L,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        HEAD_DIM=D, NUM_PAIRS=H * D // 2, HEADS_CONTIGUOUS=contiguous, **tiles,
        FMA=fma, enable_fp_fusion=fma, num_warps=num_warps,
    )
    return q, k
