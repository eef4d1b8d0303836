"""The pure parts of the encoder's bucketed CUDA graphs (backends/encoder/graphs.py): which buckets, how a
batch's padding is split into sequences, and the order buckets are captured in. The replays themselves
are held to the eager forward on the GPU (tests/gpu/test_encoder_graphs.py)."""

import math

import numpy as np
import pytest

from backends.encoder.graphs import bucket_sizes, capture_order, padded_cu_seqlens


def test_buckets_cover_every_patch_count_with_bounded_padding():
    sizes = bucket_sizes(16384)
    assert sizes[0] == 256 and sizes[-1] == 16384 and sizes == sorted(set(sizes))
    assert all(s % 64 == 0 for s in sizes)
    for n in range(1, 16385, 7):
        b = next(s for s in sizes if s >= n)
        if n <= 256:  # everything below the smallest bucket runs in it
            assert b == 256
            continue
        # steps of 64 at first, then about 1/16 of the bucket (rounded up to 64)
        assert b - n < max(64, b / 16 + 64), (n, b)
    assert sizes[sizes.index(5632) - 1] < 5476 <= 5632  # one 1024^2 image: 5,476 patches in 5,632


@pytest.mark.parametrize("seq_lens,bucket", [([1024, 256], 2048), ([256], 256), ([4], 256), ([100] * 32, 3520),
                                             ([5476], 5632)])
def test_padding_runs_as_short_sequences_of_its_own(seq_lens, bucket):
    num_seqs = 48
    cu = padded_cu_seqlens(seq_lens, bucket, num_seqs)
    assert cu.dtype == np.int32 and cu.shape == (num_seqs + 1,)
    m = len(seq_lens)
    assert cu[:m + 1].tolist() == [0, *np.cumsum(seq_lens).tolist()]  # the media as they are
    assert cu[-1] == bucket and np.all(np.diff(cu) >= 0)  # every row covered once, in order
    pieces = np.diff(cu[m:])
    assert pieces.max() <= math.ceil((bucket - sum(seq_lens)) / (num_seqs - m))  # split evenly: all short


def test_capture_order_takes_the_largest_first_then_coarse_to_fine():
    sizes = bucket_sizes(16384)
    order = capture_order(sizes)
    assert sorted(order) == sizes and order[0] == max(sizes)
    # After the first passes every size has a captured bucket at most 8 buckets above it.
    first = set(order[:len(sizes[::8]) + 1])
    for i, s in enumerate(sizes):
        assert any(b in first for b in sizes[i:i + 9]), s
