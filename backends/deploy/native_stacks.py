"""Every thread's native stack of tritonserver and its Python-backend stubs, for a stall.

The fused model's watchdog (backends/serving/pipeline.py) writes its stub's Python stacks, but a thread
that waits inside python_backend or CUDA shows there only as the Python call it entered; where it waits,
and what the server's own threads do, needs native stacks (docs/triton_runtime.md, "Open question").
With gdb on the machine: `thread apply all bt` per process. Without it: each thread's name, state and
kernel wait channel from /proc, which at least tells a futex wait from a running thread.

    python -m backends.deploy.native_stacks [--out FILE]   # every tritonserver and stub process of this user
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

NAMES = (b"tritonserver", b"triton_python_backend_stub")


def server_pids() -> list[int]:
    """tritonserver and stub processes, by their command lines."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            argv0 = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if os.path.basename(argv0) in NAMES:
            pids.append(int(entry))
    return sorted(pids)


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        return f"({type(exc).__name__})"


def proc_threads(pid: int) -> str:
    """One line per thread: id, name, state, kernel wait channel."""
    lines = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        base = f"/proc/{pid}/task/{tid}"
        stat = _read(f"{base}/stat")
        state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
        lines.append(f"  {tid} {_read(f'{base}/comm')!r} state {state} wchan {_read(f'{base}/wchan') or '0'}")
    return "\n".join(lines)


def stacks(pid: int, gdb: str | None, timeout: float = 60.0) -> str:
    cmdline = _read(f"/proc/{pid}/cmdline").replace("\0", " ")[:300]
    head = f"== pid {pid}: {cmdline}"
    if gdb:
        try:
            out = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt"],
                                 capture_output=True, text=True, timeout=timeout)
            return f"{head}\n{out.stdout}{out.stderr[-2000:]}"
        except (subprocess.TimeoutExpired, OSError) as exc:
            head += f"\n(gdb failed: {exc}; /proc instead)"
    return f"{head}\n{proc_threads(pid)}"


def dump(out: Path | None = None, pids: list[int] | None = None) -> str:
    """Writes (and returns) the report for `pids` (default: every server and stub process)."""
    gdb = shutil.which("gdb")
    pids = server_pids() if pids is None else pids
    text = (f"native stacks ({'gdb' if gdb else 'no gdb: /proc threads only'}), {len(pids)} process(es)\n"
            + "\n".join(stacks(pid, gdb) for pid in pids) + "\n")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write here as well as to stdout")
    args = ap.parse_args(argv)
    sys.stdout.write(dump(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
