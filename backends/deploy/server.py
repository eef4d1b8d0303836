"""Start the real tritonserver shipped in the `nvidia-pytriton` wheel on a rendered model repository.

What it takes (../shared/docs/triton_notes.md §1): a backend folder holding the Python backend and the
stub built for the running Python (symlinked, so the stub finds its CUDA runtime); our interpreter's
libpython first on LD_LIBRARY_PATH (a second system libpython breaks `_ssl`); and a small virtualenv
first on PATH whose .pth file lists the repo root and our site-packages, so the stub imports torch,
numpy and `backends` (the stub ignores PYTHONPATH; `prepare_stub_env`).

`python -m backends.deploy.server` serves in the foreground until Ctrl-C; tests and `make run` use
`TritonServer` as a context manager.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
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
import venv
from pathlib import Path

from backends.deploy.repository import REPO_ROOT, Deployment, render_repository

BUILD = REPO_ROOT / "build"
STUB_ENV = BUILD / "stub-env"  # the stub's virtualenvs, one per path list (prepare_stub_env)


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def gpu_available() -> bool:
    return gpu_count() > 0


def _pytriton_dir() -> Path:
    # Located, not imported: importing pytriton pulls in its HTTP client (gevent), which we do not need.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed (it ships tritonserver): run `make setup`")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def pytriton_root() -> Path:
    return _pytriton_dir() / "tritonserver"


def pytriton_libs() -> Path:
    return _pytriton_dir().parent / "nvidia_pytriton.libs"


def prepare_backend_dir(dest: Path) -> Path:
    """dest/python/ with libtriton_python.so, triton_python_backend_utils.py and this Python's stub."""
    root = pytriton_root()
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
    return dest


def stub_paths() -> list[str]:
    """What the stub's Python must see, in order: KIMI_STUB_SITE (e.g. a folder with numpy < 2 on a host
    whose own numpy is 2.x), this repository (for `backends`), our PYTHONPATH (e.g. an optional
    flash-attn install), then our interpreter's site-packages."""
    # Absolute paths only: site.py reads a relative .pth entry relative to the env's site-packages.
    paths = [os.environ.get("KIMI_STUB_SITE", ""), str(REPO_ROOT)]
    paths += os.environ.get("PYTHONPATH", "").split(os.pathsep)
    paths = [str(Path(p).resolve()) for p in paths if p]
    paths += [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    return list(dict.fromkeys(p for p in paths if p))


def prepare_stub_env(root: Path) -> Path:
    """A bare virtualenv whose site-packages holds one .pth file listing `stub_paths()`; returns its bin/.

    Why: the stub runs its embedded Python with -E (PYTHONPATH is ignored, seen on 2.51) and takes
    sys.prefix, hence site-packages, from the `python3` first on PATH. Putting this env's bin/ first is
    the one way to choose the stub's packages without touching our own environment - which matters
    because the 2.51 stub corrupts tensors under numpy >= 2 (see bench/stub_probe.py).

    One env per distinct path list (root/<hash>): servers started with different KIMI_STUB_SITE or
    PYTHONPATH never rewrite each other's .pth while their stubs are still starting.
    """
    paths = stub_paths()
    dest = root / hashlib.sha1("\n".join(paths).encode()).hexdigest()[:12]
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Servers may start side by side (several processes): one at a time builds the env, so that none
    # sees a half-made one (venv writes pyvenv.cfg before bin/python3) or has it cleared under it. An
    # env made by another interpreter (a Python upgrade) is rebuilt.
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cfg = dest / "pyvenv.cfg"
        site = dest / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        current = cfg.exists() and ("version = %d.%d.%d" % sys.version_info[:3]) in cfg.read_text().splitlines()
        if not (current and (dest / "bin" / "python3").exists() and (site / "kimi_vision.pth").exists()):
            venv.create(dest, with_pip=False, symlinks=True, clear=True)
            site.mkdir(parents=True, exist_ok=True)
            (site / "kimi_vision.pth").write_text("\n".join(paths) + "\n")
    return dest / "bin"


def stub_numpy_version(bin_dir: Path) -> str:
    """The numpy version the stub will import (its interpreter, -E like the stub)."""
    out = subprocess.run([str(bin_dir / "python3"), "-E", "-c", "import numpy; print(numpy.__version__)"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"the Python stub's environment cannot import numpy:\n{out.stderr[-2000:]}")
    return out.stdout.strip()


def check_stub_numpy(version: str) -> None:
    """Refuse to start the bundled 2.51 server when its stub would run under numpy >= 2.

    The 2.51 stub's pybind11 predates numpy 2's ABI: BYTES inputs arrive as filler bytes and the stub
    aborts, numpy-built outputs arrive empty (reproduced on CPU and on the H200 by bench/stub_probe.py).
    A clear error at start beats a crash - or zeros - at the first request.
    """
    if int(version.split(".")[0]) >= 2:
        raise RuntimeError(
            f"the tritonserver Python stub would import numpy {version}; the bundled Triton 2.51 stub corrupts "
            f"tensors under numpy >= 2. Install numpy<2 in this environment (requirements.txt pins it), or put a "
            f"folder holding numpy<2 in KIMI_STUB_SITE (pip install --target DIR 'numpy<2').")


def server_env(stub_bin: Path) -> dict[str, str]:
    """The server's environment, with `stub_bin` (prepare_stub_env) first on PATH for its stubs."""
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, str(pytriton_libs()), env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(stub_bin), env.get("PATH", "")))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """A tritonserver process on `repository`; `start()` returns once /v2/health/ready answers 200."""

    def __init__(self, repository: Path, *, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 log_path: Path | None = None, cuda_pool_bytes: int | None = None, extra_args: tuple[str, ...] = ()):
        self.repository = Path(repository).resolve()
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log_path = Path(log_path) if log_path else BUILD / f"tritonserver-{http_port}.log"
        self.cuda_pool_bytes = cuda_pool_bytes
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def command(self) -> list[str]:
        backend_dir = prepare_backend_dir(BUILD / "backends")
        cmd = [
            str(pytriton_root() / "bin" / "tritonserver"),
            f"--model-repository={self.repository}",
            f"--backend-directory={backend_dir.resolve()}",
            f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
            "--strict-readiness=true", "--exit-on-error=true", "--disable-auto-complete-config",
            # Production: no dynamic loading (it would allow arbitrary code from the repository path).
            "--model-control-mode=none",
        ]
        if self.cuda_pool_bytes:
            # GPU instances go on every visible GPU, so every GPU gets the pool.
            cmd += [f"--cuda-memory-pool-byte-size={gpu}:{self.cuda_pool_bytes}" for gpu in range(max(1, gpu_count()))]
        # Operator flags for every server we start (e.g. pool sizes), space-separated.
        return cmd + shlex.split(os.environ.get("KIMI_TRITONSERVER_ARGS", "")) + list(self.extra_args)

    def start(self, timeout: float = 180.0, stream_log: bool = False) -> "TritonServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        stub_bin = prepare_stub_env(STUB_ENV)
        check_stub_numpy(stub_numpy_version(stub_bin))
        env = server_env(stub_bin)
        if stream_log:
            self.proc = subprocess.Popen(self.command(), env=env, start_new_session=True)
        else:
            with open(self.log_path, "w") as out:  # the child keeps its own copy of the descriptor
                self.proc = subprocess.Popen(self.command(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode} while starting; "
                                   f"log: {self.log_path}\n{self.log_tail()}")
            if self.ready():
                return self
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


def resolve_device(device: str) -> str:
    if device == "auto":
        return "gpu" if gpu_available() else "cpu"
    return device


def deployment_server(dep: Deployment, name: str, **kwargs) -> TritonServer:
    """Render `dep` under build/model_repository-<name> and return a (not yet started) server on it,
    on free loopback ports unless given, with the CUDA pool sized for the deployment."""
    repo = render_repository(dep, BUILD / f"model_repository-{name}")
    for port in ("http_port", "grpc_port", "metrics_port"):
        kwargs.setdefault(port, free_port())
    kwargs.setdefault("cuda_pool_bytes", dep.cuda_pool_bytes())
    kwargs.setdefault("log_path", BUILD / f"tritonserver-{name}.log")
    return TritonServer(repo, **kwargs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Serve the Kimi-K2.5 vision ensemble in the foreground.")
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    ap.add_argument("--checkpoint", default=os.environ.get("KIMI_VISION_CHECKPOINT", ""))
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    server = deployment_server(Deployment(device=device, checkpoint=args.checkpoint), device,
                               http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port)
    print(f"rendered {device} repository at {server.repository}; starting tritonserver (HTTP {args.http_port}, "
          f"gRPC {args.grpc_port}, metrics {args.metrics_port})", flush=True)
    stub_bin = prepare_stub_env(STUB_ENV)
    check_stub_numpy(stub_numpy_version(stub_bin))
    env = server_env(stub_bin)
    proc = subprocess.Popen(server.command(), env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        return proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
