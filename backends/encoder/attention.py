"""Block-diagonal (varlen) attention over packed media: each image/chunk attends only to itself.

No dense L x L mask is ever built, and no backend reads the device: segment boundaries come from host
sequence lengths, `cu_seqlens` is already on the device and `max_seqlen` is a host int.

Backends:
- `fa4`: flash-attn-4's varlen kernel (CuTe DSL) when installed: fastest measured on Hopper.
- `cudnn_loop`: cuDNN SDPA per media slice; fastest built-in kernel for long sequences.
- `varlen`: `torch.nn.attention.varlen.varlen_attn` (flash varlen), one launch for the whole packed
  batch; best built-in for many short media.
- `sdpa_loop`: `F.scaled_dot_product_attention` per media slice, any device and dtype (CPU, fp32).
`pick_backend` chooses per forward from what is installed and the sequence lengths.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from backends.encoder.metadata import ForwardMetadata

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None

try:
    from flash_attn.cute import flash_attn_varlen_func as _fa4_varlen
except Exception:  # noqa: BLE001 - optional, GPU hosts only
    _fa4_varlen = None

BACKENDS = ("fa4", "cudnn_loop", "varlen", "sdpa_loop")

# Above this many tokens per media, cuDNN's kernel beats flash varlen (measured on an H200: 5476
# tokens 0.52 vs 0.75 ms), below it the single varlen launch wins for batches of small images.
_CUDNN_MIN_SEQLEN = 4096


def available_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    out = []
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        if _fa4_varlen is not None:
            out.append("fa4")
        out.append("cudnn_loop")
        if _varlen_attn is not None:
            out.append("varlen")
    out.append("sdpa_loop")
    return out


def fast_path_note(device: torch.device, dtype: torch.dtype) -> str | None:
    """One line for the start-up log where the fastest attention kernel is missing, naming what runs instead."""
    if device.type != "cuda" or _fa4_varlen is not None:
        return None
    if dtype not in (torch.bfloat16, torch.float16):
        return f"attention runs SDPA per media in {dtype} (flash-attn-4 takes bf16/fp16 only)"
    return ("flash-attn-4 is not installed: attention runs cuDNN per media (torch's flash varlen for batches of "
            "small media), and CUDA graphs are kept per grid list instead of per patch bucket; "
            "install docker/requirements-flash-attn4.txt for the fast path")


def pick_backend(device: torch.device, dtype: torch.dtype, meta: ForwardMetadata | None = None) -> str:
    options = available_backends(device, dtype)
    if options[0] == "fa4" or options == ["sdpa_loop"]:
        return options[0]
    if meta is not None and "varlen" in options and meta.max_seqlen < _CUDNN_MIN_SEQLEN and len(meta.seq_lens) > 1:
        return "varlen"
    return "cudnn_loop"


def _per_media(q, k, v, meta: ForwardMetadata, sdpa) -> torch.Tensor:
    out = torch.empty_like(q)
    start = 0
    for n in meta.seq_lens:
        sl = slice(start, start + n)
        # (L, H, D) -> (1, H, n, D): a strided view, no copy.
        out[sl] = sdpa(q[sl].transpose(0, 1)[None], k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None])[0].transpose(0, 1)
        start += n
    return out


@functools.lru_cache(maxsize=None)  # once per process, not per attention call
def _priority_kwargs(sdpa_kernel) -> dict:
    """{"set_priority": True} where torch's sdpa_kernel takes it (torch >= 2.7); older torch (the
    container's 2.5.1) has no priority control and keeps its own order."""
    try:
        return {"set_priority": True} if "set_priority" in inspect.signature(sdpa_kernel).parameters else {}
    except (TypeError, ValueError):  # a signature Python cannot read
        return {}


def _cudnn_sdpa(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # set_priority: cuDNN first, flash only where cuDNN cannot run. Without it the order is torch's
    # own, which puts cuDNN first only for a recent enough cuDNN (>= 9.15 on sm90): a tritonserver stub
    # that had loaded an older system cuDNN ran torch's flash kernel here, 0.66 against 0.44 ms per
    # layer for a 1024^2 image (docs/triton_runtime.md#the-embedded-server).
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], **_priority_kwargs(sdpa_kernel)):
        return F.scaled_dot_product_attention(q, k, v)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ForwardMetadata,
                     backend: str) -> torch.Tensor:
    """q, k, v: (L, H, D). Returns (L, H, D). Softmax scale 1/sqrt(D), non-causal."""
    if backend == "fa4":
        out = _fa4_varlen(q, k, v, cu_seqlens_q=meta.cu_seqlens, cu_seqlens_k=meta.cu_seqlens,
                          max_seqlen_q=meta.max_seqlen, max_seqlen_k=meta.max_seqlen)
        return out[0] if isinstance(out, tuple) else out
    if backend == "varlen":
        return _varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), meta.cu_seqlens, meta.cu_seqlens,
                            meta.max_seqlen, meta.max_seqlen)
    if backend == "cudnn_loop":
        return _per_media(q, k, v, meta, _cudnn_sdpa)
    if backend == "sdpa_loop":
        return _per_media(q, k, v, meta, F.scaled_dot_product_attention)
    raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
