"""Which inputs take the encoder's fused passes, and the reference everywhere else (the kernels' own
numbers are checked against torch under Triton's interpreter and on the GPU)."""

import numpy as np
import pytest
import torch

from backends.config import EncoderConfig
from backends.encoder.metadata import rope_angles_table
from backends.encoder.moonvit3d import Kernels
from backends.kernels import add_norm


def test_fused_kernels_take_only_contiguous_rows_and_parameters():
    x, d = torch.zeros(4, 8), torch.zeros(4, 8)
    w, b = torch.ones(8), torch.zeros(8)
    if add_norm.triton is None:
        pytest.skip("triton is not installed")
    assert add_norm.fusable(x, d, w, b)
    assert not add_norm.fusable(x, d, torch.ones(16)[::2], b)  # a strided weight
    assert not add_norm.fusable(x, d, None, None)  # LayerNorm without affine parameters
    assert not add_norm.fusable(x, d, torch.ones(7), torch.zeros(7))
    assert not add_norm.fusable(x.t(), d.t(), torch.ones(4), torch.zeros(4))  # non-contiguous rows
    assert not add_norm.fusable(x, d.half(), w, b)
    with pytest.raises(ValueError, match="contiguous"):
        add_norm.add_layernorm(x, d, torch.ones(16)[::2], b, 1e-5)


@pytest.mark.parametrize("fused", [None, True, False])
def test_fused_kernels_apply_only_to_half_precision_on_cuda(fused):
    """fused=True means "wherever the fused kernels apply": on CPU, or in fp32, it is the reference."""
    freqs = rope_angles_table(EncoderConfig(hidden_size=64, num_heads=2), 4, 4)
    for device, dtype in ((torch.device("cpu"), torch.bfloat16), (torch.device("cpu"), torch.float32)):
        kernels = Kernels(freqs, device, dtype, fused)
        assert not kernels.fused and kernels.prepared is None
        q, k = torch.randn(16, 2, 32).to(dtype), torch.randn(16, 2, 32).to(dtype)
        kernels.rope(q, k)  # the portable rotation, no error


def test_a_model_asked_for_fused_kernels_on_cpu_gives_the_reference_answer():
    from backends.checkpoint.seeded import seeded_model
    from backends.config import DEMO_CONFIG

    model = seeded_model(DEMO_CONFIG.encoder)
    grids = np.array([[1, 8, 12]])
    pixels = torch.randn(96, 3, 14, 14, generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(pixels, grids, fused=True), model(pixels, grids, fused=False))
