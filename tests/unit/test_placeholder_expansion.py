"""Placeholder expansion in id space, against a plain loop (the oracle) and the reference examples."""

import numpy as np
import pytest

from backends.errors import RequestError
from backends.placeholder import count_placeholders, expand_placeholders, placeholder_spans

PAD = 163605


def expand_by_loop(ids, pad, counts):
    """The obvious rebuild: walk the prompt, emit count copies for the i-th placeholder."""
    out, i = [], 0
    for tok in ids:
        if tok == pad:
            out.extend([pad] * counts[i])
            i += 1
        else:
            out.append(tok)
    assert i == len(counts)
    return out


def test_reference_example_from_sglang_tests():
    assert expand_placeholders([1, 7, 2, 7, 3], 7, [3, 2]).tolist() == [1, 7, 7, 7, 2, 7, 7, 3]


@pytest.mark.parametrize("num_images", [0, 1, 3, 8])
def test_matches_plain_loop_on_random_prompts(num_images):
    rng = np.random.default_rng(num_images)
    for _ in range(50):
        ids = rng.integers(0, 163840, size=400)
        ids[ids == PAD] = 0
        slots = rng.choice(400, size=num_images, replace=False)
        ids[slots] = PAD
        counts = rng.integers(1, 400, size=num_images).tolist()
        got = expand_placeholders(ids, PAD, counts)
        assert got.dtype == np.int64
        assert got.tolist() == expand_by_loop(ids.tolist(), PAD, counts)


def test_spans_place_each_images_tokens_in_prompt_order():
    rng = np.random.default_rng(7)
    for _ in range(30):
        n = int(rng.integers(1, 6))
        ids = rng.integers(0, 1000, size=60)
        ids[np.sort(rng.choice(60, size=n, replace=False))] = PAD
        counts = rng.integers(1, 20, size=n).tolist()
        expanded = expand_placeholders(ids, PAD, counts)
        spans = placeholder_spans(ids, PAD, counts)
        assert [e - s for s, e in spans] == counts
        mask = np.zeros(len(expanded), bool)
        for s, e in spans:
            assert (expanded[s:e] == PAD).all()
            mask[s:e] = True
        # Every placeholder position belongs to exactly one span, spans are ordered and disjoint.
        assert (expanded[~mask] != PAD).all()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_text_only_prompt_passes_through_unchanged():
    ids = np.array([5, 6, 7], np.int64)
    assert expand_placeholders(ids, PAD, []).tolist() == [5, 6, 7]
    assert expand_placeholders(np.zeros(0, np.int64), PAD, []).tolist() == []


@pytest.mark.parametrize("ids,images", [([1, PAD, 2], 2), ([1, PAD, PAD, 2], 1), ([1, 2], 1), ([PAD], 0)])
def test_count_mismatch_names_both_numbers(ids, images):
    with pytest.raises(RequestError) as err:
        expand_placeholders(ids, PAD, [4] * images)
    found = count_placeholders(ids, PAD)
    assert f"has {found} <|media_pad|>" in str(err.value)
    assert f"but {images} image(s)" in str(err.value)


def test_adjacent_placeholders_count_one_each():
    # The text path's regex would merge a run; the id path must not.
    assert count_placeholders([PAD, PAD, PAD], PAD) == 3
    assert expand_placeholders([PAD, PAD], PAD, [2, 1]).tolist() == [PAD] * 3


@pytest.mark.parametrize("bad", [np.zeros((2, 2), np.int64), np.array([1.5, 2.0]), np.array([-1, PAD])])
def test_malformed_ids_are_request_errors(bad):
    with pytest.raises(RequestError):
        expand_placeholders(bad, PAD, [1])


def test_placeholder_step_counts_one_placeholder_per_media():
    from backends.config import DEMO_CONFIG
    from backends.serving.steps import PlaceholderStep
    from clients.samples import encode, photo_like

    frames = [encode(photo_like(1200, 900, seed=s), "PNG") for s in range(2)]
    still = encode(photo_like(300, 200), "PNG")
    step = PlaceholderStep(DEMO_CONFIG)
    out = step(np.array([1, PAD, 2, PAD, 3]), frames + [still], media_frames=[2, 0])
    counts = out["IMAGE_TOKEN_COUNTS"].tolist()
    assert counts == [28 * 38, 88]  # the chunk is planned with the per-frame limit: grid (2, 56, 76)
    assert out["EXPANDED_IDS"].tolist() == expand_by_loop([1, PAD, 2, PAD, 3], PAD, counts)
    with pytest.raises(RequestError, match=r"has 2 <\|media_pad\|> placeholder token.s. .id 163605. but 3"):
        step(np.array([1, PAD, 2, PAD, 3]), frames + [still])  # without MEDIA_FRAMES: 3 images


def test_placeholder_step_from_counts_equals_the_step_from_images():
    """The ensemble's path (counts from kimi_preprocess) gives what a direct caller's images give."""
    from backends.config import DEMO_CONFIG
    from backends.serving.steps import PlaceholderStep, PreprocessStep
    from clients.samples import encode, photo_like

    images = [encode(photo_like(w, h, seed=w), "PNG") for w, h in ((300, 200), (57, 911), (1200, 900))]
    ids = np.array([5, PAD, 6, PAD, PAD, 7])
    step = PlaceholderStep(DEMO_CONFIG)
    from_images = step(ids, images)
    counts = PreprocessStep(DEMO_CONFIG)(images, input_ids=ids)["IMAGE_TOKEN_COUNTS"]
    from_counts = step(ids, token_counts=counts)
    assert from_counts["IMAGE_TOKEN_COUNTS"].tolist() == from_images["IMAGE_TOKEN_COUNTS"].tolist() == counts.tolist()
    assert from_counts["EXPANDED_IDS"].tolist() == expand_by_loop(ids.tolist(), PAD, counts.tolist())


@pytest.mark.parametrize("kwargs, match", [
    ({"images": [b"x"], "token_counts": np.array([4])}, "send IMAGES or IMAGE_TOKEN_COUNTS, not both"),
    ({}, "missing input: IMAGES"),
    ({"token_counts": np.array([4, 4])}, "has 1 <|media_pad|> placeholder token.s. .id 163605. but 2 image"),
    ({"token_counts": np.array([0])}, "at least one token"),
    ({"token_counts": np.array([1.5])}, "must be integers"),
    ({"token_counts": np.array([2 ** 62])}, "adds up to 4611686018427387904 tokens, more than max_patches=131072"),
    ({"token_counts": np.array([4]), "media_frames": np.array([0, 0])}, "MEDIA_FRAMES names 2 media"),
])
def test_placeholder_step_refuses_bad_counts(kwargs, match):
    from backends.config import DEMO_CONFIG
    from backends.serving.steps import PlaceholderStep

    with pytest.raises(RequestError, match=match):
        PlaceholderStep(DEMO_CONFIG)(np.array([1, PAD, 2]), **kwargs)


def test_preprocess_step_checks_the_prompt_before_reading_any_image():
    from backends.config import DEMO_CONFIG
    from backends.serving.steps import PreprocessStep

    step = PreprocessStep(DEMO_CONFIG)
    # Garbage bytes: had the step read them first, the error would name the image instead.
    with pytest.raises(RequestError, match=r"has 0 <\|media_pad\|> placeholder token.s. .id 163605. but 1 image") as err:
        step([b"not an image"], input_ids=np.array([1, 2, 3]))
    assert err.value.reason == "placeholder_mismatch"
    with pytest.raises(RequestError, match="image 0: not a decodable image"):
        step([b"not an image"], input_ids=np.array([1, PAD, 3]))
