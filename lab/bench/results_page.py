"""The lab's results: one page per machine kind (lab/results/<kind>.md), each section rewritten whole by
the benchmark run that produces it. Current figures, not a diary: git keeps the history.

A section sits between `<!-- section: NAME -->` and `<!-- end: NAME -->`; writing it replaces what was
there (or appends it), and leaves the other sections as they are. lab/RESULTS.md indexes the figures
the docs quote by page and section.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def machine_kind(device: str) -> str:
    """'cpu', or the GPU's model in lower case (`NVIDIA H200` -> 'h200'), read from nvidia-smi so that
    the caller never creates a CUDA context of its own (a benchmark's server must come first)."""
    if device != "gpu":
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    name = out[0].strip() if out else "gpu"
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "tesla")]
    return words[0] if words else "gpu"


def _header(kind: str) -> str:
    return (f"# Results on {kind}\n\n"
            "Each section is rewritten whole by the benchmark run that names it (its command is its first line);\n"
            "lab/RESULTS.md says which figures the docs quote from where. Git keeps the history.\n")


def replace_section(page: str, name: str, body: str) -> str:
    """`page` with section `name` set to `body` (appended if the page has none)."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9_.^x-]*", name):
        raise ValueError(f"a section name is lower-case letters, digits and - _ . ^ x; got {name!r}")
    block = f"<!-- section: {name} -->\n## {name}\n\n{body.strip()}\n<!-- end: {name} -->\n"
    pattern = re.compile(rf"<!-- section: {re.escape(name)} -->\n.*?<!-- end: {re.escape(name)} -->\n", re.S)
    if pattern.search(page):
        return pattern.sub(lambda _: block, page, count=1)
    return page.rstrip("\n") + "\n\n" + block


def sections(page: str) -> dict[str, str]:
    """name -> body of every section of a page, in order."""
    found = re.finditer(r"<!-- section: (\S+) -->\n## \1\n\n(.*?)\n<!-- end: \1 -->\n", page, re.S)
    return {m.group(1): m.group(2) for m in found}


def merge(into: Path, pages: list[Path]) -> Path:
    """The sections of `pages` (e.g. what several calls on the GPU machine brought back, each with the
    sections it wrote) written into `into`, later pages winning; the other sections of `into` stay.
    Each call starts from the tree's page, so a page also carries the sections it did not write, as
    they were: only the sections a page changed against `into` as it was count."""
    page = into.read_text() if into.exists() else _header(into.stem)
    before = sections(page)
    for other in pages:
        for name, body in sections(other.read_text()).items():
            if before.get(name) != body:
                page = replace_section(page, name, body)
    into.write_text(page)
    return into


def report(text: str, device: str, section: str) -> None:
    """A benchmark's report: printed, and written to `section` of this machine's page when one is named."""
    print(text)
    if section:
        print(f"written to {write_section(device, section, text)}")


def write_section(device: str, name: str, body: str, results_dir: Path = RESULTS_DIR) -> Path:
    """Rewrite section `name` of this machine kind's page; returns the page's path."""
    kind = machine_kind(device)
    path = results_dir / f"{kind}.md"
    page = path.read_text() if path.exists() else _header(kind)
    results_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(replace_section(page, name, body))
    return path


if __name__ == "__main__":
    import sys

    usage = ("usage: python -m lab.bench.results_page merge INTO PAGE [PAGE ...]\n"
             "       python -m lab.bench.results_page section cpu|gpu NAME < BODY")
    if len(sys.argv) >= 4 and sys.argv[1] == "merge":
        print(merge(Path(sys.argv[2]), [Path(a) for a in sys.argv[3:]]))
    elif len(sys.argv) == 4 and sys.argv[1] == "section":  # a shell stage's summary (gpu.sh tests)
        print(write_section(sys.argv[2], sys.argv[3], sys.stdin.read()))
    else:
        raise SystemExit(usage)
