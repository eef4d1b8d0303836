"""Reading tritonserver's trace records (clients/tracing.py): records as 2.51 writes them, one request's
stretches along the steps that run one after another, and what is refused."""

import pytest

from backends.deploy.launcher import Ports, TritonInstall, build_parser, tritonserver_command
from clients.tracing import TraceError, Tracer, off_path, parse, requests, spans


def _records(root: int, t0: int, protocol: str = "GRPC") -> list[dict]:
    """One ensemble request as 2.51 writes it: a name record, then one record per event (us -> ns)."""
    def model(i, name, parent, events):
        recs = [{"id": i, "model_name": name, "model_version": 1, **({"parent_id": parent} if parent else {})}]
        return recs + [{"id": i, "timestamps": [{"name": n, "ns": t0 + us * 1000}]} for n, us in events]
    step = ("REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
            "COMPUTE_END", "REQUEST_END")
    received, sent = ("GRPC_WAITREAD_END", "GRPC_SEND_END") if protocol == "GRPC" else ("HTTP_RECV_END", "HTTP_SEND_END")
    return [
        *model(root + 3, "kimi_placeholder", root, zip(step, (400, 401, 410, 420, 900, 950, 960))),
        *model(root + 1, "kimi_preprocess", root, zip(step, (20, 21, 30, 40, 300, 600, 610))),
        *model(root + 2, "moonvit3d", root, zip(step, (350, 351, 360, 380, 2000, 2100, 2110))),
        *model(root, "kimi_k25_vision", 0, [("REQUEST_START", 10), ("QUEUE_START", 11), ("REQUEST_END", 2300),
                                            (received, 5), ("INFER_RESPONSE_COMPLETE", 2050), (sent, 2080)]),
    ]


def test_records_group_by_request_and_cut_into_consecutive_stretches():
    reqs = requests(parse(_records(20, 5_000_000) + _records(1, 1_000_000)))  # files may come in any order
    assert [r.root.id for r in reqs] == [1, 20]  # in the order the requests started
    req = reqs[0]
    assert set(req.steps) == {"kimi_preprocess", "moonvit3d", "kimi_placeholder"}
    cut = spans(req, ["kimi_preprocess", "moonvit3d"], sent_ns=1_000_000, received_ns=1_000_000 + 2_150_000)
    assert [round(ms, 3) for _, ms in cut] == [0.005, 0.005, 0.01, 0.01, 0.01, 0.26, 0.05, 0.01, 0.02, 1.62, 0.05, 0.1]
    assert sum(ms for _, ms in cut) == pytest.approx(2.15)
    labels = [label for label, _ in cut]
    assert labels[0] == "client sends, front end reads the request"
    assert labels[6] == "kimi_preprocess's answer -> moonvit3d's request (ensemble)"
    assert labels[-1] == "response written to, and unpacked by, the client"
    assert off_path(req, ["kimi_preprocess", "moonvit3d"]) == {"kimi_placeholder": pytest.approx(1.1)}


def test_without_the_clients_times_the_stretches_run_from_read_to_sent_and_http_works_too():
    req = requests(parse(_records(1, 0, protocol="HTTP")))[0]
    cut = spans(req, ["kimi_preprocess", "moonvit3d"])
    assert cut[-1] == ("response written to the client", pytest.approx(0.03))
    assert sum(ms for _, ms in cut) == pytest.approx((2080 - 5) / 1000)


def test_missing_pieces_are_named():
    recs = _records(1, 0)
    with pytest.raises(TraceError, match="no trace of moonvit3d"):
        spans(requests(parse([r for r in recs if r["id"] != 3]))[0], ["kimi_preprocess", "moonvit3d"])
    with pytest.raises(TraceError, match="names parent 1, which is not in the files read"):
        requests(parse([r for r in recs if r["id"] != 1]))
    no_answer = [r for r in recs if not (r["id"] == 2 and r.get("timestamps", [{}])[0].get("name") == "COMPUTE_OUTPUT_START")]
    with pytest.raises(TraceError, match="kimi_preprocess: no COMPUTE_OUTPUT_START"):
        spans(requests(parse(no_answer))[0], ["kimi_preprocess", "moonvit3d"])
    twice = recs + [{"id": 9, "model_name": "moonvit3d", "model_version": 1, "parent_id": 1}]
    with pytest.raises(TraceError, match="moonvit3d ran twice"):
        requests(parse(twice))


def test_a_server_without_a_trace_file_has_nothing_to_trace():
    with pytest.raises(TraceError, match="without a trace file"):
        Tracer(object(), None)


def test_the_trace_file_reaches_the_command_line_and_the_launcher_takes_it(tmp_path):
    install = TritonInstall("/bin/tritonserver", "/backends")
    cmd = tritonserver_command(install, "/repo", Ports(), cuda_pools={}, trace_file=tmp_path / "t.json")
    assert f"--trace-config=triton,file={tmp_path / 't.json'}" in cmd
    assert not any(a.startswith("--trace-config") for a in tritonserver_command(install, "/repo", Ports(), cuda_pools={}))
    assert build_parser().parse_args(["--trace-file", "/tmp/x.json"]).trace_file.name == "x.json"


class _SettingsClient:
    def __init__(self):
        self.settings = []

    def update_trace_settings(self, settings, headers=None):
        self.settings.append(settings)


def test_a_restarted_servers_trace_that_writes_over_an_old_file_is_read_as_new(tmp_path):
    """A restarted tritonserver numbers its files from 0 again: the same name, new contents."""
    import json
    import os

    file = tmp_path / "trace.json"
    (tmp_path / "trace.json.0").write_text(json.dumps(_records(1, 0)))  # from the server's earlier life
    client = _SettingsClient()
    tracer = Tracer(client, file)
    tracer.trace(1)
    assert client.settings[-1] == {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1",
                                   "log_frequency": "1"}
    with pytest.raises(TraceError, match="0 of 1 traced requests"):
        tracer.read(timeout_s=0.2)  # the old file is not this trace
    new = tmp_path / "trace.json.0"
    new.write_text(json.dumps(_records(7, 9_000_000)))
    stat = new.stat()
    os.utime(new, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a coarse clock must not hide it
    (req,) = tracer.read(timeout_s=1)
    assert req.root.id == 7
    tracer.stop()
    assert client.settings[-1] == {"trace_level": ["OFF"]}
