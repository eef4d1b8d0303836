"""The encoder's flash-attn-4 call pads head dim 72 to 80 (backends/encoder/attention.py). flash-attn-4
needs a GPU, so here its varlen kernel is stood in for by the published rule it computes (softmax(q k^T *
scale) v per sequence, in fp32), and what is checked is ours: the padding, the scale, the cut back to 72,
and that q, k, v arriving already padded (the fused RoPE's rows) give the same answer."""

import pytest
import torch

from backends.encoder import attention
from backends.encoder.metadata import ForwardMetadata


def rule(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale):
    bounds = cu_seqlens_q.tolist()
    out = torch.empty_like(q)
    for a, b in zip(bounds, bounds[1:]):
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].double()) * softmax_scale
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[a:b].double()).to(q.dtype)
    return out, None


@pytest.fixture
def stand_in(monkeypatch):
    seen = []

    def kernel(q, k, v, **kw):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1], kw["softmax_scale"]))
        return rule(q, k, v, **kw)

    monkeypatch.setattr(attention, "_fa4_varlen", kernel)
    return seen


def case(lens, d=72, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k, v = torch.randn(n, 3, 4, d, generator=gen).unbind(1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, ForwardMetadata(grids=[], seq_lens=list(lens), max_seqlen=max(lens), cu_seqlens=cu, rope=None)


def test_head_dim_72_goes_to_the_kernel_as_80_and_comes_back_as_72(stand_in):
    q, k, v, meta = case([5, 9, 2])
    out = attention.varlen_attention(q, k, v, meta, "fa4")
    assert stand_in == [(80, 80, 80, 72 ** -0.5)]
    assert out.shape == q.shape
    expected, _ = rule(q, k, v, meta.cu_seqlens, meta.cu_seqlens, 9, 9, 72 ** -0.5)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    # and it is SDPA's answer (scale 1/sqrt(72)) per sequence
    sdpa = attention.varlen_attention(q, k, v, meta, "sdpa_loop")
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)


def test_rows_that_come_padded_are_not_padded_again(stand_in):
    q, k, v, meta = case([7, 3])
    padded = torch.nn.functional.pad(torch.stack((q, k, v)), (0, 8))
    out = attention.varlen_attention(*padded.unbind(0), meta, "fa4", head_dim=72)
    direct = attention.varlen_attention(q, k, v, meta, "fa4")
    assert stand_in == [(80, 80, 80, 72 ** -0.5)] * 2
    assert torch.equal(out, direct)


def test_a_multiple_of_16_is_passed_as_it_is(stand_in):
    q, k, v, meta = case([4, 4], d=64)
    attention.varlen_attention(q, k, v, meta, "fa4")
    assert stand_in == [(64, 64, 64, 64 ** -0.5)]


def test_padded_rows_of_the_wrong_width_and_padding_for_other_backends_are_refused(stand_in):
    q, k, v, meta = case([4])
    wide = torch.nn.functional.pad(q, (0, 24))
    with pytest.raises(ValueError, match="padded to 80"):
        attention.varlen_attention(wide, wide, wide, meta, "fa4", head_dim=72)
    with pytest.raises(ValueError, match="only fa4"):
        attention.varlen_attention(wide, wide, wide, meta, "sdpa_loop", head_dim=72)
    with pytest.raises(ValueError, match="must match"):  # q padded, v not
        attention.varlen_attention(wide, wide, v, meta, "fa4", head_dim=72)
