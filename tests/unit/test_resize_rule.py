"""The navit resize rule against the table in docs/kimi_k25.md#resize-rule."""

import pytest

from backends.config import MediaConfig
from backends.preprocess.resize_rule import navit_resize

K25 = MediaConfig()


@pytest.mark.parametrize(
    "src,resized,pad,grid,tokens",
    [
        ((224, 224), (224, 224), (0, 0), (1, 16, 16), 64),
        ((640, 480), (640, 480), (4, 24), (1, 36, 46), 414),
        ((1024, 1024), (1024, 1024), (12, 12), (1, 74, 74), 1369),
        ((1920, 1080), (1920, 1080), (12, 12), (1, 78, 138), 2691),
        ((2048, 1536), (2048, 1536), (24, 4), (1, 110, 148), 4070),
        ((3000, 3000), (1794, 1794), (26, 26), (1, 130, 130), 4225),
        ((100000, 100), (7167, 7), (1, 21), (1, 2, 512), 256),
        ((1, 1), (1, 1), (27, 27), (1, 2, 2), 1),
    ],
)
def test_reference_table(src, resized, pad, grid, tokens):
    plan = navit_resize(*src, K25)
    assert (plan.width, plan.height) == resized
    assert (plan.pad_width, plan.pad_height) == pad
    assert plan.grid_thw == grid
    assert plan.num_tokens == tokens


def test_never_upscales_and_tokens_can_exceed_limit_over_four():
    plan = navit_resize(7080, 489, K25)
    assert plan.num_tokens == 4446  # the maximum a random search found (docs/kimi_k25.md#resize-rule)
    assert plan.grid_thw == (1, 36, 494)
    small = navit_resize(30, 20, K25)
    assert (small.width, small.height) == (30, 20)


def test_checkpoint_limits_change_the_rule():
    tight = MediaConfig(in_patch_limit=4096, patch_limit_on_one_side=64)
    # Side cap: scale = 64*14/3000, so 3000 -> 896 px = 64 patches exactly, no padding.
    plan = navit_resize(3000, 3000, tight)
    assert (plan.width, plan.height, plan.pad_width, plan.pad_height) == (896, 896, 0, 0)
    assert plan.grid_thw == (1, 64, 64) and plan.num_tokens == 1024


def test_largest_padded_patches_is_the_rules_maximum():
    """Checked against the per-size rule itself over every size of a small config (each side up to three
    times the per-side limit), and on K2.5's: attained, and above every sampled size."""
    import numpy as np

    from backends.preprocess.resize_rule import largest_padded_patches

    small = MediaConfig(in_patch_limit=64, patch_limit_on_one_side=16)
    side = 16 * small.patch_size
    brute = max(navit_resize(w, h, small).num_patches for w in range(1, 3 * side) for h in range(1, 3 * side))
    assert largest_padded_patches(small) == brute
    top = largest_padded_patches(K25)
    assert navit_resize(7081, 489, K25).num_patches == top == 17856  # above the 16,384 budget: padding
    assert navit_resize(3000, 3000, K25).num_patches == 16900
    rng = np.random.default_rng(0)
    for w, h in rng.integers(1, 3 * 512 * 14, size=(3000, 2)):
        assert navit_resize(int(w), int(h), K25).num_patches <= top
