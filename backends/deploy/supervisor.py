"""Keep a tritonserver serving: restart it when one of its Python stubs dies, and serve its metrics
with counters that survive the restart.

Why (docs/triton_runtime.md#known-server-limitations): the 2.51 Python backend never restarts a stub
that died (a crash, the OOM killer, a SIGKILL). From then on every request of that model fails after
about a second with "Stub process ... is not healthy" while /v2/health/ready and every model's ready
endpoint still answer 200, and after some hundreds of such failures the instance blocks for good. So
the supervisor watches the stubs (children of tritonserver; a dead one is gone or a zombie, since
tritonserver never reaps it), and on a death it logs and counts it and reloads that model alone through
the model-repository API (kept behind a key only the launcher knows): new instances, new stubs, while the
other models serve on (about 2 s on the CPU demo, against 7 s for a whole restart); the dead stub's
shared-memory region stays (tritonserver keeps it mapped) until the server stops. Where a reload fails,
or the server itself exited, it kills the server's whole process group, removes its Python-backend shared-memory
regions and starts it again; while it restarts the ports are closed, so readiness is false and an
orchestrator stops routing to it.

Metrics: tritonserver's own endpoint moves to a loopback port, and the public metrics port serves its
text plus our families (`MetricsRelay`):
- kimi_vision_request_failures_total{model,kind}: every failed request once, at the composing model
  where it failed. invalid_input and internal come from our own code (Triton counts per-request
  errors as successes); backend (e.g. a dead stub), rejected (queue full), cancelled and other come
  from tritonserver's failure counters of the composing models (its ensemble counters count each
  failure twice in 2.51, so they are not used);
- kimi_vision_stub_deaths_total{model}, kimi_vision_model_reloads_total{model},
  kimi_vision_server_restarts_total{reason}.
Counts are kept across restarts: the last values read from a server are added to a base before it is
replaced.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import threading
import time
import urllib.request
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import contract

log = logging.getLogger("kimi_vision.supervisor")

STUB_BINARY = "triton_python_backend_stub"
# The counter our stubs keep (backends/serving/triton_models.py); the relay folds it into the public one.
STUB_FAILURES = "kimi_vision_stub_failures_total"
FAILURES = "kimi_vision_request_failures_total"
_TRITON_REASONS = {"BACKEND": "backend", "REJECTED": "rejected", "CANCELED": "cancelled", "OTHER": "other"}
_ENSEMBLES = (contract.ENSEMBLE, contract.BATCHED_ENSEMBLE)
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def stub_processes(server_pid: int, exclude: set[int] = frozenset()) -> dict[str, int]:
    """Live Python stubs started by `server_pid`: instance name -> pid. A zombie (dead, never reaped by
    tritonserver) is not live; `dead_stub_pids` finds those. `exclude`: pids to leave out (the old
    instances of a reloaded model, which may still be exiting under the same names)."""
    stubs = {}
    for pid, state, comm in _children(server_pid):
        if state == "Z" or pid in exclude:
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        # argv: stub, model.py path, shm region, sizes, parent pid, lib dir, ipc handle, instance name, ...
        if argv[0].endswith(STUB_BINARY.encode()) and len(argv) > 8:
            stubs[argv[8].decode()] = pid
    return stubs


def dead_stub_pids(server_pid: int) -> list[int]:
    """Stubs of `server_pid` that died: zombies, which tritonserver never reaps (their cmdline is gone,
    their 15-character comm remains)."""
    return [pid for pid, state, comm in _children(server_pid) if state == "Z" and STUB_BINARY.startswith(comm)]


def processes(proc: Path = Path("/proc")):
    """(pid, state, ppid, pgrp, comm) of every process, from /proc/<pid>/stat (processes that exit
    while being read are skipped)."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        state, ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        yield int(entry.name), state, int(ppid), int(pgrp), comm


def _children(parent: int) -> list[tuple[int, str, str]]:
    """(pid, state, comm) of `parent`'s child processes."""
    return [(pid, state, comm) for pid, state, ppid, _, comm in processes() if ppid == parent]


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (tritonserver and its stubs, say)."""
    children: dict[int, list[int]] = {}
    for child, _, ppid, _, _ in processes():
        children.setdefault(ppid, []).append(child)
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def reap_orphans(server_pid: int) -> None:
    """As PID 1 (a container without an init) the launcher inherits the stubs of a server it killed:
    reap those zombies, never the server itself (its Popen waits for it)."""
    for pid, state, _ in _children(os.getpid()):
        if state == "Z" and pid != server_pid:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def start_failure(exc: BaseException, log_file: Path | None) -> str:
    """What went wrong in a failed start, in one line: tritonserver's first error line from its log where
    there is one (glog's E lines, e.g. a port it could not bind), else the first line of the exception."""
    if log_file is not None:
        try:
            for line in log_file.read_text(errors="replace").splitlines():
                if line.startswith("E") and "]" in line:
                    return line.split("]", 1)[1].strip()
        except OSError:
            pass
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def model_of(instance: str) -> str:
    """kimi_preprocess_0_0 -> kimi_preprocess (Triton names instances <model>_<group>_<index>)."""
    return instance.rsplit("_", 2)[0]


def scrape_text(metrics_url: str, timeout_s: float = 5) -> str:
    """One scrape of a Prometheus endpoint at host:port, as text."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=timeout_s) as r:
        return r.read().decode()


def scrape(metrics_url: str, timeout_s: float = 5) -> list[tuple[str, dict[str, str], float]]:
    """One scrape of a Prometheus endpoint at host:port, as parse_metrics' samples."""
    return parse_metrics(scrape_text(metrics_url, timeout_s))


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            labels = dict(_LABEL.findall(m.group(2) or ""))
            try:
                samples.append((m.group(1), labels, float(m.group(3))))
            except ValueError:
                pass
    return samples


def failure_counts(samples) -> dict[tuple[str, str], float]:
    """(model, kind) -> failed requests, from one scrape of a tritonserver's metrics."""
    counts: dict[tuple[str, str], float] = defaultdict(float)
    for name, labels, value in samples:
        if name == STUB_FAILURES:
            counts[(labels.get("model", ""), labels.get("kind", ""))] += value
        elif name == "nv_inference_request_failure" and labels.get("model") not in _ENSEMBLES:
            kind = _TRITON_REASONS.get(labels.get("reason", ""), "other")
            counts[(labels.get("model", ""), kind)] += value
    return dict(counts)


class MetricsRelay:
    """The public metrics endpoint: tritonserver's own text (without our stubs' private counter) plus
    the supervisor's families, totals kept across server restarts."""

    def __init__(self, address: str, port: int, triton_metrics: str):
        self.triton_metrics = triton_metrics  # tritonserver's metrics endpoint, host:port
        self.lock = threading.Lock()
        self.base: dict[tuple[str, str], float] = defaultdict(float)  # failures of replaced servers
        self.last: dict[tuple[str, str], float] = {}  # the current server's, at its last scrape
        self.deaths: dict[str, int] = defaultdict(int)
        self.restarts: dict[str, int] = defaultdict(int)
        self.reloads: dict[str, int] = defaultdict(int)
        self.generation = 0  # which server lifetime `last` belongs to
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = relay.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes are not news
                pass

        self.httpd = ThreadingHTTPServer((address, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="kimi-metrics", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()

    def scrape(self) -> str | None:
        """tritonserver's metrics text, None while it is down; updates the current server's counts. A
        scrape that started before the server was replaced is dropped (it would count twice)."""
        with self.lock:
            generation = self.generation
        try:
            text = scrape_text(self.triton_metrics, timeout_s=2)
        except (OSError, http.client.HTTPException, ValueError):  # down, or cut off mid-answer
            return None
        counts = failure_counts(parse_metrics(text))
        with self.lock:
            if generation == self.generation:
                # Counters only grow during one server's life: the larger value wins, so a scrape that
                # read the server earlier but answers later cannot take counts back.
                self.last = {k: max(counts.get(k, 0.0), self.last.get(k, 0.0)) for k in set(counts) | set(self.last)}
        return text

    def server_replaced(self) -> None:
        """Fold the replaced server's last counts into the base (call after a final scrape)."""
        with self.lock:
            self.generation += 1
            for key, value in self.last.items():
                self.base[key] += value
            self.last = {}

    def failures(self) -> dict[tuple[str, str], float]:
        with self.lock:
            keys = set(self.base) | set(self.last)
            return {k: self.base.get(k, 0.0) + self.last.get(k, 0.0) for k in keys}

    def render(self) -> str:
        text = self.scrape() or ""
        kept = [line for line in text.splitlines() if STUB_FAILURES not in line]
        out = kept + [
            f"# HELP {FAILURES} Failed requests, each once, by the composing model where it failed and kind "
            f"(invalid_input, internal, backend, rejected, cancelled, other)",
            f"# TYPE {FAILURES} counter",
        ]
        out += [f'{FAILURES}{{model="{m}",kind="{k}"}} {int(v)}' for (m, k), v in sorted(self.failures().items())]
        with self.lock:
            out += ["# HELP kimi_vision_stub_deaths_total Python stubs found dead, by model",
                    "# TYPE kimi_vision_stub_deaths_total counter"]
            out += [f'kimi_vision_stub_deaths_total{{model="{m}"}} {n}' for m, n in sorted(self.deaths.items())]
            out += ["# HELP kimi_vision_model_reloads_total models reloaded alone by the supervisor after a stub died",
                    "# TYPE kimi_vision_model_reloads_total counter"]
            out += [f'kimi_vision_model_reloads_total{{model="{m}"}} {n}' for m, n in sorted(self.reloads.items())]
            out += ["# HELP kimi_vision_server_restarts_total tritonserver restarts by the supervisor, by reason",
                    "# TYPE kimi_vision_server_restarts_total counter"]
            out += [f'kimi_vision_server_restarts_total{{reason="{r}"}} {n}' for r, n in sorted(self.restarts.items())]
        return "\n".join(out) + "\n"


class Supervisor:
    """Runs a TritonServer (backends.deploy.launcher) and keeps it serving; the relay serves metrics.

    Same surface as TritonServer for its users (start/stop, context manager, urls, log_path, kept_log)."""

    GIVE_UP_AFTER = 3
    RELOADS_PER_MINUTE = 3  # reloads of one model within a minute before the whole server restarts instead

    def __init__(self, server, *, metrics_address: str, metrics_port: int, poll_s: float = 0.5,
                 start_timeout: float = 600.0):
        self.server = server
        self.poll_s = poll_s
        self.start_timeout = start_timeout
        self.relay = MetricsRelay(metrics_address, metrics_port, server.metrics_url)
        self.public_metrics = f"127.0.0.1:{metrics_port}"
        self._stop = threading.Event()
        # Set once the server it started last was ready; cleared when the watch notices that server gone
        # (within a poll) and a restart begins, and at stop. A caller that relies on the server waits for
        # it (and for readiness: a server that has just died still has it set until the next poll).
        self.serving = threading.Event()
        self._thread: threading.Thread | None = None
        self.expected: dict[str, int] = {}
        # Zombies of stubs whose model was reloaded: tritonserver never reaps them; not deaths any more.
        self.buried: set[int] = set()
        # A dead stub's model is reloaded alone (False: the whole server restarts, as for a server that exited).
        self.reload_models = True
        self._reloaded_at: dict[str, list[float]] = {}
        self.stream_log = False
        self._last_ready = 0.0
        self._quick_restarts = 0
        self._last_scrape = 0.0
        # Why it stopped trying: the same start failure GIVE_UP_AFTER times in a row (a port another
        # process took meanwhile, a broken checkpoint); the launcher then exits with it.
        self.gave_up = ""

    # TritonServer's surface
    grpc_url = property(lambda self: self.server.grpc_url)
    http_url = property(lambda self: self.server.http_url)
    metrics_url = property(lambda self: self.public_metrics)
    log_path = property(lambda self: self.server.log_path)
    proc = property(lambda self: self.server.proc)
    repository = property(lambda self: self.server.repository)
    trace_file = property(lambda self: self.server.trace_file)

    def ready(self) -> bool:
        return self.server.ready()

    def log_tail(self, chars: int = 4000) -> str:
        return self.server.log_tail(chars)

    def kept_log(self, kind: str = "previous") -> Path:
        return self.server.kept_log(kind)

    def request_stop(self) -> None:
        """From a signal handler: abandon a start or restart in progress; stop() then finishes."""
        self._stop.set()

    def start(self, timeout: float | None = None, stream_log: bool = False) -> "Supervisor":
        """Start and wait until ready (request_stop() abandons the start with a RuntimeError)."""
        self.stream_log = stream_log
        self._start_server(timeout or self.start_timeout)
        self.serving.set()
        self.relay.start()
        self._thread = threading.Thread(target=self._watch, name="kimi-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.serving.clear()
        if self._thread is not None:
            self._thread.join()
        self.serving.clear()  # a restart that was ending as stop() began may have set it again
        self.server.stop(timeout, stubs_dead=bool(self.dead_stubs()))
        self.relay.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _start_server(self, timeout: float) -> None:
        self.expected = {}
        self.buried = set()
        self.server.start(timeout, stream_log=self.stream_log, on_poll=self._learn_stubs,
                          should_stop=self._stop.is_set)
        self._last_ready = time.monotonic()

    def _learn_stubs(self) -> None:
        """Remember each stub's instance name by pid while it is alive (a dead one has no cmdline left)."""
        if self.server.proc is not None:
            for name, pid in stub_processes(self.server.proc.pid, self.buried).items():
                self.expected.setdefault(name, pid)

    def dead_stubs(self) -> list[str]:
        """Instances whose stub died: gone from the stubs seen at readiness, or a zombie child (which
        also catches a stub that died before it was seen)."""
        if self.server.proc is None or self.server.proc.poll() is not None:
            return []
        now = stub_processes(self.server.proc.pid, self.buried)
        dead = [name for name, pid in self.expected.items() if now.get(name) != pid]
        known = set(self.expected.values()) | self.buried
        dead += [f"pid {pid}" for pid in dead_stub_pids(self.server.proc.pid) if pid not in known]
        return sorted(dead)

    def _keep_log(self, kind: str) -> Path | None:
        """The server's log moved aside as `<stem>.<kind>.log` (its path), or None: nothing to keep when the
        server logs to standard output, and a failure to move it must not stop a restart."""
        if self.stream_log:
            return None
        try:
            return self.server.keep_log(kind)
        except OSError as exc:
            log.warning("could not keep tritonserver's log (%s)", exc)
            return None

    def _watch(self) -> None:
        """The supervisor's loop. It must not die: a failure in one round is logged and the next one runs."""
        self._last_scrape = 0.0
        while not self._stop.wait(self.poll_s):
            try:
                self._round()
            except Exception:  # noqa: BLE001
                log.exception("supervisor round failed; watching on")

    def _round(self) -> None:
        if os.getpid() == 1:
            reap_orphans(self.server.proc.pid if self.server.proc else -1)
        if self.server.proc.poll() is not None:
            self._restart("server_exited", f"tritonserver exited with code {self.server.proc.returncode}")
            return
        self._learn_stubs()
        dead = self.dead_stubs()
        if dead and len(dead) >= len(self.expected) and self._exits_within(3.0):
            # Every stub gone at once: the server itself is going down (a crash tears its stubs down
            # before it exits), not a stub of its own.
            self._restart("server_exited", f"tritonserver exited with code {self.server.proc.returncode}")
            return
        if dead:
            with self.relay.lock:
                for name in dead:
                    self.relay.deaths[model_of(name) if not name.startswith("pid ") else "unknown"] += 1
            if not self._reload(dead):
                self._restart("stub_died", f"Python stub(s) {', '.join(dead)} died")
        elif time.monotonic() - self._last_scrape > 2.0:
            self.relay.scrape()  # keeps the failure counts current should the server vanish
            self._last_scrape = time.monotonic()

    def _exits_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.server.proc.poll() is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _reload(self, dead: list[str]) -> bool:
        """Reload the models of the dead stubs alone (tritonserver replaces every instance of a model it
        loads); True when each came back, or when a stop interrupted the reload, False to restart the whole
        server instead: a stub seen only as a zombie pid names no model; a model reloaded RELOADS_PER_MINUTE
        times within a minute (a stub that keeps dying: the restart also reaps its zombies); a load the
        server refuses or that brings no live stubs."""
        if not self.reload_models or any(name.startswith("pid ") for name in dead):
            return False
        models = sorted({model_of(name) for name in dead})
        now = time.monotonic()
        for model in models:
            recent = [t for t in self._reloaded_at.get(model, []) if now - t < 60]
            if len(recent) >= self.RELOADS_PER_MINUTE:
                log.error("%s reloaded %d times within a minute; restarting tritonserver instead", model, len(recent))
                return False
            self._reloaded_at[model] = recent + [now]
        # Every instance of those models is replaced: forget them all (their pids stay buried: the old
        # stubs exit under the same names while the new ones start).
        old = [name for name in self.expected if model_of(name) in models]
        for name in old:
            self.buried.add(self.expected.pop(name))
        log.error("Python stub(s) %s died; reloading %s (the other models serve on)", ", ".join(dead), ", ".join(models))
        result: dict = {}
        loader = threading.Thread(target=self._load, args=(models, result), name="kimi-reload", daemon=True)
        loader.start()
        while loader.is_alive():
            if self._stop.wait(0.1):
                return True  # stopping: stop() takes the server down, reload or not
        if "error" in result:
            log.error("reloading %s failed (%s); restarting tritonserver instead", ", ".join(models), result["error"])
            return False
        deadline = time.monotonic() + 10  # the new stubs are up when the load answers; allow a moment
        while True:
            self._learn_stubs()
            missing = [name for name in old if name not in self.expected] + self.dead_stubs()
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if missing:
            log.error("reloading %s left %s without a live stub; restarting tritonserver instead", ", ".join(models),
                      ", ".join(missing))
            return False
        # The dead stub's /dev/shm region stays mapped by tritonserver; the launcher removes it at stop.
        with self.relay.lock:
            for model in models:
                self.relay.reloads[model] += 1
        if hasattr(self.server, "send_first_requests"):
            self.server.send_first_requests(self._stop.is_set)  # the new stubs' first GPU hand-offs (first_requests.py)
        log.info("%s reloaded in %.1f s", ", ".join(models), time.monotonic() - now)
        return True

    def _load(self, models: list[str], result: dict) -> None:
        """Load each model through the repository API with the launcher's key (in a thread: a stop must not
        wait for a load, which on a GPU includes the encoder's start-up captures)."""
        key = getattr(self.server, "reload_key", "")
        header, _, value = key.partition("=")
        try:
            for model in models:
                # tritonserver reloads a loaded model only when its folder changed since it was loaded (a
                # death after the stub's __pycache__ was written was a no-op load that left the model
                # without a stub): touch the model's folder and everything in it.
                folder = Path(self.server.repository) / model
                for path in [folder, *folder.rglob("*")]:
                    try:
                        os.utime(path)
                    except FileNotFoundError:  # a file replaced meanwhile (a .pyc being written)
                        pass
                request = urllib.request.Request(f"http://{self.server.http_url}/v2/repository/models/{model}/load",
                                                 data=b"{}", method="POST", headers={header: value} if key else {})
                with urllib.request.urlopen(request, timeout=self.start_timeout) as response:
                    response.read()
        except Exception as exc:  # noqa: BLE001 - any failure: the whole restart, which always works
            result["error"] = exc

    def _restart(self, reason: str, why: str) -> None:
        self.serving.clear()
        with self.relay.lock:
            self.relay.restarts[reason] += 1
        log.error("%s; restarting tritonserver (its ports close until it is ready again)", why)
        self.relay.scrape()  # the failures the dead stub caused, while the server still answers
        self.server.stop(0, stubs_dead=True)
        # Only now: a scrape that began after the new generation would otherwise still read the old
        # server and count its failures twice, in the base and as the new server's.
        self.relay.server_replaced()
        self._keep_log("previous")  # why it went is in there; the restart writes a new one
        # A stub that dies again right after the last restart: back off instead of looping tightly.
        since = time.monotonic() - self._last_ready
        self._quick_restarts = self._quick_restarts + 1 if since < 60 else 0
        if self._quick_restarts:
            self._stop.wait(min(2.0 ** (self._quick_restarts - 1), 30.0))  # 1, 2, 4, ... 30 s
        delay, failures = 1.0, []
        while not self._stop.is_set():
            try:
                self._start_server(self.start_timeout)
                if not self._stop.is_set():  # stop() may have cleared it meanwhile: not serving then
                    self.serving.set()
                    log.info("tritonserver is ready again")
                return
            except Exception as exc:  # noqa: BLE001 - keep trying; readiness stays false meanwhile
                # The next attempt would overwrite why this one failed.
                kept = self._keep_log("failed-start") if not self._stop.is_set() else None
                failures.append(start_failure(exc, kept))
                if len(failures) >= self.GIVE_UP_AFTER and len(set(failures[-self.GIVE_UP_AFTER:])) == 1:
                    self.gave_up = f"{failures[-1]} ({self.GIVE_UP_AFTER} attempts in a row)"
                    log.error("tritonserver did not come back: %s; giving up", self.gave_up)
                    self._stop.set()
                    return
                log.error("tritonserver did not come back (%s)%s; retrying in %.0f s", exc,
                          f"; its log is kept as {kept}" if kept else "", delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 30.0)
