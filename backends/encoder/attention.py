"""Block-diagonal (varlen) attention over packed media: each image/chunk attends only to itself.

Backends, fastest correct first:
- `varlen`: `torch.nn.attention.varlen.varlen_attn` (flash varlen on CUDA, bf16/fp16) - one launch for
  the whole packed batch, cu_seqlens on the device and max_seqlen from the host.
- `sdpa_loop`: `F.scaled_dot_product_attention` per media slice (CPU, fp32, or anything else). Slices
  come from host sequence lengths, so there is no device read and no dense L x L mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.encoder.metadata import ForwardMetadata

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None


def pick_backend(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _varlen_attn is not None:
        return "varlen"
    return "sdpa_loop"


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ForwardMetadata,
                     backend: str) -> torch.Tensor:
    """q, k, v: (L, H, D). Returns (L, H, D). Softmax scale 1/sqrt(D), non-causal."""
    if backend == "varlen":
        return _varlen_attn(q, k, v, meta.cu_seqlens, meta.cu_seqlens, meta.max_seqlen, meta.max_seqlen)
    out = torch.empty_like(q)
    start = 0
    for n in meta.seq_lens:
        sl = slice(start, start + n)
        # (H, n, D) per media
        out[sl] = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1)
        ).transpose(0, 1)
        start += n
    return out
