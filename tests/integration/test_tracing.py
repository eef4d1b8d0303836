"""tritonserver's own request traces (clients/tracing.py) on the shared server, which starts with a trace
file as the launcher's --trace-file gives it: off until turned on, one file per traced request, every
model of the ensemble linked to its request, and stretches that add up to the client's wall time."""

import time

import pytest

from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like
from clients.tracing import Tracer, TraceError, numbered, spans
from contract import ENCODER, ENSEMBLE, PLACEHOLDER, PREPROCESS

PATH = [PREPROCESS, ENCODER]  # the steps one request runs one after another (kimi_placeholder runs beside ENCODER)
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


def test_reading_traces_that_never_come_names_the_shortfall(server, clients):
    grpc, _ = clients
    tracer = Tracer(grpc.client, server.trace_file)
    tracer.trace(1)
    tracer.stop()  # nothing sent: nothing traced
    with pytest.raises(TraceError, match="0 of 1 traced requests"):
        tracer.read(timeout_s=0.3)
