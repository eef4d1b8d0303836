"""backends.serving.responder: moonvit3d's responses sent after execute returns (no server needed;
the integration tests send every encoder response this way through tritonserver)."""

import threading
import time

import pytest

from backends.serving.responder import Responder


def _collector():
    got, lock = [], threading.Lock()

    def make(tag):
        def send(error):
            with lock:
                got.append((tag, error))
        return send

    return got, make


def test_sends_after_the_wait_in_submission_order():
    got, make = _collector()
    order = []
    r = Responder(max_pending=2)
    r.submit(lambda: order.append("wait1"), [make("a"), make("b")])
    r.submit(None, [make("c")])
    r.close()
    assert got == [("a", None), ("b", None), ("c", None)]
    assert order == ["wait1"]
    assert r.sent == 3 and r.failed_sends == 0


def test_a_failed_wait_reaches_every_request_of_its_batch_only():
    got, make = _collector()
    boom = RuntimeError("device lost")

    def wait():
        raise boom

    r = Responder()
    r.submit(wait, [make("a"), make("b")])
    r.submit(None, [make("c")])
    r.close()
    assert got == [("a", boom), ("b", boom), ("c", None)]


def test_a_failing_send_does_not_stop_the_others():
    got, make = _collector()

    def bad(error):
        raise ValueError("cannot send")

    r = Responder()
    r.submit(None, [make("a"), bad, make("b")])
    r.submit(None, [make("c")])
    r.close()
    assert [tag for tag, _ in got] == ["a", "b", "c"]
    assert r.failed_sends == 1 and r.sent == 3


def test_submit_blocks_while_max_pending_batches_wait():
    got, make = _collector()
    release = threading.Event()
    r = Responder(max_pending=1)
    r.submit(release.wait, [make("first")])
    second_in = threading.Event()

    def submit_second():
        r.submit(None, [make("second")])
        second_in.set()

    t = threading.Thread(target=submit_second)
    t.start()
    assert not second_in.wait(0.3)  # the first batch still waits: no room
    assert got == []
    release.set()
    assert second_in.wait(5)
    t.join(5)
    r.close()
    assert [tag for tag, _ in got] == ["first", "second"]


def test_close_answers_everything_submitted_and_refuses_more():
    got, make = _collector()
    r = Responder(max_pending=4)
    for i in range(4):
        r.submit(lambda: time.sleep(0.02), [make(i)])
    r.close()
    assert [tag for tag, _ in got] == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="closed"):
        r.submit(None, [make("late")])
    r.close()  # twice is harmless


def test_start_hook_runs_on_the_responder_thread_and_its_failure_is_not_fatal():
    seen = []
    got, make = _collector()
    r = Responder(on_start=lambda: seen.append(threading.current_thread().name), name="enc-responder")
    r.submit(None, [make("a")])
    r.close()
    assert seen == ["enc-responder"]

    def broken():
        raise OSError("no device")

    r = Responder(on_start=broken)
    r.submit(None, [make("b")])
    r.close()
    assert [tag for tag, _ in got] == ["a", "b"]


def test_max_pending_must_be_positive():
    with pytest.raises(ValueError):
        Responder(max_pending=0)
