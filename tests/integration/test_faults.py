"""A server that survives its own faults: a Python stub killed under load is healed by the supervisor,
which reloads that model alone while the others serve on (or, where told not to reload, restarts the
server, readiness false meanwhile); the death is counted; so is tritonserver's own crash, whose log is
kept; and shutdown leaves no process and nothing in /dev/shm."""

import os
import signal
import threading
import time
from pathlib import Path

from backends.deploy.launcher import _live_in_group, deployment_server
from backends.deploy.repository import Deployment
from backends.deploy.supervisor import model_of, scrape, stub_processes
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like
from server_state import restarts as server_restarts

MODELS = ["kimi_placeholder", "kimi_preprocess", "moonvit3d", "kimi_placeholder_batched", "kimi_preprocess_batched"]


def _metrics(server) -> list:
    return scrape(server.metrics_url)


def _value(samples, name, **labels) -> float:
    return sum(v for n, l, v in samples if n == name and all(l.get(k) == x for k, x in labels.items()))


class Load:
    """Requests through both ensembles in a loop; counts what came back."""

    def __init__(self, server):
        self.server, self.ok, self.failed, self.stop = server, 0, 0, threading.Event()
        self.blob = encode(photo_like(120, 90, seed=5), "JPEG", quality=90)
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            # Not while the supervisor restarts the server: calls that fail to connect meanwhile would keep
            # this process's gRPC connection backing off (seconds, growing), past the server's return.
            if not self.server.serving.wait(1.0):
                continue
            for batched in (False, True):
                c = None
                try:
                    c = KimiVisionClient(self.server.grpc_url, batched=batched)
                    c.infer(chat_prompt_ids(1), [self.blob], timeout_s=20)
                    self.ok += 1
                except Exception:  # noqa: BLE001 - failures while a stub is dead or the server restarts
                    self.failed += 1
                    time.sleep(0.05)
                finally:
                    if c is not None:
                        c.close()


def _serves(server, batched: bool) -> bool:
    try:
        c = KimiVisionClient(server.grpc_url, batched=batched)
        r = c.infer(chat_prompt_ids(1), [encode(photo_like(64, 64, seed=1), "PNG")], timeout_s=20)
        c.close()
        return r.image_embeds.shape[0] > 0
    except Exception:  # noqa: BLE001
        return False


def _healed(server, reason: str, restarts: int, batched: bool, backoff_s: float = 0.0) -> bool:
    """After a kill: readiness turns false, then the supervisor's restart (the `restarts`-th for `reason`)
    completes and the server serves again. Waiting for the supervisor too matters: the new server can
    answer before the supervisor's own readiness poll sees it, and a kill in that window would land on
    a server that is, for the supervisor, still starting."""
    # Generous: the requirement is 30 s on a quiet machine, plus the supervisor's back-off before a
    # restart that comes soon after the last one (1, 2, 4, ... 30 s).
    deadline = time.monotonic() + 90 + backoff_s
    saw_not_ready = False
    while time.monotonic() < deadline:
        if not server.ready():
            saw_not_ready = True
        elif saw_not_ready and server.serving.is_set() and server_restarts(server).get(reason, 0) == restarts \
                and _serves(server, batched=batched):
            return True
        time.sleep(0.2)
    return False


def _counts_served(server) -> bool:
    """A request that kimi_placeholder alone answers (counts from the image's header)."""
    try:
        c = KimiVisionClient(server.grpc_url)
        r = c.infer(chat_prompt_ids(1), [encode(photo_like(64, 64, seed=1), "PNG")], outputs=["IMAGE_TOKEN_COUNTS"],
                    timeout_s=20)
        c.close()
        return r.token_counts.tolist() == [9]  # a 64 x 64 image: 84 x 84 after the resize rule, 3 x 3 tokens
    except Exception:  # noqa: BLE001
        return False


def _reloaded(server, model: str, reloads: int, batched: bool) -> bool:
    """After a kill: the supervisor's reload of `model` (its `reloads`-th) is counted and the ensemble
    serves again."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if server.relay.reloads.get(model, 0) == reloads and _serves(server, batched=batched):
            return True
        time.sleep(0.2)
    return False


def test_each_models_stub_killed_under_load_is_reloaded_alone_and_counted(caplog):
    server = deployment_server(Deployment(device="cpu"), "faults")
    server.kept_log("previous").unlink(missing_ok=True)  # an earlier run's
    prefixes = []
    server.start()
    try:
        load = Load(server)
        load.thread.start()
        for model in MODELS:
            prefixes.append(server.server.shm_prefix)
            live = stub_processes(server.proc.pid, exclude=set(server.buried))  # not a reloaded model's old stub
            stubs = {name: pid for name, pid in live.items() if model_of(name) == model}
            assert stubs, f"no stub of {model} found"
            name, pid = next(iter(stubs.items()))
            os.kill(pid, signal.SIGKILL)
            if model != "kimi_placeholder":  # the other models serve while one is reloaded
                assert _counts_served(server), f"kimi_placeholder did not answer while {model} was down"
            assert _reloaded(server, model, 1, model.endswith("_batched")), f"not reloaded after {name} died"
            assert _serves(server, batched=False) and _serves(server, batched=True), f"not serving after {name} died"
        load.stop.set()
        load.thread.join()
        assert load.ok > 0
        assert server_restarts(server).get("stub_died", 0) == 0  # no whole restart: each model reloaded alone
        # tritonserver itself dying (2.51 can, on a cancelled gRPC request): restarted the same way, counted
        # apart, and the dead server's log kept beside the new one.
        os.kill(server.proc.pid, signal.SIGSEGV)
        assert _healed(server, "server_exited", 1, False, backoff_s=30), "not healed after tritonserver died"
        assert _serves(server, batched=True), "not serving after tritonserver died"
        assert "Signal (11) received" in server.kept_log("previous").read_text(errors="replace")
        samples = _metrics(server)
        assert _value(samples, "kimi_vision_server_restarts_total", reason="server_exited") == 1
        for model in MODELS:
            assert _value(samples, "kimi_vision_stub_deaths_total", model=model) == 1, model
            assert _value(samples, "kimi_vision_model_reloads_total", model=model) == 1, model
        assert _value(samples, "kimi_vision_server_restarts_total", reason="stub_died") == 0
        logged = [r.getMessage() for r in caplog.records if r.name == "kimi_vision.supervisor"]
        for model in MODELS:
            assert any(f"{model}_0_0 died" in m for m in logged), (model, logged)
        # Where reloading is off (or a reload fails), a dead stub restarts the whole server.
        server.reload_models = False
        live = stub_processes(server.proc.pid, exclude=set(server.buried))  # not a reloaded model's old stub
        name, pid = next((n, p) for n, p in live.items() if model_of(n) == "moonvit3d")
        os.kill(pid, signal.SIGKILL)
        assert _healed(server, "stub_died", 1, False, backoff_s=30), f"not healed after {name} died"
        assert _serves(server, batched=True)
    finally:
        pid = server.proc.pid
        prefixes.append(server.server.shm_prefix)
        server.stop()  # bounded by construction: SIGINT, its timeout, then a kill (at once with a dead stub)
    assert not _live_in_group(pid)  # the server and every stub are gone (at most unreaped zombies remain)
    left = [p.name for p in Path("/dev/shm").iterdir() if any(p.name.startswith(x) for x in prefixes)]
    assert left == [], left


def test_a_model_of_two_instances_is_reloaded_and_one_that_keeps_dying_restarts_the_server():
    """A reload replaces every instance of the model (their stubs keep their names under new pids); a
    model reloaded RELOADS_PER_MINUTE times within a minute is restarted with the whole server instead."""
    server = deployment_server(Deployment(device="cpu", preprocess_instances=2), "faults-two")
    with server:
        assert _serves(server, batched=False)
        limit = server.RELOADS_PER_MINUTE
        for k in range(limit + 1):
            # The live instances only: the last reload's old stubs may still be exiting under the same names
            # (the supervisor has buried their pids), and a kill of one of those is no death to notice.
            live = stub_processes(server.proc.pid, exclude=set(server.buried))
            stubs = sorted((n, p) for n, p in live.items() if model_of(n) == "kimi_preprocess")
            assert len(stubs) == 2, stubs
            name, pid = stubs[k % 2]
            os.kill(pid, signal.SIGKILL)
            if k < limit:
                assert _reloaded(server, "kimi_preprocess", k + 1, batched=False), f"not reloaded after {name} died"
                assert server_restarts(server).get("stub_died", 0) == 0
            else:
                assert _healed(server, "stub_died", 1, False, backoff_s=30), f"not restarted after {name} died again"
        assert server.relay.reloads["kimi_preprocess"] == limit
        assert _serves(server, batched=False)
