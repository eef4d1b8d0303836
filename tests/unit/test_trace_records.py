"""Reading tritonserver's trace records (clients/tracing.py): records as 2.51 writes them, one request's
stretches along the steps that run one after another, and what is refused."""

import pytest

from backends.deploy.launcher import Ports, TritonInstall, build_parser, tritonserver_command
from clients.tracing import Batch, TraceError, Tracer, batch_stretches, batches, off_path, parse, requests, spans, steady_rate


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


def test_requests_that_share_an_execution_are_one_batch():
    """Two requests in one encoder execution (same COMPUTE_* times), then a third alone."""
    def request(root, t0, enc):
        recs = [r for r in _records(root, t0) if r["id"] != root + 2]  # without its own moonvit3d
        step = ("REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
                "COMPUTE_END", "REQUEST_END")
        recs.append({"id": root + 2, "model_name": "moonvit3d", "model_version": 1, "parent_id": root})
        recs += [{"id": root + 2, "timestamps": [{"name": n, "ns": us * 1000}]} for n, us in zip(step, enc)]
        return recs
    first = (100, 101, 110, 130, 2000, 2100, 2110)
    second = (2200, 2201, 2300, 2310, 4000, 4050, 4060)
    reqs = requests(parse(request(1, 0, first) + request(10, 50, first) + request(20, 1000, second)))
    found = batches(reqs, "moonvit3d")
    assert [(b.size, b.start) for b in found] == [(2, 110_000), (1, 2_300_000)]
    rows = batch_stretches(found)
    assert rows[0] == {"size": 2, "inputs": pytest.approx(0.02), "stub": pytest.approx(1.87),
                       "responses": pytest.approx(0.1), "gap": pytest.approx(0.2)}
    assert rows[1]["gap"] is None and rows[1]["size"] == 1


def test_the_steady_rate_leaves_out_the_first_and_the_last_execution():
    """Executions of 1, 8, 8, 8 and 3 requests starting 0, 10, 110, 210 and 310 ms: between the second
    start and the last, 24 requests in 300 ms (80 per second); the first (a lone request before the
    others arrived) and the last (the stragglers) do not count. Fewer than three executions: no rate."""
    ms = 1_000_000
    found = [Batch(size, start * ms, start * ms + 1, start * ms + 2, start * ms + 8 * ms)
             for size, start in ((1, 0), (8, 10), (8, 110), (8, 210), (3, 310))]  # each ends before the next
    assert steady_rate(found) == pytest.approx(80.0)
    assert steady_rate(list(reversed(found))) == pytest.approx(80.0)  # the order they were found in
    assert steady_rate(found[:2]) is None and steady_rate([]) is None
    assert steady_rate([found[0], found[1], Batch(8, 10 * ms, 0, 0, 0)]) is None  # no time between starts


def test_the_batch_table_shows_the_steady_rate_or_a_dash():
    """stage_bench's table of the encoder's executions: the steady rate as images/s, "-" where the pass
    found too few executions (or an older result has none)."""
    from bench.stage_bench import batch_table

    base = {"requests": 48, "concurrency": 16, "requests_per_s": 40.0, "batches": 7, "batch_sizes": [8] * 6,
            "median": {"size": 8, "inputs": 0.3, "stub": 16.5, "responses": 156.0, "gap": 0.7}, "encoder_busy": 0.997}
    with_rate = "\n".join(batch_table({"8x448^2": {"batches": {**base, "steady_requests_per_s": 46.0},
                                                    "images": 8, "encoder_ms": 21.5}}))
    assert "| 8x448^2 | 48 | 320.0 | 368.0 | 372.1 | 7 | 8 |" in with_rate, with_rate
    for batches in ({**base, "steady_requests_per_s": None}, base):
        table = "\n".join(batch_table({"8x448^2": {"batches": batches, "images": 8, "encoder_ms": 21.5}}))
        assert "| 8x448^2 | 48 | 320.0 | - | 372.1 | 7 | 8 |" in table, table
