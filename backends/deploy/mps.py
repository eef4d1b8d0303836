"""CUDA MPS for one server's lifetime: a control daemon of its own, started before the server and stopped after.

Each Triton Python model instance is its own process with its own CUDA context, and without MPS the
GPU runs one context's kernels at a time: the preprocessing instances' kernels and the encoder's take
turns. Under MPS (the Multi-Process Service) the processes' kernels share the GPU, and two encoder
instances can keep it busier than one forward at a time does (README, Scale out; the measurements are
in bench/results/h200-2026-12-01-seventh.md).

`start(folder)` runs `nvidia-cuda-mps-control -d` with its pipe and log folders under `folder`; every
CUDA process that carries `Daemon.env()` (CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY) in its
environment becomes its client. Processes started before, or without that environment, are not.
`stop()` asks it to quit, and its MPS server with it, once the server's processes have exited.

Where a host already runs a daemon (a Kubernetes device plugin's MPS sharing, an operator's own), do
not start another: give the server that daemon's CUDA_MPS_PIPE_DIRECTORY instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
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

    def stop(self, timeout_s: float = 30.0) -> None:
        """Asks the daemon to quit (it stops its MPS server first). Call it after the clients exited:
        a server with live clients finishes them first."""
        try:
            subprocess.run([self.binary], input="quit\n", text=True, env={**os.environ, **self.env()},
                           capture_output=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass


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


__all__ = ["CONTROL", "Daemon", "MpsUnavailable", "start"]
