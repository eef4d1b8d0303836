"""The position table's resize (backends/encoder/pos_resize.py) against torch's own bicubic interpolation,
the rule the reference calls: F.interpolate(mode="bicubic", align_corners=False)."""

import pytest
import torch
import torch.nn.functional as F

from backends.encoder.pos_resize import cubic_weights, resize_table


def reference(table: torch.Tensor, h: int, w: int) -> torch.Tensor:
    out = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bicubic", align_corners=False)
    return out[0].permute(1, 2, 0)


SIZES = [(64, 64), (8, 8), (37, 74), (1, 3), (3, 1), (74, 74), (36, 496), (128, 5), (63, 65)]


@pytest.mark.parametrize("h,w", SIZES)
def test_float64_equals_torchs_bicubic_to_rounding(h, w):
    table = torch.randn(64, 64, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(h * 1000 + w))
    got, want = resize_table(table, h, w), reference(table, h, w)
    assert got.shape == want.shape == (h, w, 16)
    assert (got - want).abs().max().item() < 1e-12


@pytest.mark.parametrize("h,w", SIZES)
def test_bfloat16_is_the_rules_value_rounded_once(h, w):
    """A bf16 table: each value is the rule's exact value (torch's bicubic of the table in float64) rounded
    to bf16, at most half a bf16 step away."""
    table = (torch.randn(64, 64, 32, generator=torch.Generator().manual_seed(7)) * 0.1).to(torch.bfloat16)
    got = resize_table(table, h, w)
    assert got.dtype == torch.bfloat16
    exact = reference(table.double(), h, w)
    half_step = exact.abs().clamp_min(2.0 ** -126) * 2.0 ** -8  # half of bf16's step at each value, at most
    assert ((got.double() - exact).abs() <= half_step).all()


def test_weights_sum_to_one_and_the_same_size_is_the_identity():
    for n_in, n_out in ((64, 37), (8, 100), (5, 5)):
        assert (cubic_weights(n_in, n_out).sum(dim=1) - 1).abs().max() < 1e-12
    assert torch.equal(cubic_weights(9, 9), torch.eye(9, dtype=torch.float64))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        cubic_weights(0, 4)
