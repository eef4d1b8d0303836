"""`make test` from a fresh clone of a commit, timed, as CI runs it: set-up included (pip's cache warm).
CPU only: it writes the CPU page (CI's machines have no GPU).

    python -m lab.bench.fresh_clone [--rev HEAD] [--target test] [--section make-test]

Clones the repository into a temporary folder (only committed files travel), runs `make <target>` there,
and writes the wall time and pytest's last line into `--section` of this machine's results page. Exits
with make's status.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab.bench.results_page import write_section

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--target", default="test", help="the make target (default: test)")
    ap.add_argument("--section", default="make-test", help="the results page's section ('' writes none)")
    args = ap.parse_args(argv)
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="kimi-clone-") as tmp:
        clone = Path(tmp) / "repo"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", rev], check=True)
        t0 = time.monotonic()
        proc = subprocess.run(["make", args.target], cwd=clone, capture_output=True, text=True,
                              env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        wall = time.monotonic() - t0
    tail = [line for line in proc.stdout.splitlines() if " passed" in line or " failed" in line or "error" in line]
    text = "\n".join([f"$ python -m lab.bench.fresh_clone {' '.join(sys.argv[1:] if argv is None else argv)}",
                      f"{platform.node()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}: `make {args.target}` "
                      f"from a fresh clone of {rev}, set-up included: exit {proc.returncode}, "
                      "{} min {} s".format(*divmod(round(wall), 60)),
                      *(tail[-3:] or ["(no pytest summary line)"])])
    print(text)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", file=sys.stderr)
    if args.section:
        page = write_section("cpu", args.section, "```\n" + text + "\n```")
        print(f"written to {page}")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
