"""The rule `make image-test` and the CLI test hold the sample answer to (tests/readme_answer.py)."""

from tests.readme_answer import mismatch

README = "```\nimage embeds: shape (502, 256) float32, sum -14.633090, sha256 bc5dd8aed0cf8305\n```\n"


def answer(total: str, sha: str) -> str:
    return f"expanded length: 511 ids\nimage embeds: shape (502, 256) float32, sum {total}, sha256 {sha}\n"


def test_readmes_own_answer_passes():
    assert mismatch(answer("-14.633090", "bc5dd8aed0cf8305"), README) is None


def test_a_sum_moved_in_its_last_digits_by_another_order_of_additions_passes_with_any_checksum():
    assert mismatch(answer("-14.633067", "3d79e3631a05bb0d"), README) is None


def test_the_same_sum_with_another_checksum_fails():
    assert "sha256" in mismatch(answer("-14.633090", "3d79e3631a05bb0d"), README)


def test_a_sum_beyond_float32_rounding_fails():
    assert "sum is -14.6," in mismatch(answer("-14.6", "bc5dd8aed0cf8305"), README)


def test_an_answer_without_the_line_fails():
    assert "no 'image embeds" in mismatch("request failed: boom\n", README)
