"""Attention at the encoder's head dim (72) on the GPU: flash-attn-4 given 72 as it is, flash-attn-4 given
q, k, v copied into a buffer padded to 80 with zeros (scale 1/sqrt(72), the output cut back to 72, the
copies included in the time), cuDNN's SDPA per media and torch's flash varlen, on the encoder's sequence
shapes, 16 heads:

    one 1 x 3000^2 image (16,900 tokens), one 1 x 1024^2 (5,476), eight 448^2 (8 x 1,024)

Each row's output is compared with flash-attn-4 at 72 (max abs difference: 0 means bit-equal) and with
fp32 SDPA (max relative error). Head dims 64 and 80 at flash-attn-4's default are timed beside as the
kernel's own reference points. Throughput is useful TFLOP/s (4 * sum(n^2) * 72 * 16 per call). What the
tile sweep that stood here found is in docs/findings.md#attention-at-head-dim-72.

    python -m lab.bench.attention_tiles --section attention_tiles
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from backends.encoder.attention import available_backends, varlen_attention
from backends.encoder.metadata import ForwardMetadata
from backends.errors import first_line
from lab.bench.gpu_timing import cuda_time_ms, machine_line
from lab.bench.results_page import report

CASES = {"1x3000^2": [16900], "1x1024^2": [5476], "8x448^2": [1024] * 8}
HEADS, HEAD_DIM = 16, 72


def _inputs(lens, head_dim, gen):
    n = sum(lens)
    q, k, v = (torch.randn(n, HEADS, head_dim, device="cuda", generator=gen).bfloat16() for _ in range(3))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    return q, k, v, cu, max(lens)


def _fp32_reference(q, k, v, lens):
    out, start = [], 0
    for n in lens:
        s = slice(start, start + n)
        out.append(F.scaled_dot_product_attention(*(t[s].float().transpose(0, 1)[None] for t in (q, k, v)))[0]
                   .transpose(0, 1))
        start += n
    return torch.cat(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--section", default=None)
    args = ap.parse_args(argv)
    from flash_attn.cute.interface import _flash_attn_fwd

    def run(q, k, v, cu, maxlen):
        return _flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=maxlen, max_seqlen_k=maxlen)[0]

    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [machine_line(), "",
             "| case | attention | ms | TFLOP/s | vs flash-attn-4 at 72 | max abs diff vs it | max rel err vs fp32 |",
             "|---|---|---|---|---|---|---|"]
    for case, lens in CASES.items():
        q, k, v, cu, maxlen = _inputs(lens, HEAD_DIM, gen)
        flops = 4 * sum(n * n for n in lens) * HEAD_DIM * HEADS
        ref32 = _fp32_reference(q, k, v, lens)
        scale = ref32.abs().max().item()
        base = run(q, k, v, cu, maxlen)
        base_ms = cuda_time_ms(lambda: run(q, k, v, cu, maxlen), iters=args.iters)
        lines.append(f"| {case} | flash-attn-4 given head dim 72 | {base_ms:.3f} | {flops / base_ms / 1e9:.0f} | 1.00x | 0 | "
                     f"{(base.float() - ref32).abs().max().item() / scale:.2e} |")

        def row(label, fn):
            try:
                out = fn()
                ms = cuda_time_ms(fn, iters=args.iters)
            except Exception as exc:  # noqa: BLE001 - a configuration the kernel refuses is a result too
                lines.append(f"| {case} | {label} | failed: {type(exc).__name__}: {first_line(exc)[:80]} | | | | |")
                return
            lines.append(f"| {case} | {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | "
                         f"{base_ms / ms:.2f}x | {(out.float() - base.float()).abs().max().item():.2e} | "
                         f"{(out.float() - ref32).abs().max().item() / scale:.2e} |")

        def padded_to_80():
            buf = q.new_zeros((3, *q.shape[:-1], 80))
            for i, t in enumerate((q, k, v)):
                buf[i, ..., :HEAD_DIM].copy_(t)
            return _flash_attn_fwd(*buf.unbind(0), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=maxlen,
                                   max_seqlen_k=maxlen, softmax_scale=HEAD_DIM ** -0.5)[0][..., :HEAD_DIM]

        row("flash-attn-4 given q, k, v padded to 80 (copies included)", padded_to_80)
        meta = ForwardMetadata(grids=[], seq_lens=list(lens), max_seqlen=maxlen, cu_seqlens=cu, rope=None)
        for name in ("cudnn_loop", "varlen"):
            if name in available_backends(q.device, q.dtype):
                row(f"{name} (torch)", lambda: varlen_attention(q, k, v, meta, name))
        for hd in (64, 80):  # the kernel at head dims it was tuned around, same tokens
            q2, k2, v2, cu2, _ = _inputs(lens, hd, gen)
            ms = cuda_time_ms(lambda: run(q2, k2, v2, cu2, maxlen), iters=args.iters)
            lines.append(f"| {case} | flash-attn-4 given head dim {hd} | {ms:.3f} | "
                         f"{4 * sum(n * n for n in lens) * hd * HEADS / ms / 1e9:.0f} | | | |")
        torch.cuda.empty_cache()
    report("\n".join(lines), "gpu", args.section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
