"""How the client hands back outputs, without a server (the server paths are in tests/integration)."""

import ml_dtypes
import numpy as np

from clients.kimi_client import KimiVisionClient


class _Result:
    def __init__(self, arrays):
        self.arrays = arrays

    def as_numpy(self, name):
        return self.arrays[name]


def test_bf16_embeddings_are_widened_to_float32_exactly():
    # tritonclient returns a BF16 output as ml_dtypes.bfloat16, which torch.from_numpy refuses.
    values = np.array([[1.5, -2.25], [2.0**-20, 65280.0]], np.float32)  # all exact in bfloat16
    bf16 = values.astype(ml_dtypes.bfloat16)
    for batched in (False, True):
        client = KimiVisionClient("127.0.0.1:1", batched=batched)  # never connects
        got = client._output(_Result({"IMAGE_EMBEDS": bf16[None] if batched else bf16}), "IMAGE_EMBEDS")
        assert got.dtype == np.float32 and np.array_equal(got, values)
        client.close()


def test_bf16_embeddings_come_as_their_bits_without_a_copy_when_asked():
    import torch

    values = np.array([[1.5, -2.25], [2.0**-20, 65280.0]], np.float32)
    bf16 = values.astype(ml_dtypes.bfloat16)
    client = KimiVisionClient("127.0.0.1:1", embeds_dtype="bf16")
    got = client._output(_Result({"IMAGE_EMBEDS": bf16}), "IMAGE_EMBEDS")
    assert got.dtype == np.uint16 and np.shares_memory(got, bf16)  # a view of what tritonclient returned
    # The bits are the float32's top halves (BF16's definition), and the result widens them exactly.
    assert np.array_equal(got, (values.view(np.uint32) >> 16).astype(np.uint16))
    from clients.kimi_client import VisionResult

    result = VisionResult(None, got, None, None)
    assert np.array_equal(result.embeds_float32(), values)
    assert torch.equal(result.embeds_torch().float(), torch.from_numpy(values))
    widened = VisionResult(None, values, None, None)
    assert result.checksum() == widened.checksum()  # the checksum does not depend on the form
    client.close()


def test_region_reads_give_bits_or_float32():
    from clients.kimi_client import _read_embeds

    values = np.array([[0.5, -3.0, 7.0]], np.float32)
    raw = np.zeros(64, np.uint8)
    raw[:6] = (values.view(np.uint32) >> 16).astype("<u2").view(np.uint8)
    assert np.array_equal(_read_embeds(raw, [1, 3], "BF16"), values)
    bits = _read_embeds(raw, [1, 3], "BF16", "bf16")
    assert bits.dtype == np.uint16 and not np.shares_memory(bits, raw)  # a copy: the region is written again
    assert np.array_equal((bits.astype(np.uint32) << 16).view(np.float32), values)


def test_embeds_dtype_is_checked():
    import pytest

    with pytest.raises(ValueError, match="embeds_dtype"):
        KimiVisionClient("127.0.0.1:1", embeds_dtype="fp16")
