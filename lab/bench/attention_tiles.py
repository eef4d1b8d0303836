"""flash-attn-4's forward at head dim 72 on SM90: its tile and scheduling options against its default.

flash-attn-4 picks one configuration for every head dim from 65 to 96 on Hopper (tiles of 192 x 144,
P.V from shared memory, intra-warpgroup overlap), tuned at 96. Head dim 72 is padded to 80, so its K and V
tiles are smaller than the ones the choice was made for: a wider tile_n (or a taller tile_m) may fit. This
sweeps `tile_mn`, `mma_pv_is_rs` and `intra_wg_overlap` through the private `_flash_attn_fwd` (the public
varlen function does not take them), on the encoder's sequence shapes, 16 heads x 72:

    one 1 x 3000^2 image (16,900 tokens), one 1 x 1024^2 (5,476), eight 448^2 (8 x 1,024)

flash-attn-4 also pads V's head dim to 80 (a multiple of 16, as it must for the K of Q.K^T), though P.V's
N may be any multiple of 8: the "V tile 72" rows build the kernel with V and O tiles of exactly 72
(patched into `FlashAttentionForwardSm90` for those rows only, its compile cache swapped aside), which
removes a tenth of P.V's MMA work if the kernel accepts the unswizzled 144-byte rows.

cuDNN's SDPA per media and torch's flash varlen, the encoder's other attention backends, are timed in
the same table. Each configuration's output is compared with the default's (max abs difference) and with fp32 SDPA (max
relative error); a configuration that fails to compile or run is reported and skipped. Head dims 64 and
80 at the default are timed beside as the kernel's own reference points. Throughput is useful TFLOP/s
(4 * sum(n^2) * 72 * 16 per call).

    python -m lab.bench.attention_tiles --section attention_tiles
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from backends.encoder.attention import available_backends, varlen_attention
from backends.encoder.metadata import ForwardMetadata
from backends.errors import first_line
from lab.bench.gpu_timing import cuda_time_ms, machine_line
from lab.bench.results_page import report

CASES = {"1x3000^2": [16900], "1x1024^2": [5476], "8x448^2": [1024] * 8}
HEADS, HEAD_DIM = 16, 72
# (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap); the first is flash-attn-4's own choice for 65..96.
CONFIGS = [(192, 144, False, True), (192, 128, False, True), (192, 160, False, True), (192, 176, False, True),
           (192, 192, False, True), (128, 128, True, True), (128, 160, True, True), (128, 192, True, True),
           (128, 128, False, True), (128, 176, False, True), (192, 144, False, False)]


# Configurations retried with V and O tiles of exactly 72 (see the module's docstring).
V72_CONFIGS = [(192, 144, False, True), (192, 128, False, True), (128, 128, True, True)]


@contextlib.contextmanager
def _v_tile_exact():
    """flash-attn-4's SM90 forward with tile_hdimv = head_dim_v (no padding of V/O to 16), for this block
    only: a fresh compile cache inside, the original class and cache restored after."""
    from flash_attn.cute import flash_fwd_sm90, interface
    from flash_attn.cute.cache_utils import JITCache

    cls, init, cache = flash_fwd_sm90.FlashAttentionForwardSm90, flash_fwd_sm90.FlashAttentionForwardSm90.__init__, \
        interface._flash_attn_fwd.compile_cache

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.check_hdim_v_oob and self.tile_hdimv == 80:  # head dim 72 padded: every input here is 72
            self.tile_hdimv, self.check_hdim_v_oob = HEAD_DIM, False

    cls.__init__ = patched
    interface._flash_attn_fwd.compile_cache = JITCache()  # in memory: never persists the patched kernel
    try:
        yield
    finally:
        cls.__init__ = init
        interface._flash_attn_fwd.compile_cache = cache


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

    def run(q, k, v, cu, maxlen, cfg=None):
        extra = {} if cfg is None else dict(tile_mn=cfg[:2], mma_pv_is_rs=cfg[2], intra_wg_overlap=cfg[3])
        return _flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=maxlen,
                               max_seqlen_k=maxlen, **extra)[0]

    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [machine_line(), "",
             "| case | tile_m x tile_n | P.V from registers | intra-WG overlap | ms | TFLOP/s | vs default | "
             "max abs diff vs default | max rel err vs fp32 |", "|---|---|---|---|---|---|---|---|---|"]
    for case, lens in CASES.items():
        q, k, v, cu, maxlen = _inputs(lens, HEAD_DIM, gen)
        flops = 4 * sum(n * n for n in lens) * HEAD_DIM * HEADS
        ref32 = _fp32_reference(q, k, v, lens)
        scale = ref32.abs().max().item()
        base = run(q, k, v, cu, maxlen)
        base_ms = cuda_time_ms(lambda: run(q, k, v, cu, maxlen), iters=args.iters)
        lines.append(f"| {case} | default | | | {base_ms:.3f} | {flops / base_ms / 1e9:.0f} | 1.00x | 0 | "
                     f"{(base.float() - ref32).abs().max().item() / scale:.2e} |")

        def row(label, cfg, fn=None):
            fn = fn or (lambda: run(q, k, v, cu, maxlen, cfg))
            try:
                out = fn()
                ms = cuda_time_ms(fn, iters=args.iters)
            except Exception as exc:  # noqa: BLE001 - a configuration the kernel refuses is a result too
                lines.append(f"| {case} | {label} | failed: "
                             f"{type(exc).__name__}: {first_line(exc)[:80]} | | | | |")
                return
            lines.append(f"| {case} | {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | "
                         f"{base_ms / ms:.2f}x | {(out.float() - base.float()).abs().max().item():.2e} | "
                         f"{(out.float() - ref32).abs().max().item() / scale:.2e} |")

        for cfg in CONFIGS:
            row(f"{cfg[0]} x {cfg[1]} | {cfg[2]} | {cfg[3]}", cfg)
        with _v_tile_exact():
            for cfg in V72_CONFIGS:
                row(f"{cfg[0]} x {cfg[1]}, V tile 72 | {cfg[2]} | {cfg[3]}", cfg)
        # The other exact kernels at the same shapes, through the encoder's own dispatch (per media cuDNN,
        # torch's flash varlen): the ceiling of every candidate in one table.
        meta = ForwardMetadata(grids=[], seq_lens=list(lens), max_seqlen=maxlen, cu_seqlens=cu, rope=None)
        for name in ("cudnn_loop", "varlen"):
            if name in available_backends(q.device, q.dtype):
                row(f"{name} (torch) | | ", None, lambda: varlen_attention(q, k, v, meta, name))
        for hd in (64, 80):  # the kernel at head dims it was tuned around, same tokens
            q2, k2, v2, cu2, _ = _inputs(lens, hd, gen)
            ms = cuda_time_ms(lambda: run(q2, k2, v2, cu2, maxlen), iters=args.iters)
            lines.append(f"| {case} | default, head dim {hd} | | | {ms:.3f} | "
                         f"{4 * sum(n * n for n in lens) * hd * HEADS / ms / 1e9:.0f} | | | |")
        torch.cuda.empty_cache()
    report("\n".join(lines), "gpu", args.section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
