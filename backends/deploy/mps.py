"""CUDA MPS for one server's lifetime: a control daemon of its own, started before the server and stopped after.

Each Triton Python model instance is its own process with its own CUDA context, and without MPS the
GPU runs one context's kernels at a time: the preprocessing instances' kernels and the encoder's take
turns. Under MPS (the Multi-Process Service) the processes' kernels share the GPU, and two encoder
instances can keep it busier than one forward at a time does (docs/findings.md#cuda-mps has the figures).

`start(folder_for(tag))` runs `nvidia-cuda-mps-control -d` with its pipe and log folders under that
folder; every CUDA process that carries `Daemon.env()` (CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY) in its
environment becomes its client. Processes started before, or without that environment, are not: the
launcher gives it to the server alone (TritonServer's `env`), not to itself. `stop()` asks the daemon
to quit once the server's processes have exited, and waits until it and its MPS server are gone
(docs/triton_runtime.md#cuda-mps).

Where a host already runs a daemon (a Kubernetes device plugin's MPS sharing, an operator's own), do
not start another: give the server that daemon's CUDA_MPS_PIPE_DIRECTORY instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from backends.deploy.supervisor import processes
from backends.folders import own_private_folder

CONTROL = "nvidia-cuda-mps-control"
STOP_TIMEOUT_S = 30.0  # how long stop() waits for the daemon and its MPS server to go


class MpsUnavailable(RuntimeError):
    """No control binary, no usable folder, or the daemon would not start."""


def folder_for(tag: str) -> Path:
    """Where the daemon of one server keeps its pipe and log folders: under the temp folder, not build/,
    because the daemon listens on a Unix socket in the pipe folder and such a path may not exceed 108
    bytes. `tag` tells servers on one host apart (the launcher uses its gRPC port)."""
    return Path(tempfile.gettempdir()) / f"kimi-mps-{tag}"


@dataclass
class Daemon:
    pipe_dir: Path
    log_dir: Path
    binary: str = CONTROL
    stopped: bool = False

    @classmethod
    def under(cls, folder: Path, binary: str = CONTROL) -> "Daemon":
        """The daemon whose pipe and log folders lie under `folder` (the one layout, for start() and for
        whoever looks for that daemon's processes or log)."""
        return cls(Path(folder) / "pipe", Path(folder) / "log", binary)

    def env(self) -> dict[str, str]:
        """The environment that makes a CUDA process this daemon's client."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """Asks the daemon to quit and waits until no process of its pipe folder is left (daemon_pids);
        False if one still was after `timeout_s`. Call it after every client exited: a daemon quits only
        once its clients are gone (NVIDIA's documentation), so a process that still holds a CUDA context
        under it keeps it there, and a new daemon on the same folders is refused. A second call does
        nothing."""
        if self.stopped:
            return True
        self.stopped = True
        deadline = time.monotonic() + timeout_s
        try:
            subprocess.run([self.binary], input="quit\n", text=True, env={**os.environ, **self.env()},
                           capture_output=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass
        while daemon_pids(self.pipe_dir):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True


def _pids_on(pipe_dir: Path, proc: Path, mps_processes: bool) -> list[int]:
    """Processes with CUDA_MPS_PIPE_DIRECTORY=`pipe_dir` in their environment: the MPS daemon and server
    (`mps_processes`), or the others, its clients. A process we may not read is skipped. The kernel keeps
    15 characters of a process name: control daemon and server both read `nvidia-cuda-mps`."""
    want = f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode()
    pids = []
    for pid, _, _, _, comm in processes(proc):
        if comm.startswith("nvidia-cuda-mps") != mps_processes:
            continue
        try:
            if want in (proc / str(pid) / "environ").read_bytes().split(b"\0"):
                pids.append(pid)
        except OSError:
            continue
    return pids


def daemon_pids(pipe_dir: Path, proc: Path = Path("/proc")) -> list[int]:
    """The MPS control daemon and server that run on `pipe_dir`, told from other daemons by that folder in
    their environment (the daemon gets it from us and hands it to its server: seen on the H200;
    docs/triton_runtime.md#cuda-mps)."""
    return _pids_on(pipe_dir, proc, True)


def client_pids(pipe_dir: Path, proc: Path = Path("/proc")) -> list[int]:
    """Processes other than the daemon's own that carry `pipe_dir`: its clients, or would-be clients."""
    return _pids_on(pipe_dir, proc, False)


def start(folder: Path, binary: str | None = None, timeout_s: float = STOP_TIMEOUT_S) -> Daemon:
    """Starts a control daemon whose pipe and log folders lie under `folder` (made if missing; its parent
    must exist). A daemon an earlier run left on the same folder is asked to quit first, unless processes
    still use it (then this start is refused: quitting would take their daemon away). Raises
    MpsUnavailable."""
    binary = binary or shutil.which(CONTROL)
    if not binary:
        raise MpsUnavailable(f"{CONTROL} is not on PATH (it comes with the NVIDIA driver)")
    folder = Path(folder)
    daemon = Daemon.under(folder, binary)
    try:
        for d in (folder, daemon.pipe_dir, daemon.log_dir):
            own_private_folder(d)  # a predictable path in a shared folder
    except OSError as exc:
        raise MpsUnavailable(f"cannot make its folders under {folder}: {exc}") from None
    if daemon_pids(daemon.pipe_dir):
        users = client_pids(daemon.pipe_dir)
        if users:
            raise MpsUnavailable(f"a daemon already runs on {daemon.pipe_dir}, used by processes {users[:8]}")
        if not Daemon.under(folder, binary).stop(timeout_s):  # the leftover: not the daemon returned below
            raise MpsUnavailable(f"a daemon left on {daemon.pipe_dir} by an earlier run did not quit")
    try:
        # -d forks the daemon and returns; it refuses (non-zero) while another owns this pipe folder. Its
        # own session: a Ctrl-C or `timeout -s INT` meant for our process group must not reach the
        # daemon while the server it serves is still draining.
        done = subprocess.run([binary, "-d"], env={**os.environ, **daemon.env()}, capture_output=True, text=True,
                              timeout=timeout_s, check=False, start_new_session=True)
    except BaseException as exc:  # a daemon that did start must not outlive a failed or interrupted -d
        daemon.stop(timeout_s)
        if isinstance(exc, (OSError, subprocess.TimeoutExpired)):
            raise MpsUnavailable(f"{binary} -d: {exc}") from None
        raise  # SIGTERM as SystemExit, Ctrl-C: go on unwinding
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        raise MpsUnavailable(f"{binary} -d exited with status {done.returncode}{': ' + said if said else ''}")
    return daemon


__all__ = ["CONTROL", "STOP_TIMEOUT_S", "Daemon", "MpsUnavailable", "client_pids", "daemon_pids", "folder_for", "start"]
