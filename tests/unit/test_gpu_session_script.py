"""tools/gpu_session.sh only runs on the GPU machine, where a syntax error or a renamed stage costs a
device call: here bash parses it, and every stage that the README and bench/RESULTS.md tell a reader to
run must be one of its cases. (The results pages record the commands of their day, stages since
removed included, and are left as they are.)"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_session.sh"


def stages() -> set[str]:
    return set(re.findall(r"^    ([a-z0-9]+)\)", SCRIPT.read_text(), re.M))


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_stage_the_docs_tell_a_reader_to_run_exists():
    known = stages()
    assert {"tests", "stages", "perfanalyzer", "soak", "mps", "cpulat"} <= known, known
    named = set()
    for path in (ROOT / "README.md", ROOT / "bench" / "RESULTS.md"):
        for args in re.findall(r"`(?:[A-Z_]+=\S+ )*bash tools/gpu_session\.sh ([a-z0-9 ]+)`", path.read_text()):
            named.update(args.split())
    assert named, "the README names no stage at all: the pattern above no longer matches it"
    assert named <= known, f"named but not in the script: {sorted(named - known)}"


def _a_git_work_tree() -> bool:
    return shutil.which("git") is not None and subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--is-inside-work-tree"], capture_output=True).returncode == 0


@pytest.mark.skipif(shutil.which("bash") is None or not _a_git_work_tree(), reason="no bash, or not a git checkout")
def test_the_before_after_script_parses_and_prepares(tmp_path):
    """tools/stages_ab.sh also runs only on the GPU machine; its `prepare` half runs here."""
    script = ROOT / "tools" / "stages_ab.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    subprocess.run(["bash", str(script), "prepare", "HEAD", "contract/__init__.py"], cwd=repo, check=True)
    assert (repo / ".whl" / "before" / "FILES").read_text().split() == ["./contract/__init__.py"]
    assert (repo / ".whl" / "before" / "contract" / "__init__.py").read_bytes() == (repo / "contract" / "__init__.py").read_bytes()
    done = subprocess.run(["bash", str(script), "run"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2 and "nothing prepared" in done.stdout
