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
