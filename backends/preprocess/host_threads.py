"""The host threads that preprocessing shares across every Preprocessor of a process: Pillow decodes
and resizes, which drop the GIL while they work. The JPEG scan check has its own C threads
(scan_check.THREADS), not this pool: a Python thread needs the GIL to start and to end each job, and a
check is short enough for that wait to matter."""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath


def available_cores(cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The cores this process may use: its CPU affinity (a container or taskset may give it fewer than
    the host has), else the host's count, and no more than its cgroup's CPU quota allows, rounded up (a
    Kubernetes CPU limit sets a quota, not an affinity: busy threads beyond it use the period's quota up
    sooner, and then every thread of the container waits for the next period). Per process: the quota
    covers the whole container, where several stubs each size their threads by it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs' worth of time per period that this process's cgroup, or any visible cgroup above it, may
    use (the smallest); None where none is set or nothing can be read (never raises: this runs as each
    stub imports). cgroup v2 (`cpu.max`: "<quota> <period>" or "max <period>") or v1
    (`cpu.cfs_quota_us`, -1 for none, and `cpu.cfs_period_us`). In a container with its own cgroup
    namespace the process's path is "/" and the files lie at the mount's top; a path that leaves the
    namespace ("/..") is not followed."""
    try:
        return _cgroup_cpu_quota(root, proc_cgroup)
    except Exception:  # noqa: BLE001 - e.g. a folder we may not search, a name that is not UTF-8
        return None


def _cgroup_cpu_quota(root: Path, proc_cgroup: Path) -> float | None:
    found = []
    for line in proc_cgroup.read_text(errors="replace").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if ".." in PurePosixPath(path).parts:
            continue
        if controllers == "":  # v2
            folders = [root]
        elif "cpu" in controllers.split(","):  # v1, mounted under one of its usual names
            names = (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu")
            folders = [root / name for name in names if (root / name).is_dir()][:1]
        else:
            continue
        for top in folders:
            here = top / path.lstrip("/")
            while True:  # this cgroup and every one above it, up to the mount's top
                found.append(_quota_in(here, v2=controllers == ""))
                if here == top:
                    break
                here = here.parent
    limits = [q for q in found if q is not None]
    return min(limits) if limits else None


def _quota_in(folder: Path, v2: bool) -> float | None:
    try:
        if v2:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        return None if quota < 0 else quota / int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None


CORES = available_cores()  # read once per process: the scan check's threads follow it too
THREADS = min(8, CORES)

_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    """The process-wide pool, started on first use (concurrent first calls must not each start one:
    idle threads never exit)."""
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="kimi-decode")
    return _POOL
