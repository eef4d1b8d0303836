"""Keeps every CPU busy at the lowest scheduling class, so that no core goes idle, for as long as it runs.

Why: a server stub sleeps while the encoder runs (about 20 ms a request) and then has a few
milliseconds of Python to do. A core that went idle meanwhile (on a VM: a vCPU that halted, so the
host could put its physical core into a deep sleep state and lower its clock) wakes late and runs the
first milliseconds slower. The kernel's own answer is the PM QoS limit (cpu_latency.py), which needs
root and an idle governor to read it; a guest without an idle driver has none. This is the same effect
from user space, without privileges: one process per CPU, pinned to it, under SCHED_IDLE, spinning.
SCHED_IDLE work yields the core at once to any normal thread that wakes there, and the scheduler counts
such a core as idle when it places a waking thread, so the server's threads lose nothing but the wake.

The cost is plain: every spun core draws full power all the time, and on a hyperthreaded core the
spinner shares the core's execution units with whatever runs on its sibling. Opt-in; measure it
(tools/gpu_session.sh cpulat with CPULAT_VARIANTS) before relying on it.

    python -m backends.deploy.cpu_spin               # every CPU this process may run on, until interrupted
    python -m backends.deploy.cpu_spin --cpus 0-3,8  # those CPUs only
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def parse_cpus(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]: Linux's CPU list syntax."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"a CPU list is numbers and ranges like 0-3,8, got {text!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"a CPU list is numbers and ranges like 0-3,8, got {text!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError("the CPU list is empty")
    return sorted(cpus)


def _spin(cpu: int, parent: int) -> None:
    """The child's whole life: pinned, lowest class, spinning; gone once its parent is."""
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while os.getppid() == parent:  # a parent killed outright leaves no spinner behind (checked ~10 times a second)
        for _ in range(200_000):
            pass
    os._exit(0)


def start(cpus: list[int]) -> list[int]:
    """Forks one spinner per CPU; returns their pids (stop them with stop())."""
    parent, pids = os.getpid(), []
    for cpu in cpus:
        pid = os.fork()
        if pid == 0:
            try:
                _spin(cpu, parent)
            finally:
                os._exit(1)
        pids.append(pid)
    return pids


def stop(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", type=parse_cpus, default=None, help="Linux CPU list (default: every CPU allowed here)")
    args = ap.parse_args(argv)
    cpus = args.cpus if args.cpus is not None else sorted(os.sched_getaffinity(0))
    pids = start(cpus)
    print(f"cpu_spin: spinning on CPUs {','.join(map(str, cpus))} under SCHED_IDLE", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        stop(pids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
