"""Whatever the launcher starts dies with it: killed outright (SIGKILL, as `make` does after a drain that
takes too long, or the OOM killer), it leaves no tritonserver, no stub and no /dev/shm region behind
(backends/deploy/reaper.py)."""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from backends.deploy.ports import free_ports
from backends.deploy.supervisor import processes

ROOT = Path(__file__).resolve().parents[2]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _server_of(launcher_pid: int) -> tuple[int, str]:
    """(pid, shm prefix) of the tritonserver the launcher started."""
    for pid, _, ppid, _, comm in processes():
        if ppid == launcher_pid and comm.startswith("tritonserver"):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            prefix = next(a.split("shm-region-prefix-name=", 1)[1] for a in argv if "shm-region-prefix-name=" in a)
            return pid, prefix
    raise AssertionError("no tritonserver child of the launcher")


def test_a_launcher_killed_outright_leaves_nothing_behind():
    http, grpc, metrics = free_ports(3)
    launcher = subprocess.Popen([sys.executable, "-m", "backends.deploy.launcher", "--device", "cpu",
                                 "--address", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc),
                                 "--metrics-port", str(metrics)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not _ready(http):
            assert launcher.poll() is None and time.monotonic() < deadline, "the launcher did not get ready"
            time.sleep(0.5)
        server, prefix = _server_of(launcher.pid)
        rendered = ROOT / "build" / f"model_repository-cpu-{launcher.pid}"
        assert rendered.is_dir()
        assert list(Path("/dev/shm").glob(f"{prefix}*")), "the stubs' regions should exist while serving"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            left = [pid for pid, state, _, pgrp, _ in processes() if pgrp == server and state != "Z"]
            regions = list(Path("/dev/shm").glob(f"{prefix}*"))
            if not left and not regions:
                break
            time.sleep(0.2)
        assert not left, f"processes of the server's group outlived the launcher: {left}"
        assert not regions, f"regions outlived the launcher: {regions}"
        assert not rendered.exists(), "the launch's rendered repository outlived it"
        assert not _ready(http)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
