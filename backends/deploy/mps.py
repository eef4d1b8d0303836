"""CUDA MPS for one server's lifetime: a control daemon of its own, started before the server and stopped after.

Each Triton Python model instance is its own process with its own CUDA context, and without MPS the
GPU runs one context's kernels at a time: the preprocessing instances' kernels and the encoder's take
turns. Under MPS (the Multi-Process Service) the processes' kernels share the GPU, and two encoder
instances can keep it busier than one forward at a time does (README, Scale out; the measurements are
in bench/results/h200-2026-12-01-seventh.md).

`start(folder)` runs `nvidia-cuda-mps-control -d` with its pipe and log folders under `folder`; every
CUDA process that carries `Daemon.env()` (CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY) in its
environment becomes its client. Processes started before, or without that environment, are not: the
launcher gives it to the server alone (TritonServer's `env`), not to itself. `stop()` asks the daemon
to quit once the server's processes have exited, and waits until it and its MPS server are gone.

Where a host already runs a daemon (a Kubernetes device plugin's MPS sharing, an operator's own), do
not start another: give the server that daemon's CUDA_MPS_PIPE_DIRECTORY instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


class MpsUnavailable(RuntimeError):
    """No control binary, or the daemon would not start."""


@dataclass(frozen=True)
class Daemon:
    pipe_dir: Path
    log_dir: Path
    binary: str

    def env(self) -> dict[str, str]:
        """The environment that makes a CUDA process this daemon's client."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Asks the daemon to quit and waits until it and its MPS server have exited; False if they were
        still there after `timeout_s`. Call it after every client exited: `quit` only stops the daemon
        once its clients are gone, so a process that still holds a CUDA context under it (the caller
        itself, say) keeps it alive, and a new daemon on the same folders is then refused."""
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


def daemon_pids(pipe_dir: Path, proc: Path = Path("/proc")) -> list[int]:
    """The MPS control daemons and servers that run on `pipe_dir` (read from their environment; a
    process we may not read is skipped)."""
    want = f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode()
    pids = []
    for entry in proc.glob("[0-9]*"):
        try:
            if not (entry / "comm").read_text().startswith("nvidia-cuda-mps"):
                continue
            if want in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return pids


def start(folder: Path, binary: str | None = None, timeout_s: float = 30.0) -> Daemon:
    """Starts a control daemon whose pipe and log folders lie under `folder`. Raises MpsUnavailable."""
    binary = binary or shutil.which(CONTROL)
    if not binary:
        raise MpsUnavailable(f"{CONTROL} is not on PATH (it comes with the NVIDIA driver)")
    folder = Path(folder).resolve()
    daemon = Daemon(folder / "pipe", folder / "log", binary)
    for d in (daemon.pipe_dir, daemon.log_dir):
        d.mkdir(parents=True, exist_ok=True)
    try:
        # -d forks the daemon and returns; it refuses (non-zero) if one already owns this pipe folder.
        done = subprocess.run([binary, "-d"], env={**os.environ, **daemon.env()}, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MpsUnavailable(f"{binary} -d: {exc}") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        raise MpsUnavailable(f"{binary} -d exited with status {done.returncode}{': ' + said if said else ''}")
    return daemon


__all__ = ["CONTROL", "Daemon", "MpsUnavailable", "daemon_pids", "start"]
