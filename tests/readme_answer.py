"""Whether an answer to `make run`'s sample request is the one README.md states.

Used by the ensemble's integration test and by `make image-test` (docker/build_and_run.sh), so the
server and the container are held to one rule. torch's CPU kernels add in another order on CPUs with
other vector units (AVX-512 against AVX2), which moves the embeddings' sum in its last digits and
changes the checksum. So: the sum must agree with README's to float32 rounding everywhere (1e-5
relative), and where it equals README's to the last printed digit (the same order of additions),
the sha256 must be README's too.

    python -m tests.readme_answer ANSWER_FILE   # exit 1 with the reason when it is not
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^image embeds: shape \(502, 256\) float32, sum (\S+), sha256 ([0-9a-f]+)", re.M)
REL_TOL = 1e-5


def readme_answer(readme: str) -> tuple[str, str]:
    """README's (sum, sha256) for the sample request, as printed."""
    found = LINE.search(readme)
    if not found:
        raise ValueError("README.md states no 'image embeds: shape (502, 256) float32, sum S, sha256 H' line")
    return found.group(1), found.group(2)


def mismatch(answer: str, readme: str) -> str | None:
    """None when `answer` (the client's printout) is README's answer; else what differs."""
    want_sum, want_sha = readme_answer(readme)
    found = LINE.search(answer)
    if not found:
        return "the answer has no 'image embeds: shape (502, 256) float32, sum S, sha256 H' line"
    got_sum, got_sha = found.groups()
    if abs(float(got_sum) - float(want_sum)) > REL_TOL * abs(float(want_sum)):
        return f"the embeddings' sum is {got_sum}, README.md's is {want_sum} (more than {REL_TOL:g} relative apart)"
    if got_sum == want_sum and got_sha != want_sha:
        return f"the sum is README.md's ({want_sum}) but the sha256 is {got_sha}, README.md's is {want_sha}"
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.readme_answer ANSWER_FILE", file=sys.stderr)
        return 2
    problem = mismatch(Path(argv[0]).read_text(), (ROOT / "README.md").read_text())
    if problem:
        print(f"not README.md's answer: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
