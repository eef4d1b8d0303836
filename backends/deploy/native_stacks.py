"""Every thread's native stack of tritonserver and its Python-backend stubs, for a stall.

The fused model's watchdog (backends/serving/pipeline.py) writes its stub's Python stacks, but a thread
that waits inside python_backend or CUDA shows there only as the Python call it entered; where it waits,
and what the server's own threads do, needs native stacks (docs/triton_runtime.md, "The hang, found
and mended", where they found one).
With gdb on the machine (or cuda-gdb, which the GPU machine has instead and which attaches to any
process): `thread apply all bt` per process. Without either: each thread's name, state and kernel wait
channel from /proc, which at least tells a futex wait from a running thread.

    python -m backends.deploy.native_stacks --server-pid PID [--out FILE]   # a server and its live stubs
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from backends.deploy.supervisor import stub_processes


def server_and_stubs(server_pid: int) -> list[int]:
    """The server's pid, then its live stubs' (backends.deploy.supervisor finds them)."""
    return [server_pid, *sorted(stub_processes(server_pid).values())]


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        return f"({type(exc).__name__})"


def proc_threads(pid: int) -> str:
    """One line per thread: id, name, state, kernel wait channel."""
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError as exc:  # gone meanwhile
        return f"  ({type(exc).__name__})"
    lines = []
    for tid in tids:
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
            # cuda-gdb also lists the kernels resident on the GPU for this process: a kernel that never
            # ends shows there, where host stacks only show a thread waiting in a synchronize.
            extra = ["-ex", "info cuda kernels"] if Path(gdb).name == "cuda-gdb" else []
            out = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", *extra, "-ex", "thread apply all bt"],
                                 capture_output=True, text=True, timeout=timeout)
            return f"{head}\n{out.stdout}{out.stderr[-2000:]}"
        except (subprocess.TimeoutExpired, OSError) as exc:
            head += f"\n(gdb failed: {exc}; /proc instead)"
    return f"{head}\n{proc_threads(pid)}"


def debugger() -> str | None:
    """gdb, else cuda-gdb (a gdb with CUDA added; on the PATH or in CUDA's usual place), else None."""
    found = shutil.which("gdb") or shutil.which("cuda-gdb")
    if found is None and shutil.which("cuda-gdb", path="/usr/local/cuda/bin"):
        found = "/usr/local/cuda/bin/cuda-gdb"
    return found


def dump(pids: list[int], out: Path | None = None) -> str:
    """Writes to `out` (and returns) the report for `pids`, e.g. server_and_stubs(server.proc.pid)."""
    gdb = debugger()
    text = (f"native stacks ({Path(gdb).name if gdb else 'no gdb: /proc threads only'}), {len(pids)} process(es)\n"
            + "\n".join(stacks(pid, gdb) for pid in pids) + "\n")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-pid", type=int, required=True, help="tritonserver's pid")
    ap.add_argument("--out", type=Path, help="write here as well as to stdout")
    args = ap.parse_args(argv)
    sys.stdout.write(dump(server_and_stubs(args.server_pid), args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
