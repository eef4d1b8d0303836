"""The supervisor's pure parts: which failures count once and how totals survive a server restart; and its
restart sequence on a stand-in server: which logs it keeps and when it says it is serving again."""

import threading
import time

from backends.deploy.launcher import TritonServer
from backends.deploy.supervisor import MetricsRelay, Supervisor, failure_counts, model_of, parse_metrics

SCRAPE = """# HELP nv_inference_request_failure ...
nv_inference_request_failure{model="kimi_k25_vision",reason="OTHER",version="1"} 4
nv_inference_request_failure{model="kimi_preprocess",reason="BACKEND",version="1"} 3
nv_inference_request_failure{model="moonvit3d",reason="REJECTED",version="1"} 1
nv_inference_request_failure{model="moonvit3d",reason="CANCELED",version="1"} 2
nv_inference_request_success{model="kimi_placeholder",version="1"} 9
kimi_vision_stub_failures_total{kind="invalid_input",model="kimi_placeholder"} 2
"""


def test_failures_come_from_our_counter_and_the_composing_models_only():
    counts = failure_counts(parse_metrics(SCRAPE))
    assert counts == {("kimi_preprocess", "backend"): 3, ("moonvit3d", "rejected"): 1, ("moonvit3d", "cancelled"): 2,
                      ("kimi_placeholder", "invalid_input"): 2}  # the ensemble's double count is left out


def test_totals_survive_a_restart_and_the_private_counter_is_not_republished():
    relay = MetricsRelay("127.0.0.1", 0, "127.0.0.1:9")
    try:
        relay.last = failure_counts(parse_metrics(SCRAPE))
        relay.server_replaced()
        relay.last = {("kimi_preprocess", "backend"): 1}  # the new server's own count starts again
        assert relay.failures()[("kimi_preprocess", "backend")] == 4
        relay.deaths["kimi_preprocess"] += 1
        text = relay.render()  # the fake triton url does not answer: our families only
        assert 'kimi_vision_request_failures_total{model="kimi_preprocess",kind="backend"} 4' in text
        assert 'kimi_vision_stub_deaths_total{model="kimi_preprocess"} 1' in text
        assert "kimi_vision_stub_failures_total" not in text
    finally:
        relay.stop()


def test_instance_names_map_to_models():
    assert model_of("kimi_preprocess_batched_0_1") == "kimi_preprocess_batched"
    assert model_of("moonvit3d_2_0") == "moonvit3d"


class StandIn:
    """A server whose first `failing` starts fail the way a crash while starting does; it writes one log
    per launch, as tritonserver does. keep_log and kept_log are the real ones."""

    metrics_url = "127.0.0.1:9"  # nothing answers there: scrapes find the server down
    keep_log, kept_log = TritonServer.keep_log, TritonServer.kept_log

    def __init__(self, log_path, failing: int):
        self.log_path, self.failing, self.starts, self.proc = log_path, failing, 0, None
        self.serving_at_start = []  # what the supervisor said while each start ran
        self.supervisor = None

    def start(self, timeout, stream_log=False, on_poll=None, should_stop=None):
        self.starts += 1
        self.serving_at_start.append(self.supervisor.serving.is_set())
        self.log_path.write_text(f"launch {self.starts}\n")
        if self.starts <= self.failing:
            raise RuntimeError("tritonserver exited with code -11 while starting")

    def stop(self, timeout=0, stubs_dead=False):
        pass


def test_a_restart_keeps_the_log_of_the_server_that_went_and_of_the_start_that_failed(tmp_path):
    server = StandIn(tmp_path / "tritonserver-x.log", failing=1)
    sup = server.supervisor = Supervisor(server, metrics_address="127.0.0.1", metrics_port=0)
    try:
        server.log_path.write_text("the server that went\n")
        sup.serving.set()
        sup._restart("server_exited", "tritonserver exited with code -11")
        assert server.serving_at_start == [False, False] and sup.serving.is_set()
        assert (tmp_path / "tritonserver-x.previous.log").read_text() == "the server that went\n"
        assert (tmp_path / "tritonserver-x.failed-start.log").read_text() == "launch 1\n"
        assert server.log_path.read_text() == "launch 2\n"
        assert sup.relay.restarts == {"server_exited": 1}
    finally:
        sup.relay.stop()


def test_the_same_start_failure_three_times_in_a_row_gives_up_with_it(tmp_path, monkeypatch):
    """A server that cannot come back (a port taken meanwhile, say) must not be restarted forever: the
    third identical failure ends the supervision, naming tritonserver's own error line."""
    server = StandIn(tmp_path / "tritonserver-x.log", failing=99)
    sup = server.supervisor = Supervisor(server, metrics_address="127.0.0.1", metrics_port=0)
    monkeypatch.setattr(sup._stop, "wait", lambda *_: False)  # no back-off sleeps in a unit test
    original = server.start

    def start(*args, **kwargs):
        try:
            original(*args, **kwargs)
        finally:  # what tritonserver logs when its port is taken
            server.log_path.write_text("I1204 12:00:00 1 server.cc] starting\n"
                                       "E1204 12:00:01 1 main.cc:245] failed to start HTTP service: Address already in use\n")

    server.start = start
    try:
        sup._restart("stub_died", "a stub died")
        assert server.starts == Supervisor.GIVE_UP_AFTER and not sup.serving.is_set()
        assert sup.gave_up == f"failed to start HTTP service: Address already in use ({Supervisor.GIVE_UP_AFTER} attempts in a row)"
    finally:
        sup.relay.stop()


def test_a_supervised_server_gets_four_distinct_ports(tmp_path):
    from backends.deploy.launcher import deployment_server
    from backends.deploy.repository import Deployment

    sup = deployment_server(Deployment(device="cpu"), "ports", repository=tmp_path / "repo")
    try:
        p = sup.server.ports
        ports = {p.http, p.grpc, p.metrics, sup.server.metrics_port}
        assert len(ports) == 4 and sup.metrics_url == f"127.0.0.1:{p.metrics}"
    finally:
        sup.relay.stop()


def test_only_a_gpu_deployment_sends_first_requests_before_it_is_ready(tmp_path, monkeypatch):
    """A GPU server sends its own requests once ready, before start() returns (first_requests.py: the
    stubs map tritonserver's CUDA pool at their first GPU hand-off); a CPU server has nothing to map."""
    from backends.deploy import launcher
    from backends.deploy.repository import Deployment

    sent = []
    monkeypatch.setattr(launcher, "warm_up", lambda url, dep, should_stop: sent.append((url, dep.device)) or "sent")
    gpu = launcher.deployment_server(Deployment(device="gpu"), "first-gpu", repository=tmp_path / "gpu", supervise=False)
    cpu = launcher.deployment_server(Deployment(device="cpu"), "first-cpu", repository=tmp_path / "cpu", supervise=False)
    assert cpu.first_requests is None
    monkeypatch.setattr(gpu, "wait_ready", lambda *a: sent.append("ready"))
    monkeypatch.setattr(gpu, "launch", lambda *a: sent.append("launched"))
    gpu.start()
    assert sent == ["launched", "ready", (gpu.grpc_url, "gpu")]


def test_first_requests_that_fail_are_logged_and_the_server_serves_on(tmp_path, monkeypatch, caplog):
    from backends.deploy import launcher
    from backends.deploy.repository import Deployment

    def broken(url, dep, should_stop):
        raise ConnectionError("the server went away\nsecond line")

    monkeypatch.setattr(launcher, "warm_up", broken)
    gpu = launcher.deployment_server(Deployment(device="gpu"), "first-fail", repository=tmp_path, supervise=False)
    monkeypatch.setattr(gpu, "wait_ready", lambda *a: None)
    monkeypatch.setattr(gpu, "launch", lambda *a: None)
    with caplog.at_level("WARNING"):
        assert gpu.start() is gpu
    assert "first requests of our own failed: the server went away" in caplog.text
    assert "second line" not in caplog.text


def test_the_first_requests_images_never_repeat():
    """Each warm-up image is new to the embedding cache: numbers past 256 and 65,536 change the bytes too
    (a reload's warm-up after the start-up's draws further numbers from the same counter)."""
    from backends.deploy import first_requests

    n = next(first_requests._NUMBERS)
    assert next(first_requests._NUMBERS) == n + 1
    blobs = {first_requests._image(k) for k in (0, 1, 256, 65536, 256 + 65536)}
    assert len(blobs) == 5


def test_serving_is_clear_after_stop_even_when_a_restart_ends_meanwhile(tmp_path):
    """stop() while the watch thread's restart is inside its start: the start may still return (its last
    look at the stop flag was before), and the supervisor must not then say it is serving."""
    entered, gate = threading.Event(), threading.Event()

    class Slow(StandIn):
        def start(self, *args, **kwargs):
            entered.set()
            gate.wait(10)
            super().start(*args, **kwargs)

    server = Slow(tmp_path / "tritonserver-x.log", failing=0)
    sup = server.supervisor = Supervisor(server, metrics_address="127.0.0.1", metrics_port=0)

    class Recorded(threading.Event):
        """`serving`, counting the times it is set once stop() has begun: the restart must not set it
        (stop() clears it again after the join, which alone would hide such a set from the end state)."""

        sets_after_stop = 0

        def set(self):
            if sup._stop.is_set():
                Recorded.sets_after_stop += 1
            super().set()

    sup.serving = Recorded()
    sup._thread = threading.Thread(target=sup._restart, args=("server_exited", "gone"))
    sup._thread.start()
    assert entered.wait(10)
    stopper = threading.Thread(target=sup.stop)
    stopper.start()
    time.sleep(0.2)  # stop() has set its flag and waits for the restart to end
    gate.set()
    stopper.join(10)
    assert not stopper.is_alive() and server.starts == 1
    assert not sup.serving.is_set() and Recorded.sets_after_stop == 0
