"""Does nvJPEG's hardware decoder need its stream drained before each batch? Two probes, no Triton.

`HardwareJpegDecoder.decode_planes` waits on the host for its stream before every decode
(docs/jpeg_decoding.md#one-hardware-decode-at-a-time). This shows what goes wrong without that wait, by
running the same decoder with host waits on streams and events made no-ops (`--no-drain`). The JPEGs
are photo-like, as bench.perf sends (the committed runs of ba9738e used noise images):

- `--order`: each trial queues a long GPU sleep and then a sum over a buffer filled with 7s, frees the
  buffer (the caching allocator may hand the same block out again at once, stream-ordered), and
  decodes. A kernel handed that block would run after the sum; a decode that writes it earlier spoils
  the sum. Counts trials whose decode got the very block, and among them wrong sums.
- `--hang`: batches of eight 448^2 JPEGs decoded back to back on one decoder state for `--seconds`,
  each batch followed by a small kernel and never waited for, as the fused pipeline queued them. A
  batch not finished `--deadline` seconds after it was queued counts as a hang; the probe then stops
  at once (the stuck GPU work cannot be cancelled) with exit status 3.

    python -m tools.nvjpeg_order_probe --order --trials 200            # drained (the decoder as it is)
    python -m tools.nvjpeg_order_probe --order --trials 200 --no-drain
    python -m tools.nvjpeg_order_probe --hang --seconds 60 --no-drain
Exit status: 0 none wrong (`--order`: and the block was reused) or none stuck; 1 a wrong sum or no
reuse (`--order`); 3 a stuck batch (`--hang`). Needs a GPU with a hardware JPEG decoder (A100/H100 class).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

from backends.preprocess.nvjpeg import HardwareJpegDecoder, plane_bytes
from clients.samples import encode, photo_like

SLACK = 1 << 16  # decode_planes' room past the last plane: its buffer is planes + SLACK bytes


def jpeg(side: int, seed: int) -> bytes:
    """A photo-like side x side JPEG, quality 90 (Pillow's default 4:2:0), as bench.perf sends."""
    return encode(photo_like(side, side, seed=seed), "JPEG", quality=90)


@contextlib.contextmanager
def drained(drain: bool):
    """With drain False, host waits on streams and events do nothing: the decoder's wait for its stream
    and for its latest decode both (this probe keeps the bitstreams alive itself)."""
    if drain:
        yield
        return
    originals = torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize
    torch.cuda.Stream.synchronize = torch.cuda.Event.synchronize = lambda self: None
    try:
        yield
    finally:
        torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize = originals


def order_trial(dec: HardwareJpegDecoder, blob: bytes, info, stream: torch.cuda.Stream,
                sleep_cycles: int) -> tuple[bool, bool]:
    """(the decode got the freed block, the sum over it came out right)."""
    need = plane_bytes(info) + SLACK
    with torch.cuda.stream(stream):
        filler = torch.full((need,), 7, dtype=torch.uint8, device=stream.device)
        block = filler.data_ptr()
        torch.cuda._sleep(sleep_cycles)  # the sum below runs only after this
        total = filler.sum(dtype=torch.int64)
        del filler  # back to the allocator, reusable on this stream at once
        planes = dec.decode_planes([blob], [info])
        reused = planes.buffer.data_ptr() == block
    torch.cuda.synchronize()
    return reused, int(total) == 7 * need


def order(trials: int, drain: bool, sleep_cycles: int) -> int:
    dec = HardwareJpegDecoder(torch.device("cuda"))
    blob = jpeg(448, 0)
    info = dec.info(blob)
    stream = torch.cuda.Stream()
    reused = wrong = 0
    with drained(drain):
        for _ in range(trials):
            got_block, right = order_trial(dec, blob, info, stream, sleep_cycles)
            reused += got_block
            wrong += got_block and not right
    print(f"order, drain {'on' if drain else 'off'}: {trials} trials, the decode got the freed block in {reused}, "
          f"wrong sums among them: {wrong}")
    return 1 if wrong or not reused else 0


def hang(seconds: float, drain: bool, deadline: float) -> int:
    dec = HardwareJpegDecoder(torch.device("cuda"))
    blobs = [jpeg(448, seed) for seed in range(8)]
    infos = [dec.info(b) for b in blobs]
    stream = torch.cuda.Stream()
    queued: list[tuple[float, torch.cuda.Event]] = []
    batches, start = 0, time.monotonic()
    with drained(drain), torch.cuda.stream(stream):
        while time.monotonic() - start < seconds:
            planes = dec.decode_planes(blobs, infos)
            planes.buffer[:16].sum()  # a kernel after the decode, as the colour conversion follows it
            done = torch.cuda.Event()
            done.record(stream)
            queued.append((time.monotonic(), done))
            batches += 1
            while queued and queued[0][1].query():
                queued.pop(0)
            if queued and time.monotonic() - queued[0][0] > deadline:
                print(f"hang, drain {'on' if drain else 'off'}: a batch queued {deadline:.0f} s ago has not "
                      f"finished, after {batches} batches in {time.monotonic() - start:.1f} s; stopping", flush=True)
                os._exit(3)  # the stuck decode cannot be cancelled, and exiting normally would wait for it
            if len(queued) > 64:  # the host is far ahead: let the GPU catch up, with the same deadline
                time.sleep(0.001)
    while queued:
        if time.monotonic() - queued[0][0] > deadline:
            print(f"hang, drain {'on' if drain else 'off'}: stuck in the last batches after {batches}", flush=True)
            os._exit(3)
        if queued[0][1].query():
            queued.pop(0)
        else:
            time.sleep(0.001)
    print(f"hang, drain {'on' if drain else 'off'}: {batches} batches of 8 x 448^2 in {seconds:.0f} s, none stuck")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--order", action="store_true", help="does a decode write a block earlier work still reads")
    mode.add_argument("--hang", action="store_true", help="do back-to-back batches on one state ever stop")
    ap.add_argument("--no-drain", dest="drain", action="store_false", help="the decoder's host wait made a no-op")
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--sleep-cycles", type=int, default=20_000_000, help="GPU sleep before the sum (--order)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--deadline", type=float, default=10.0, help="seconds a batch may take (--hang)")
    args = ap.parse_args()
    if args.order:
        return order(args.trials, args.drain, args.sleep_cycles)
    return hang(args.seconds, args.drain, args.deadline)


if __name__ == "__main__":
    raise SystemExit(main())
