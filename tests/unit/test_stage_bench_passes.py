"""bench/stage_bench's concurrent traced pass when a sender cannot be set up: the error comes back, no
thread is left waiting, what the senders held is closed, and tracing is turned off again (the real pass runs in
tests/integration/test_tracing.py)."""

import threading

import pytest

from bench.stage_bench import traced_concurrent


class _Tracer:
    def __init__(self):
        self.calls = []

    def trace(self, n):
        self.calls.append(("trace", n))

    def stop(self):
        self.calls.append(("stop",))

    def read(self, timeout_s=10.0):
        raise AssertionError("nothing was sent: nothing to read")


def test_a_sender_that_cannot_be_set_up_fails_the_pass_without_hanging():
    made, sent, closed, lock = [], [], [], threading.Lock()

    def make_send(held):
        held.callback(lambda: closed.append(1))
        with lock:
            made.append(1)
            third = len(made) == 3
        if third:
            raise RuntimeError("no region for this thread")
        return lambda: sent.append(1)

    tracer = _Tracer()
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="no region for this thread"):
        traced_concurrent(make_send, tracer, 8, 4)
    assert tracer.calls == [("trace", 8), ("stop",)]
    assert threading.active_count() == len(before)  # every worker returned
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert sent == [] and len(closed) == 3  # nothing sent; what the senders set up was closed
