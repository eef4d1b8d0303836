"""Tokenizer-free `<|media_pad|>` expansion in id space (docs/kimi_k25.md#expansion-in-id-space).

The prompt carries exactly one placeholder per image; the LLM needs one per image *token*. Expanding
ids directly (mask + repeat) is exact, whereas decode -> replace -> re-tokenize can change the prompt
length by one (Kimi's tokenizer is not bijective on arbitrary id sequences).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from backends.errors import RequestError


def _as_ids(input_ids) -> np.ndarray:
    ids = np.asarray(input_ids)
    if ids.ndim != 1:
        raise RequestError(f"INPUT_IDS must be 1-D, got shape {list(ids.shape)}", "bad_ids")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise RequestError(f"INPUT_IDS must be integers, got {ids.dtype}", "bad_ids")
    ids = ids.astype(np.int64, copy=False)
    if ids.size and ids.min() < 0:
        raise RequestError(f"INPUT_IDS must be non-negative, found {int(ids.min())} at position {int(ids.argmin())}", "bad_ids")
    return ids


def count_placeholders(input_ids, media_pad_id: int) -> int:
    """Number of `<|media_pad|>` tokens in a 1-D id sequence."""
    return int(np.count_nonzero(_as_ids(input_ids) == media_pad_id))


def check_one_placeholder_per_image(input_ids, media_pad_id: int, num_images: int, what: str = "image(s)") -> np.ndarray:
    """Validate the strict 1:1 rule and return the ids as int64. Runs before any image is decoded."""
    ids = _as_ids(input_ids)
    found = int(np.count_nonzero(ids == media_pad_id))
    if found != num_images:
        raise RequestError(
            f"the prompt has {found} <|media_pad|> placeholder token(s) (id {media_pad_id}) but {num_images} "
            f"{what} were sent; each image (or video chunk) needs exactly one placeholder in INPUT_IDS",
            "placeholder_mismatch",
        )
    return ids


def expand_placeholders(input_ids, media_pad_id: int, token_counts: Sequence[int]) -> np.ndarray:
    """Repeat the i-th placeholder `token_counts[i]` times; every other id is kept as it is.

    input_ids: (L,) integer ids with exactly len(token_counts) placeholders.
    Returns (L - n + sum(token_counts),) int64.
    """
    ids = check_one_placeholder_per_image(input_ids, media_pad_id, len(token_counts))
    counts = np.asarray(token_counts, dtype=np.int64).reshape(-1)
    if counts.size and counts.min() < 1:
        raise RequestError(f"every image must produce at least one token, got counts {counts.tolist()}", "bad_counts")
    repeats = np.ones(ids.shape[0], dtype=np.int64)
    repeats[ids == media_pad_id] = counts
    return np.repeat(ids, repeats)


def placeholder_spans(input_ids, media_pad_id: int, token_counts: Sequence[int]) -> list[tuple[int, int]]:
    """Half-open [start, end) of each image's tokens in the *expanded* sequence, in prompt order."""
    ids = check_one_placeholder_per_image(input_ids, media_pad_id, len(token_counts))
    positions = np.flatnonzero(ids == media_pad_id)
    counts = np.asarray(token_counts, dtype=np.int64)
    # Each earlier image shifts later positions by (count - 1).
    shift = np.concatenate([[0], np.cumsum(counts - 1)[:-1]]) if counts.size else counts
    starts = positions + shift
    return [(int(s), int(s + c)) for s, c in zip(starts, counts)]
