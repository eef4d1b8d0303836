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
import functools
import hashlib
import importlib.util
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from backends.config import env_flag, env_int
from backends.deploy import allocator as heap, mps, ports as port_check
from backends.deploy.ports import free_ports
from backends.deploy.first_requests import warm_up
from backends.errors import first_line
from backends.deploy.reaper import Reaper
from backends.deploy.repository import REPO_ROOT, Deployment, render_repository
from backends.deploy.stub_env import stub_bin
from backends.deploy.supervisor import Supervisor, processes

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    lib_dirs: tuple[str, ...] = ()

    def supports(self, flag: str) -> bool:
        """Whether this tritonserver knows `flag` (its --help names it): newer releases add flags 2.51 lacks
        and refuses, e.g. --http-max-input-size (2.59)."""
        return flag in _help_text(str(self.binary), self.lib_dirs)

    @classmethod
    def find(cls, binary: str | None = None) -> "TritonInstall":
        binary = binary or os.environ.get("KIMI_TRITONSERVER")
        return cls.system(Path(binary)) if binary else cls.embedded()

    @classmethod
    def system(cls, binary: Path) -> "TritonInstall":
        """An installed server: <prefix>/bin/tritonserver with its backends in <prefix>/backends."""
        binary = binary.resolve()
        if not binary.is_file() or not os.access(binary, os.X_OK):
            raise RuntimeError(f"{binary} is not an executable tritonserver (--tritonserver, KIMI_TRITONSERVER)")
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
        libdir = _libpython_dir(BUILD / "libpython")
        return cls(root / "bin" / "tritonserver", _embedded_backend_dir(root, BUILD / "backends"),
                   tuple(p for p in (libdir, str(pkg.parent / "nvidia_pytriton.libs")) if p))


@functools.lru_cache(maxsize=8)
def _help_text(binary: str, lib_dirs: tuple[str, ...]) -> str:
    """tritonserver --help (it exits 1 after printing it), once per binary; "" if it cannot be run."""
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join((*lib_dirs, os.environ.get("LD_LIBRARY_PATH", "")))}
    try:
        out = subprocess.run([binary, "--help"], env=env, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout + out.stderr


def _libpython_dir(dest: Path) -> str:
    """A folder holding only our interpreter's libpython (a symlink), for the front of LD_LIBRARY_PATH.

    The stub must load the libpython of the interpreter that built our environment, not a system one
    of the same soname. Putting the interpreter's whole LIBDIR first did that, but also put every
    other library there ahead of the ones our packages bring: on the GPU host that LIBDIR holds a
    system cuDNN 9.14, which the stub's torch (built for its own 9.19) then loaded, and with it lost
    cuDNN attention (docs/triton_runtime.md#the-embedded-server). "" when Python is not shared."""
    name = sysconfig.get_config_var("INSTSONAME") or ""
    lib = Path(sysconfig.get_config_var("LIBDIR") or "") / name
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") or not name or not lib.exists():
        return ""
    dest = dest / hashlib.sha1(str(lib).encode()).hexdigest()[:12]  # one folder per interpreter
    dest.mkdir(parents=True, exist_ok=True)
    _link(dest / name, lib)
    return str(dest)


def _link(link: Path, target: Path) -> None:
    """Point `link` at `target`, replacing what is there atomically: servers starting side by side
    (tests, a restart) never see the link missing or fail on one another's."""
    if link.is_symlink() and link.resolve() == target.resolve():
        return
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    tmp.replace(link)


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
        _link(py / src.name, src)
    return dest.resolve()


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


# The API groups an admin key protects (--admin-key): registering shared memory maps client memory
# into the server, and the repository, logging and trace APIs change what the server does.
ADMIN_APIS = "shared-memory,logging,trace"
# tritonserver's own limit for in-flight requests at shutdown; the launcher's stop() allows a little more.
EXIT_TIMEOUT_S = 25


def tritonserver_command(install: TritonInstall, repository: Path, ports: Ports, *, cuda_pools: dict[int, int],
                         address: str = "0.0.0.0", metrics: tuple[str, int] | None = None,
                         shm_prefix: str = "", admin_key: str = "", trace_file: Path | None = None,
                         http_max_input_bytes: int | None = None, reload_key: str = "",
                         extra_args: tuple[str, ...] = ()) -> list[str]:
    """The tritonserver command line: the one place it is written.

    address: where HTTP and gRPC listen (0.0.0.0 to serve other hosts). metrics: (address, port) of
    tritonserver's own metrics endpoint; a supervised server keeps it on loopback and the supervisor
    serves the public one. admin_key "<header>=<value>": the ADMIN_APIS answer only requests that
    carry it (HTTP header; gRPC metadata triton-grpc-protocol-<header>). trace_file: where tritonserver
    writes request traces once they are turned on through its trace API (clients/tracing.py); the
    server starts with tracing off, and 2.51 accepts a file only on its command line.
    http_max_input_bytes: the HTTP front end's limit on a request's inputs, passed where the server has
    the flag (2.59 on; its default there, 64 MiB, would refuse requests our limits allow). No tritonserver
    release has a gRPC size flag (docs/triton_runtime.md#request-size).
    reload_key "<header>=<value>": the model-repository API answers only requests carrying it (the
    supervisor's, to reload a model whose stub died); none given, a random one nobody holds."""
    metrics_address, metrics_port = metrics or (address, ports.metrics)
    cmd = [
        str(install.binary),
        f"--model-repository={Path(repository).resolve()}",
        f"--backend-directory={install.backend_dir}",
        f"--http-address={address}", f"--grpc-address={address}", f"--metrics-address={metrics_address}",
        f"--http-port={ports.http}", f"--grpc-port={ports.grpc}", f"--metrics-port={metrics_port}",
        "--strict-readiness=true", "--exit-on-error=true", "--disable-auto-complete-config",
        # Every model loaded at start; the model-repository API is kept for the supervisor alone (below:
        # behind a key), which reloads the one model whose stub died while the others serve on
        # (supervisor.py). Open, that API would let anyone who reaches the port load code.
        "--model-control-mode=explicit", "--load-model=*",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        # No pooled gRPC request objects: a pooled one keeps the capacity of the largest request it held
        # (its protobuf strings), so 8 (the default) kept up to 8 times the largest request's bytes for
        # the server's life (docs/operations.md#memory). One allocation per request instead.
        "--grpc-infer-allocation-pool-size=0",
    ]
    if http_max_input_bytes and install.supports("--http-max-input-size"):
        cmd.append(f"--http-max-input-size={http_max_input_bytes}")
    if shm_prefix:  # the server's Python-backend regions in /dev/shm, so that what a dead stub leaves can be removed
        cmd.append(f"--backend-config=python,shm-region-prefix-name={shm_prefix}")
    if admin_key:
        cmd += [f"--http-restricted-api={ADMIN_APIS}:{admin_key}", f"--grpc-restricted-protocol={ADMIN_APIS}:{admin_key}"]
    # Loading a model runs its code (the load API can even upload files): only the launcher's own key,
    # never the admin key clients hold for shared memory; no key given, nobody's.
    key = reload_key or f"kimi-reload={secrets.token_hex(16)}"
    cmd += [f"--http-restricted-api=model-repository:{key}", f"--grpc-restricted-protocol=model-repository:{key}"]
    if trace_file is not None:
        cmd.append(f"--trace-config=triton,file={Path(trace_file).resolve()}")
    if cuda_pools:  # every GPU that holds instances holds tensors between steps (Deployment.cuda_pools)
        cmd += [f"--cuda-memory-pool-byte-size={gpu}:{size}" for gpu, size in sorted(cuda_pools.items())]
    elif gpu_count() == 0:
        # No GPU: no GPU metrics (NVML, DCGM) and no pinned host pool, whose start-up attempts only log errors.
        cmd += ["--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0"]
    # Operator flags for every server we start (e.g. pool sizes), space-separated.
    return cmd + shlex.split(os.environ.get("KIMI_TRITONSERVER_ARGS", "")) + list(extra_args)


CPU_STARTUP_NOTE = ("note: this host has no GPU; tritonserver still logs \"CudaDriverHelper has not been initialized\" "
                    "and \"unable to create stream for <ensemble>: CUDA driver version is insufficient\" at start-up. "
                    "Both are harmless: the CPU deployment never uses CUDA.")


def server_env(install: TritonInstall, stub_bin_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment, with the stub env's bin/ first on PATH for its stubs, and `extra` (e.g.
    an MPS daemon's pipe folder, mps.Daemon.env) on top."""
    env = {**os.environ, **(extra or {})}
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (*install.lib_dirs, env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(stub_bin_dir), env.get("PATH", "")))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def shm_note(dep: Deployment) -> str:
    """How much /dev/shm the deployment may need (Deployment.shm_ceiling_bytes for tensors between steps,
    images_shm_bytes for the requests' encoded images) against what there is."""
    tensors, images = dep.shm_ceiling_bytes(), dep.images_shm_bytes()
    need = tensors + images
    try:
        have = shutil.disk_usage("/dev/shm").total
    except OSError:
        have = 0
    text = (f"/dev/shm: the Python backend's regions can grow to {need / 2**30:.1f} GiB under the limits "
            f"({tensors / 2**30:.1f} GiB of tensors between steps, {images / 2**30:.1f} GiB of encoded images at "
            f"max_request_bytes; they never shrink in tritonserver 2.51); this host has {have / 2**30:.1f} GiB")
    return text + ("" if have >= need else ". WARNING: requests at the limits can fail; give /dev/shm more "
                   "(docker --shm-size, a Memory emptyDir on Kubernetes) or lower max_patches / max_batch / "
                   "max_request_bytes")


def scan_check_note() -> str:
    """Builds the JPEG scan check of a GPU deployment once, before the model instances start (they would
    each find it missing and build it at the same time): into KIMI_BUILD_CACHE, else a per-user folder
    under the system's temporary folder (backends/preprocess/scan_check.py). Without a C compiler the
    GPU decodes no JPEG, and Pillow decodes them all."""
    from backends.preprocess import scan_check

    try:
        return f"JPEG scan check: {scan_check.library_path()}"
    except scan_check.ScanCheckUnavailable as exc:
        return f"WARNING: {exc}; exact GPU JPEG decoding stays off (Pillow decodes every JPEG)"


class TritonServer:
    """A tritonserver process on `repository`; `start()` returns once /v2/health/ready answers 200.

    metrics_port: where tritonserver's own metrics listen (default ports.metrics); a supervised server
    gets a loopback port here and the supervisor serves ports.metrics."""

    def __init__(self, repository: Path, *, ports: Ports = Ports(), log_path: Path | None = None,
                 cuda_pools: dict[int, int] | None = None, extra_args: tuple[str, ...] = (),
                 install: TritonInstall | None = None, address: str = "127.0.0.1",
                 metrics_port: int | None = None, admin_key: str = "", env: dict[str, str] | None = None,
                 trace_file: Path | None = None, reaper=None, http_max_input_bytes: int | None = None,
                 allocator: heap.Allocator | None = None, first_requests=None):
        self.repository = Path(repository).resolve()
        # Called with this server once it is ready, before start() returns (first_requests.py): returns a
        # line for the log. The supervisor calls it again after reloading a model.
        self.first_requests = first_requests
        self.http_max_input_bytes = http_max_input_bytes
        self.allocator = allocator  # None: heap.find() at the first launch (KIMI_MALLOC, else jemalloc if any)
        self.reaper = reaper  # the launcher's (reaper.py): what this server starts dies with the launcher
        self.env = dict(env or {})  # on top of ours, for the server and its stubs
        self.ports = ports
        self.log_path = Path(log_path) if log_path else BUILD / f"tritonserver-{ports.http}.log"
        self.cuda_pools = dict(cuda_pools or {})
        self.extra_args = extra_args
        self._install = install
        self.address = address
        self.metrics_port = metrics_port or ports.metrics
        self.admin_key = admin_key
        # What the model-repository API asks for: a key of our own, never printed, never the admin key.
        self.reload_key = f"kimi-reload={secrets.token_hex(16)}"
        self.trace_file = Path(trace_file).resolve() if trace_file else None
        self.shm_prefix = ""
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
        return f"127.0.0.1:{self.metrics_port}"

    def command(self) -> list[str]:
        metrics_address = "127.0.0.1" if self.metrics_port != self.ports.metrics else self.address
        return tritonserver_command(self.install, self.repository, self.ports, cuda_pools=self.cuda_pools,
                                    address=self.address, metrics=(metrics_address, self.metrics_port),
                                    shm_prefix=self.shm_prefix, admin_key=self.admin_key, trace_file=self.trace_file,
                                    http_max_input_bytes=self.http_max_input_bytes, reload_key=self.reload_key,
                                    extra_args=self.extra_args)

    def launch(self, stream_log: bool = False) -> subprocess.Popen:
        """Start the process (its own process group) and return it, without waiting for readiness."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.trace_file is not None:  # tritonserver writes traces with no word if the folder is missing
            self.trace_file.parent.mkdir(parents=True, exist_ok=True)
        env = server_env(self.install, stub_bin(STUB_ENV), self.env)
        if self.allocator is None:
            self.allocator = heap.find()
        env.update(self.allocator.env(env))  # the stubs inherit it with the rest
        self.shm_prefix = f"kimi_{uuid.uuid4().hex[:12]}_"  # fresh per launch: what to clean up after it
        if stream_log:  # to our standard output and to the log file, which a failed start is read from
            self.proc = subprocess.Popen(self.command(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            threading.Thread(target=_tee, args=(self.proc.stdout, self.log_path), name="kimi-server-log",
                             daemon=True).start()
        else:
            with open(self.log_path, "w") as out:  # the child keeps its own copy of the descriptor
                self.proc = subprocess.Popen(self.command(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        if self.reaper is not None:
            self.reaper.track(self.proc.pid, self.shm_prefix)
        return self.proc

    def start(self, timeout: float = 180.0, stream_log: bool = False, on_poll=None, should_stop=None) -> "TritonServer":
        self.launch(stream_log)
        self.wait_ready(timeout, on_poll, should_stop)
        self.send_first_requests(should_stop)
        return self

    def send_first_requests(self, should_stop=None) -> None:
        """The server's own first requests (first_requests.py). They are ours: whatever goes wrong is
        logged in one line and the server serves on."""
        if self.first_requests is None:
            return
        try:
            line = self.first_requests(self, should_stop)
        except Exception as exc:  # noqa: BLE001
            log.warning("first requests of our own failed: %s", first_line(exc))
            return
        if line:
            log.info("first requests: %s", line)

    def wait_ready(self, timeout: float, on_poll=None, should_stop=None) -> None:
        """Poll readiness; `on_poll()` runs at each poll and once more when ready (the supervisor
        learns the stubs' names while they start). A server that exits, does not become ready in time,
        or is abandoned (`should_stop()`) is cleaned up (its process group, its /dev/shm regions)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop(0, stubs_dead=True)
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode} while starting; "
                                   f"log: {self.log_path}\n{self.log_tail()}")
            if should_stop is not None and should_stop():
                self.stop(0, stubs_dead=True)
                raise RuntimeError("start abandoned: asked to stop")
            if on_poll:
                on_poll()
            if self.ready():
                if on_poll:
                    on_poll()
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s; log: {self.log_path}\n{self.log_tail()}")

    def keep_log(self, kind: str = "previous") -> Path | None:
        """Moves the log file aside (`<stem>.<kind>.log` beside it, returned; None if there is no log) so
        that the next launch does not overwrite it. The supervisor keeps the log of the server that went as
        `previous`, once per restart, so later attempts to start again cannot overwrite it; an attempt that
        fails is kept as `failed-start` (the latest one)."""
        if not self.log_path.exists():
            return None
        kept = self.kept_log(kind)
        self.log_path.replace(kept)
        return kept

    def kept_log(self, kind: str = "previous") -> Path:
        """Where keep_log(kind) puts the log (whether or not it has)."""
        return self.log_path.with_suffix(f".{kind}.log")

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

    def stop(self, timeout: float = EXIT_TIMEOUT_S + 5, stubs_dead: bool = False) -> None:
        """Stop within `timeout` seconds and leave nothing behind in /dev/shm. A server with a dead stub
        would wait out its whole exit timeout unloading that model: it is killed at once."""
        if self.proc is None:
            return
        # SIGINT lets tritonserver unload models and stop the Python stubs it started; the whole
        # process group is signalled so that stubs of a server that died on its own go too.
        if not stubs_dead and timeout > 0:
            self._signal_group(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)  # anything left in the group (stubs, a server past its time)
        self.proc.wait()
        self._wait_group_gone()
        self.remove_shm_regions()
        if self.reaper is not None:
            self.reaper.forget(self.proc.pid)

    def _wait_group_gone(self, limit: float = 5.0) -> None:
        """Until no live process of the server's group is left (zombies of killed stubs do not count:
        nothing of theirs holds the /dev/shm regions any more)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and _live_in_group(self.proc.pid):
            time.sleep(0.05)

    def remove_shm_regions(self) -> list[str]:
        """Remove this launch's Python-backend regions (a stub that was killed never removes its own)."""
        if not self.shm_prefix:
            return []
        removed = []
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            try:
                region.unlink()
                removed.append(region.name)
            except OSError:
                pass
        return removed

    def _signal_group(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, *exc):
        self.stop()


def _tee(pipe, log_path: Path) -> None:
    """tritonserver's output, line by line, to our standard output and to `log_path`, until it closes."""
    with pipe, open(log_path, "wb") as log_file:
        for line in pipe:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()
            log_file.write(line)
            log_file.flush()


def _live_in_group(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running (zombies do not count)."""
    return any(pgrp == pgid and state != "Z" for _, state, _, pgrp, _ in processes())


def deployment_server(dep: Deployment, name: str, *, repository: Path | None = None, ports: Ports | None = None,
                      supervise: bool = True, **kwargs) -> "Supervisor | TritonServer":
    """Render `dep` (under build/model_repository-<name> unless `repository` is given) and return a
    server on it, not yet started: on free loopback ports unless given, with the CUDA pool sized for
    the deployment, supervised (a dead stub restarts the server; supervisor.py) unless told not to."""
    repo = render_repository(dep, repository or BUILD / f"model_repository-{name}")
    kwargs.setdefault("cuda_pools", dep.cuda_pools())
    kwargs.setdefault("http_max_input_bytes", dep.http_max_input_bytes())
    kwargs.setdefault("log_path", BUILD / f"tritonserver-{name}.log")
    if dep.device == "gpu":  # the stubs' first GPU hand-offs before anyone is told the server is ready
        kwargs.setdefault("first_requests", lambda server, should_stop: warm_up(server.grpc_url, dep,
                                                                               should_stop=should_stop))
    private = None  # the supervised server's own metrics port, distinct from the public ones
    if ports is None:
        http, grpc, metrics, private = free_ports(4)
        ports = Ports(http, grpc, metrics)
    if not supervise:
        return TritonServer(repo, ports=ports, **kwargs)
    server = TritonServer(repo, ports=ports, metrics_port=private or free_ports(1)[0], **kwargs)
    return Supervisor(server, metrics_address=server.address, metrics_port=ports.metrics)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Render the repository and serve the Kimi-K2.5 vision ensembles "
                                             "in the foreground until SIGINT/SIGTERM.")
    try:
        mps_default = env_flag("KIMI_MPS", False)
        encoder_instances = env_int("KIMI_ENCODER_INSTANCES", 1)
        preprocess_instances = env_int("KIMI_PREPROCESS_INSTANCES", 0)
        env_flag("KIMI_GPU_JPEG", True)  # read by the GPU stubs; a bad word stops us here, not their load
        cache_bytes = byte_size(os.environ["KIMI_CACHE_BYTES"], "KIMI_CACHE_BYTES") if os.environ.get("KIMI_CACHE_BYTES") else None
        nixl_bytes = byte_size(os.environ["KIMI_NIXL_BYTES"], "KIMI_NIXL_BYTES") if os.environ.get("KIMI_NIXL_BYTES") else None
        nixl_lifetime_s = env_int("KIMI_NIXL_LIFETIME_S", 30)
    except ValueError as exc:  # one line naming the setting, not a traceback (also for --help)
        raise SystemExit(f"error: {exc}") from None
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default=os.environ.get("KIMI_DEVICE", "auto"))
    ap.add_argument("--checkpoint", default=os.environ.get("KIMI_VISION_CHECKPOINT", ""))
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--repository-dir", type=Path,
                    help="where to render the repository (default: build/model_repository-<device>-<pid>, this "
                         "launch's own, removed at exit)")
    ap.add_argument("--tritonserver", help="an installed tritonserver binary (default: KIMI_TRITONSERVER, else the embedded one)")
    ap.add_argument("--address", default=os.environ.get("KIMI_ADDRESS", "0.0.0.0"),
                    help="where HTTP, gRPC and metrics listen (default 0.0.0.0; 127.0.0.1 keeps them on this host)")
    ap.add_argument("--admin-key", default=os.environ.get("KIMI_ADMIN_KEY", ""),
                    help=f"'<header>=<value>': the {ADMIN_APIS} APIs answer only requests carrying it")
    ap.add_argument("--trace-file", type=Path, default=os.environ.get("KIMI_TRACE_FILE") or None,
                    help="let tritonserver trace requests into this file (each traced request into <file>.<n>) once "
                         "tracing is turned on through its trace API (docs/operations.md#trace-a-request); off until then")
    ap.add_argument("--encoder-instances", type=int, default=encoder_instances,
                    help="moonvit3d instances per GPU (in all on CPU)")
    ap.add_argument("--preprocess-instances", type=int, default=preprocess_instances,
                    help="kimi_preprocess instances per GPU (in all on CPU); 0: 2 per GPU, 1 on CPU")
    ap.add_argument("--cache-bytes", type=_size_argument("--cache-bytes"), default=cache_bytes,
                    help="the embedding cache's budget per encoder instance, e.g. 4G or 512M (default 4G on a GPU, "
                         "1G on CPU; 0 turns the cache off): a media sent again is answered from it")
    ap.add_argument("--nixl-bytes", type=_size_argument("--nixl-bytes"), default=nixl_bytes,
                    help="the NIXL arena per encoder instance, taken at the first request for a descriptor (default 1G "
                         "on a GPU, 256M on CPU; 0: no descriptors): rows waiting for a consumer to read them with NIXL "
                         "(docs/llm_handoff.md#pulling-the-embeddings-with-nixl)")
    ap.add_argument("--nixl-lifetime-s", type=int, default=nixl_lifetime_s,
                    help="how long rows wait unread for their NIXL consumer before they are freed (default 30)")
    ap.add_argument("--mps", action=argparse.BooleanOptionalAction,
                    default=mps_default,
                    help="GPU: start a CUDA MPS control daemon of the server's own for its lifetime, so that the "
                         "model instances' kernels share the GPU (docs/operations.md#scale-out; with --encoder-instances 2 for "
                         "1024^2-sized images). Not where the host already runs one: pass its CUDA_MPS_PIPE_DIRECTORY instead")
    ap.add_argument("extra", nargs="*", help="further tritonserver flags, after --")
    return ap


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str, what: str) -> int:
    """'4G', '512M', '1048576' -> bytes (binary units; a trailing B or iB is allowed); anything else raises
    naming `what`."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = value.rstrip("KMGT"), value[len(value.rstrip("KMGT")):]
    try:
        if unit not in _UNITS or float(number) < 0:
            raise ValueError
        return int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected a size such as 4G, 512M or 0") from None


def _size_argument(flag: str):
    def parse(text: str) -> int:
        try:
            return byte_size(text, flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def start_mps(asked: bool, device: str, folder: Path) -> mps.Daemon | None:
    """The server's own MPS daemon (give the server its env()), or None: not asked for, no GPU
    deployment, or it would not start (then a warning says so and the server runs without it)."""
    if not asked:
        return None
    if device != "gpu":
        print("note: --mps applies to a GPU deployment only; ignored", flush=True)
        return None
    try:
        daemon = mps.start(folder)
    except mps.MpsUnavailable as exc:
        print(f"warning: --mps: {exc}; serving without MPS", flush=True)
        return None
    print(f"CUDA MPS control daemon started for this server (pipe folder {daemon.pipe_dir})", flush=True)
    return daemon


def _exit_on_sigterm(signum, _frame):
    """Until the server is up (then _serve's drain takes over): unwind, so that `finally` stops what was
    started (the MPS daemon), instead of dying on the default action."""
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    taken = port_check.taken(args.address, {"HTTP": args.http_port, "gRPC": args.grpc_port, "metrics": args.metrics_port})
    if taken:  # before anything starts: a readiness probe would otherwise reach whoever holds the port
        for line in taken:
            _error(line)
        if any("already in use" in line for line in taken):
            _error("choose free ones with --http-port, --grpc-port and --metrics-port "
                   "(make serve HTTP_PORT=... GRPC_PORT=... METRICS_PORT=...)", prefix="")
        else:
            _error("listen on an address of this host with --address (KIMI_ADDRESS)", prefix="")
        return 2
    device = resolve_device(args.device)
    try:  # the settings and the checkpoint's config, read now: a mistake is one line, not a traceback
        dep = Deployment(device=device, checkpoint=args.checkpoint, gpus=max(1, gpu_count()),
                         encoder_instances=args.encoder_instances, preprocess_instances=args.preprocess_instances,
                         cache_bytes=args.cache_bytes, nixl_bytes=args.nixl_bytes,
                         nixl_lifetime_ms=args.nixl_lifetime_s * 1000)
        dep.vision
        args.install = TritonInstall.find(args.tritonserver)
        args.allocator = heap.find()
    except (OSError, ValueError, RuntimeError) as exc:
        _error(str(exc))
        return 2
    reaper = Reaper()  # from here on, whatever this launch starts goes with it, however it ends
    args.reaper = reaper
    daemon = None
    try:
        daemon = start_mps(args.mps, device, mps.folder_for(str(args.grpc_port)))
        return _render_and_serve(args, device, dep, daemon)
    finally:
        if daemon is not None:  # after the server and its stubs are gone
            _stop_mps(daemon)
        reaper.close()


def _stop_mps(daemon: mps.Daemon) -> None:
    """Stops the daemon with SIGTERM and SIGINT held off meanwhile (mps.STOP_TIMEOUT_S at most): a second signal must
    neither cut the stop short nor replace the error that brought us here."""
    held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if not daemon.stop():
            print(f"warning: the MPS daemon on {daemon.pipe_dir} was still running {mps.STOP_TIMEOUT_S:.0f} s after "
                  "the server stopped", flush=True)
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)


def _render_and_serve(args, device: str, dep: Deployment, daemon: mps.Daemon | None) -> int:
    # Each launch renders its own repository (removed again at exit), so that two servers started from
    # one checkout never share one, and a restart reuses this launch's rendering, never another's.
    own = args.repository_dir is None
    repository = args.repository_dir or BUILD / f"model_repository-{device}-{os.getpid()}"
    if own and getattr(args, "reaper", None) is not None:
        args.reaper.remove_later(repository)  # should this launcher be killed outright
    try:
        return _serve_rendered(args, device, dep, daemon, repository)
    finally:
        if own:
            shutil.rmtree(repository, ignore_errors=True)


def _serve_rendered(args, device: str, dep: Deployment, daemon: mps.Daemon | None, repository: Path) -> int:
    server = deployment_server(dep, device,
                               repository=repository, ports=Ports(args.http_port, args.grpc_port, args.metrics_port),
                               install=getattr(args, "install", None) or TritonInstall.find(args.tritonserver),
                               extra_args=tuple(args.extra),
                               address=args.address, admin_key=args.admin_key, env=daemon.env() if daemon else None,
                               trace_file=args.trace_file, reaper=getattr(args, "reaper", None),
                               allocator=getattr(args, "allocator", None) or heap.find())
    print(f"rendered {device} repository at {server.repository}; starting tritonserver on {args.address} "
          f"(HTTP {args.http_port}, gRPC {args.grpc_port}, metrics {args.metrics_port})", flush=True)
    if device == "cpu" and gpu_count() == 0:
        print(CPU_STARTUP_NOTE, flush=True)
    print(shm_note(dep), flush=True)
    print(getattr(server, "server", server).allocator.note(), flush=True)
    if device == "gpu":
        print(scan_check_note(), flush=True)
    return _serve(server)


def _serve(server) -> int:
    """Serves in the foreground until SIGTERM / SIGINT, then drains and stops (exit status 0); or until
    tritonserver cannot be started, then says why in one line (exit status 1)."""
    # A plain flag, not an Event: the handler runs on the main thread, which may hold an Event's lock
    # inside its own wait at that moment (Event.set() there would wait for that lock for ever).
    asked = {"stop": False}

    def on_signal(*_):  # SIGTERM from an orchestrator, or Ctrl-C: drain in-flight requests and exit
        asked["stop"] = True
        server.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.start(stream_log=True)
    except (RuntimeError, TimeoutError, OSError) as exc:
        server.stop(0)
        if asked["stop"]:  # asked to stop while starting
            return 0
        _error(f"tritonserver did not start: {first_line(exc)}")
        return 1
    print("ready", flush=True)
    while not asked["stop"]:
        time.sleep(0.2)
        if server.gave_up:  # it kept failing to come back after a restart, the same way each time
            server.stop(0)
            _error(f"tritonserver did not come back after a restart: {server.gave_up}")
            return 1
    server.stop()
    return 0


def _error(line: str, prefix: str = "error: ") -> None:
    """A user's mistake or a start that failed: one line on stderr."""
    print(f"{prefix}{line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
