"""What the launcher starts dies with it, even when the launcher itself is killed outright (SIGKILL, the
OOM killer, `make` giving up on a drain): no tritonserver, stub, /dev/shm region or rendered repository
outlives it. (An MPS daemon started with --mps is stopped by the launcher's own exit path only.)

The launcher's own stop does this in order (drain, kill, clean); this covers the case where it never
runs. A small process of its own session (`python -m backends.deploy.reaper`) reads from a pipe whose
only writer is the launcher: each server the launcher starts is announced on it ("group <pgid>",
"shm <prefix>", "dir <path>"), each server it stopped itself is taken back ("forget <pgid>"). When the pipe
ends (the launcher is gone, however it went), the reaper kills the process groups still announced (the
stubs exit with their server), removes the /dev/shm regions under the announced prefixes and the
announced folders. Tests and benchmarks,
which stop their servers themselves, do not start one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


class Reaper:
    """The launcher's side: starts the reaper and tells it what to clean up."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "backends.deploy.reaper"], stdin=subprocess.PIPE,
                                     text=True, start_new_session=True,
                                     cwd=Path(__file__).resolve().parents[2])

    def _say(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # the reaper is gone: nothing left to tell
            pass

    def track(self, pgid: int, shm_prefix: str) -> None:
        self._say(f"group {pgid}")
        if shm_prefix:
            self._say(f"shm {shm_prefix}")

    def remove_later(self, folder: Path) -> None:
        self._say(f"dir {folder}")

    def forget(self, pgid: int) -> None:
        self._say(f"forget {pgid}")

    def close(self) -> None:
        """The launcher is done: the reaper cleans what is still announced and exits."""
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=30)


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def reap(groups: set[int], prefixes: set[str], folders: set[str] = frozenset(), shm: Path = Path("/dev/shm"),
         wait_s: float = 5.0) -> None:
    """Kill the groups, wait for them to go (their stubs leave with them), remove the regions and folders."""
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait_s
    while any(_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    for prefix in prefixes:
        for region in shm.glob(f"{prefix}*"):
            region.unlink(missing_ok=True)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def watch(lines) -> tuple[set[int], set[str], set[str]]:
    """What is still announced when the stream ends: process groups, region prefixes, folders."""
    groups, prefixes, folders = set(), set(), set()
    for line in lines:
        kind, _, value = line.strip().partition(" ")
        if kind == "group":
            groups.add(int(value))
        elif kind == "forget":
            groups.discard(int(value))
        elif kind == "shm":
            prefixes.add(value)
        elif kind == "dir":
            folders.add(value)
    return groups, prefixes, folders


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the launcher is its to handle
    reap(*watch(sys.stdin))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
