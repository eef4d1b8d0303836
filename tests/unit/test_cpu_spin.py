"""backends/deploy/cpu_spin: the CPU list syntax, and spinners that run where and how they are told and
go when told (or when their parent goes)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from backends.deploy import cpu_spin


def test_cpu_lists():
    assert cpu_spin.parse_cpus("0-3,8") == [0, 1, 2, 3, 8]
    assert cpu_spin.parse_cpus("5, 2,2") == [2, 5]
    for bad in ("", "a", "3-1", "-1", "1-"):
        with pytest.raises(ValueError):
            cpu_spin.parse_cpus(bad)


def _status(pid: int) -> tuple[str, str]:
    """(scheduling class, allowed CPUs) of a running process, as ps and /proc report them."""
    cls = subprocess.run(["ps", "-o", "cls=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    with open(f"/proc/{pid}/status") as f:
        allowed = next(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list"))
    return cls, allowed


def test_spinners_are_pinned_idle_class_and_stop():
    cpu = min(os.sched_getaffinity(0))
    pids = cpu_spin.start([cpu])
    try:
        deadline = time.monotonic() + 5
        while _status(pids[0])[0] != "IDL" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _status(pids[0]) == ("IDL", str(cpu))
    finally:
        cpu_spin.stop(pids)
    assert not os.path.exists(f"/proc/{pids[0]}")


def test_spinners_go_with_their_parent():
    """A parent killed outright (no chance to stop its children) leaves no spinner behind."""
    cpu = min(os.sched_getaffinity(0))
    code = f"from backends.deploy import cpu_spin; print(cpu_spin.start([{cpu}])[0], flush=True); import time; time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the spinner outlived its killed parent")
    finally:
        parent.kill()
