"""tritonserver's own request traces (clients/tracing.py) on the shared server, which starts with a trace
file as the launcher's --trace-file gives it: off until turned on, one file per traced request, every
model of the ensemble linked to its request, and stretches that add up to the client's wall time."""

import time

import pytest

from bench.stage_bench import PATH, batch_table, traced_concurrent, traced_pass, trace_table
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like
from clients.tracing import Tracer, TraceError, numbered, spans
from contract import ENCODER, ENSEMBLE, PLACEHOLDER, PREPROCESS

BLOBS = [encode(photo_like(96, 64, seed=5), "JPEG", quality=90), encode(photo_like(70, 50, seed=6), "PNG")]


@pytest.fixture
def clients(server):
    grpc, http = KimiVisionClient(server.grpc_url), KimiVisionClient(server.http_url, protocol="http")
    yield grpc, http
    grpc.close()
    http.close()


def _files(server) -> set:
    return set(numbered(server.trace_file))


def test_traced_requests_over_both_protocols_cut_into_stretches_that_add_up(server, clients):
    grpc, http = clients
    ids = chat_prompt_ids(len(BLOBS))
    grpc.infer(ids, BLOBS)  # untraced: tracing starts off
    time.sleep(0.5)
    # Weak alone (the server starts with log_frequency 0, which would write only at shutdown); the check
    # that an untraced request writes nothing is the one after the first tracer.stop() below, with
    # log_frequency at 1.
    assert not _files(server)
    tracer = Tracer(grpc.client, server.trace_file)
    tracer.trace(2)
    times = []
    try:
        for client in (grpc, http):
            sent = time.monotonic_ns()
            client.infer(ids, BLOBS)
            times.append((sent, time.monotonic_ns()))
        traced = tracer.read()
    finally:
        tracer.stop()
    assert len(traced) == 2
    for req, (sent, received) in zip(traced, times):
        assert req.root.model == ENSEMBLE
        assert set(req.steps) == {PREPROCESS, ENCODER, PLACEHOLDER}
        assert all(t.parent == req.root.id for t in req.steps.values())
        cut = spans(req, PATH, sent, received)
        # Each cut point follows the one before it by cause (the next step needs the answer of the one
        # before; the client sends before the server reads): a negative stretch means a wrong cut.
        assert all(ms >= 0 for _, ms in cut), cut
        # Consecutive points from the send to the receive: no stretch left out between them.
        assert sum(ms for _, ms in cut) == pytest.approx((received - sent) / 1e6, abs=1e-6)
        assert len({label for label, _ in cut}) == len(cut)
    # Turned off: the next request writes nothing; one traced after it writes exactly one file (so a
    # late write from the untraced one would show here too).
    before = _files(server)
    grpc.infer(ids, BLOBS)
    time.sleep(0.5)
    assert _files(server) == before
    tracer.trace(1)
    try:
        grpc.infer(ids, BLOBS)
        assert len(tracer.read()) == 1
    finally:
        tracer.stop()
    time.sleep(0.5)
    assert len(_files(server) - before) == 1


def test_the_stage_benchmarks_traced_pass_on_a_real_server(server, clients):
    grpc, _ = clients
    ids = chat_prompt_ids(len(BLOBS))
    tracer = Tracer(grpc.client, server.trace_file)
    result = traced_pass(lambda: grpc.infer(ids, BLOBS), tracer, server.metrics_url, 3)
    stretches = result["stretches"]
    assert any(label.startswith(PREPROCESS) for label in stretches) and any(label.startswith(ENCODER) for label in stretches)
    assert all(result["our_code_ms"][m] > 0 for m in PATH)  # our execute ran in each stub
    # Our code runs inside the stretch in its stub, request by request, so on average too.
    for m in PATH:
        assert result["our_code_ms"][m] <= result["stretch_means"][f"{m}: in its stub, until its answer is back"], (m, result)
    # Our code taken apart by phase (KIMI_PHASES=1 on the shared server): the phases lie inside it.
    pre = {k.partition("|")[2]: ms for k, ms in result["phases_ms"].items() if k.startswith(PREPROCESS + "|")}
    assert {"read inputs", "prompt check", "headers", "Pillow decode", "patchify", "output tensors"} <= set(pre), pre
    assert result["phases_ms"].get(f"{ENCODER}|forward launched", 0) > 0
    for m in PATH:  # the phases span the step time, but for the microseconds around them
        total = sum(ms for k, ms in result["phases_ms"].items() if k.startswith(m + "|"))
        assert total == pytest.approx(result["our_code_ms"][m], rel=0.02, abs=0.05), (m, result)
    table = "\n".join(trace_table({"case": {"trace": result}}, 3))
    assert f"| {PREPROCESS}'s our code, mean / this stretch's mean |" in table and "| sum of the medians |" in table
    assert "| - of which headers (mean) |" in table


def test_concurrent_requests_traced_show_the_encoders_batches(server, clients):
    """The stage benchmark's concurrent pass: 8 requests from 4 threads, all traced. The shared server's
    batching window puts concurrent requests into one encoder execution; one instance, so its
    executions follow each other."""
    grpc, _ = clients
    ids = chat_prompt_ids(len(BLOBS))
    made = []

    def make_send(held):
        own = KimiVisionClient(server.grpc_url)
        held.callback(own.close)
        made.append(own)
        return lambda: own.infer(ids, BLOBS)

    result = traced_concurrent(make_send, Tracer(grpc.client, server.trace_file), 8, 4)
    assert len(made) == 4  # one sender per thread, closed with the pass
    assert result["requests"] == 8 and sum(result["batch_sizes"]) == 8
    assert max(result["batch_sizes"]) > 1, result  # a batch was formed
    assert result["batches"] == len(result["batch_sizes"]) < 8
    assert result["median"]["gap"] >= 0 and 0 < result["encoder_busy"] <= 1
    steady = result["steady_requests_per_s"]
    assert steady is None or steady > 0, result
    table = "\n".join(batch_table({"case": {"batches": result, "images": 2, "encoder_ms": 10.0}}))
    steady_cell = "-" if steady is None else f"{steady * 2:.1f}"
    assert f"| case | 8 | {result['requests_per_s'] * 2:.1f} | {steady_cell} | 200.0 |" in table, table


def test_reading_traces_that_never_come_names_the_shortfall(server, clients):
    grpc, _ = clients
    tracer = Tracer(grpc.client, server.trace_file)
    tracer.trace(1)
    tracer.stop()  # nothing sent: nothing traced
    with pytest.raises(TraceError, match="0 of 1 traced requests"):
        tracer.read(timeout_s=0.3)
