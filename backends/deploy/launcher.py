"""The one launcher: render the repository for a deployment and run tritonserver on it.

`python -m backends.deploy.launcher` is how every server starts: `make serve`, the container's
entrypoint (docker/entrypoint.sh) and, through `TritonServer`, `make run`, the tests and the
benchmarks. The tritonserver command line is built in one place, `tritonserver_command`.

Two installations of tritonserver are supported (`TritonInstall`):
- embedded (default): the 2.51 binary from the `nvidia-pytriton` wheel (docs/triton_runtime.md#the-embedded-server).
  It needs a backend folder holding the Python backend and the stub built for the running Python
  (symlinked, so the stub finds its CUDA runtime), and our interpreter's libpython first on
  LD_LIBRARY_PATH (a second system libpython breaks `_ssl`);
- system: an installed tritonserver, e.g. NGC's /opt/tritonserver (KIMI_TRITONSERVER or
  --tritonserver names the binary; its own backends folder is used).
Either way the stub gets its own environment (stub_env.py) first on the server's PATH.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from backends.deploy.repository import REPO_ROOT, Deployment, render_repository
from backends.deploy.stub_env import stub_bin

BUILD = REPO_ROOT / "build"
STUB_ENV = BUILD / "stub-env"  # the stub's virtualenvs, one per path list (stub_env.prepare_stub_env)


def gpu_count() -> int:
    """GPUs this process sees (CUDA_VISIBLE_DEVICES respected), 0 without CUDA."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def resolve_device(device: str) -> str:
    if device == "auto":
        return "gpu" if gpu_count() > 0 else "cpu"
    return device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    lib_dirs: tuple[str, ...] = ()

    @classmethod
    def find(cls, binary: str | None = None) -> "TritonInstall":
        binary = binary or os.environ.get("KIMI_TRITONSERVER")
        return cls.system(Path(binary)) if binary else cls.embedded()

    @classmethod
    def system(cls, binary: Path) -> "TritonInstall":
        """An installed server: <prefix>/bin/tritonserver with its backends in <prefix>/backends."""
        binary = binary.resolve()
        return cls(binary, binary.parent.parent / "backends")

    @classmethod
    def embedded(cls) -> "TritonInstall":
        # Located, not imported: importing pytriton pulls in its HTTP client (gevent), which we do not need.
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("nvidia-pytriton is not installed (it ships tritonserver): run `make setup`, "
                               "or name an installed tritonserver in KIMI_TRITONSERVER")
        pkg = Path(list(spec.submodule_search_locations)[0]).resolve()
        root = pkg / "tritonserver"
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        return cls(root / "bin" / "tritonserver", _embedded_backend_dir(root, BUILD / "backends"),
                   tuple(p for p in (libdir, str(pkg.parent / "nvidia_pytriton.libs")) if p))


def _embedded_backend_dir(root: Path, dest: Path) -> Path:
    """dest/python/ with libtriton_python.so, triton_python_backend_utils.py and this Python's stub."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    for src in (root / "backends" / "python" / "libtriton_python.so",
                root / "backends" / "python" / "triton_python_backend_utils.py", stub):
        link = py / src.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src)
    return dest.resolve()


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> "Ports":
        return cls(free_port(), free_port(), free_port())


def tritonserver_command(install: TritonInstall, repository: Path, ports: Ports, *, cuda_pool_bytes: int | None,
                         extra_args: tuple[str, ...] = ()) -> list[str]:
    """The tritonserver command line: the one place it is written."""
    cmd = [
        str(install.binary),
        f"--model-repository={Path(repository).resolve()}",
        f"--backend-directory={install.backend_dir}",
        f"--http-port={ports.http}", f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}",
        "--strict-readiness=true", "--exit-on-error=true", "--disable-auto-complete-config",
        # Production: no dynamic loading (it would allow arbitrary code from the repository path).
        "--model-control-mode=none",
    ]
    if cuda_pool_bytes:
        # GPU instances go on every visible GPU, so every GPU gets the pool.
        cmd += [f"--cuda-memory-pool-byte-size={gpu}:{cuda_pool_bytes}" for gpu in range(max(1, gpu_count()))]
    # Operator flags for every server we start (e.g. pool sizes), space-separated.
    return cmd + shlex.split(os.environ.get("KIMI_TRITONSERVER_ARGS", "")) + list(extra_args)


def server_env(install: TritonInstall, stub_bin_dir: Path) -> dict[str, str]:
    """The server's environment, with the stub env's bin/ first on PATH for its stubs."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (*install.lib_dirs, env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(stub_bin_dir), env.get("PATH", "")))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class TritonServer:
    """A tritonserver process on `repository`; `start()` returns once /v2/health/ready answers 200."""

    def __init__(self, repository: Path, *, ports: Ports = Ports(), log_path: Path | None = None,
                 cuda_pool_bytes: int | None = None, extra_args: tuple[str, ...] = (),
                 install: TritonInstall | None = None, allow_numpy2: bool = False):
        self.repository = Path(repository).resolve()
        self.ports = ports
        self.log_path = Path(log_path) if log_path else BUILD / f"tritonserver-{ports.http}.log"
        self.cuda_pool_bytes = cuda_pool_bytes
        self.extra_args = extra_args
        self._install = install
        self.allow_numpy2 = allow_numpy2
        self.proc: subprocess.Popen | None = None

    @property
    def install(self) -> TritonInstall:
        if self._install is None:
            self._install = TritonInstall.find()
        return self._install

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"127.0.0.1:{self.ports.metrics}"

    def command(self) -> list[str]:
        return tritonserver_command(self.install, self.repository, self.ports, cuda_pool_bytes=self.cuda_pool_bytes,
                                    extra_args=self.extra_args)

    def launch(self, stream_log: bool = False) -> subprocess.Popen:
        """Start the process (its own process group) and return it, without waiting for readiness."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = server_env(self.install, stub_bin(STUB_ENV, allow_numpy2=self.allow_numpy2))
        if stream_log:
            self.proc = subprocess.Popen(self.command(), env=env, start_new_session=True)
        else:
            with open(self.log_path, "w") as out:  # the child keeps its own copy of the descriptor
                self.proc = subprocess.Popen(self.command(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        return self.proc

    def start(self, timeout: float = 180.0, stream_log: bool = False) -> "TritonServer":
        self.launch(stream_log)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode} while starting; "
                                   f"log: {self.log_path}\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s; log: {self.log_path}\n{self.log_tail()}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        # SIGINT lets tritonserver unload models and stop the Python stubs it started; the whole
        # process group is signalled so that stubs of a server that died on its own go too.
        self._signal_group(signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.proc.wait()
        time.sleep(0.2)
        self._signal_group(signal.SIGKILL)  # anything left in the group (orphaned stubs)

    def _signal_group(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, *exc):
        self.stop()


def deployment_server(dep: Deployment, name: str, *, repository: Path | None = None, ports: Ports | None = None,
                      **kwargs) -> TritonServer:
    """Render `dep` (under build/model_repository-<name> unless `repository` is given) and return a
    server on it, not yet started: on free loopback ports unless given, with the CUDA pool sized for
    the deployment."""
    repo = render_repository(dep, repository or BUILD / f"model_repository-{name}")
    kwargs.setdefault("cuda_pool_bytes", dep.cuda_pool_bytes())
    kwargs.setdefault("log_path", BUILD / f"tritonserver-{name}.log")
    return TritonServer(repo, ports=ports or Ports.free(), **kwargs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Render the repository and serve the Kimi-K2.5 vision ensembles "
                                             "in the foreground until SIGINT/SIGTERM.")
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default=os.environ.get("KIMI_DEVICE", "auto"))
    ap.add_argument("--checkpoint", default=os.environ.get("KIMI_VISION_CHECKPOINT", ""))
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--repository-dir", type=Path, help="where to render the repository (default build/model_repository-<device>)")
    ap.add_argument("--tritonserver", help="an installed tritonserver binary (default: KIMI_TRITONSERVER, else the embedded one)")
    ap.add_argument("extra", nargs="*", help="further tritonserver flags, after --")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    server = deployment_server(Deployment(device=device, checkpoint=args.checkpoint), device,
                               repository=args.repository_dir, ports=Ports(args.http_port, args.grpc_port, args.metrics_port),
                               install=TritonInstall.find(args.tritonserver), extra_args=tuple(args.extra))
    print(f"rendered {device} repository at {server.repository}; starting tritonserver (HTTP {args.http_port}, "
          f"gRPC {args.grpc_port}, metrics {args.metrics_port})", flush=True)
    proc = server.launch(stream_log=True)

    def forward(signum, _frame):  # SIGTERM from an orchestrator: let tritonserver drain and exit
        server._signal_group(signal.SIGINT)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
