"""backends.serving.pipeline without a server: every job finished once, in order, the next one launched
before the previous one is answered; failures stay with their job; a full pipeline holds the caller
back; close answers what was submitted; the CUDA plumbing is a no-op on the CPU."""

import threading
import time

import pytest
import torch

from backends.serving.pipeline import Pipeline, Streams


class Log:
    def __init__(self):
        self.events, self.lock = [], threading.Lock()

    def add(self, *event):
        with self.lock:
            self.events.append(event)


def test_jobs_are_finished_once_in_order_and_the_next_is_launched_before_the_previous_is_answered():
    log = Log()
    gate = threading.Event()

    def launch(job):
        log.add("launch", job)
        if job == 0:
            gate.wait(5)  # holds the worker so that jobs 1 and 2 queue behind job 0
        return job * 10

    def finish(job, handle, error):
        log.add("finish", job, handle, error)

    p = Pipeline(launch, finish, depth=2)
    for job in range(3):
        p.submit(job)
    gate.set()
    p.close()
    finished = [e[1] for e in log.events if e[0] == "finish"]
    assert finished == [0, 1, 2]
    assert all(e[2] == e[1] * 10 and e[3] is None for e in log.events if e[0] == "finish")
    order = log.events
    # job 1 launched before job 0 answered; job 2 launched before job 1 answered
    assert order.index(("launch", 1)) < order.index(("finish", 0, 0, None))
    assert order.index(("launch", 2)) < order.index(("finish", 1, 10, None))


def test_a_lone_job_is_answered_without_waiting_for_another():
    done = threading.Event()
    p = Pipeline(lambda job: job, lambda job, handle, error: done.set())
    p.submit("only")
    assert done.wait(5)  # not held back until a next job or close
    p.close()


def test_a_failed_launch_reaches_finish_and_the_next_job_is_served():
    got = []

    def launch(job):
        if job == "bad":
            raise ValueError("this one")
        return job

    p = Pipeline(launch, lambda job, handle, error: got.append((job, handle, error)))
    for job in ("bad", "good"):
        p.submit(job)
    p.close()
    (bad, bad_handle, bad_error), good = got
    assert bad == "bad" and bad_handle is None and isinstance(bad_error, ValueError)
    assert good == ("good", "good", None)


def test_a_finish_that_raises_is_logged_and_the_worker_lives_on(caplog):
    got = []

    def finish(job, handle, error):
        if job == 0:
            raise RuntimeError("send failed")
        got.append(job)

    p = Pipeline(lambda job: job, finish)
    for job in range(3):
        p.submit(job)
    p.close()
    assert got == [1, 2]
    assert "answering a request failed" in caplog.text


def test_a_full_pipeline_holds_the_caller_until_the_worker_takes_a_job():
    gate = threading.Event()
    p = Pipeline(lambda job: gate.wait(5), lambda job, handle, error: None, depth=1)
    p.submit(0)  # taken by the worker, which then waits at the gate
    deadline = time.monotonic() + 5
    while p._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    p.submit(1)  # waits in the queue (depth 1)
    third = threading.Thread(target=p.submit, args=(2,))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # held back: the worker is busy and the queue is full
    gate.set()
    third.join(5)
    assert not third.is_alive()
    p.close()


def test_close_answers_what_was_submitted_and_refuses_more():
    got = []
    p = Pipeline(lambda job: (time.sleep(0.01), job)[1], lambda job, handle, error: got.append(job), depth=4)
    for job in range(5):
        p.submit(job)
    assert p.close() is True
    assert got == list(range(5))
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(5)


def test_a_worker_that_cannot_start_answers_every_job_and_refuses_more(caplog):
    """Its context fails on entry: the job already waiting is finished with that error (not left without
    an answer), and later submits are refused with it."""
    got = []
    entered = threading.Event()

    class Broken:
        def __enter__(self):
            entered.wait(5)
            raise OSError("no device")

        def __exit__(self, *exc):
            return False

    p = Pipeline(lambda job: job, lambda job, handle, error: got.append((job, handle, error)), context=Broken)
    p.submit("waiting")
    entered.set()
    p._thread.join(5)
    assert [(j, h, type(e)) for j, h, e in got] == [("waiting", None, OSError)]
    with pytest.raises(RuntimeError, match="no device"):
        p.submit("later")
    assert "the pipeline's worker stopped" in caplog.text


def test_the_worker_runs_inside_its_context():
    seen = []

    class Context:
        def __enter__(self):
            seen.append(("enter", threading.current_thread().name))

        def __exit__(self, *exc):
            seen.append(("exit", threading.current_thread().name))

    p = Pipeline(lambda job: seen.append(("launch", threading.current_thread().name)),
                 lambda job, handle, error: None, context=Context, name="worker-x")
    p.submit(0)
    p.close()
    assert seen == [("enter", "worker-x"), ("launch", "worker-x"), ("exit", "worker-x")]


def test_up_to_in_flight_jobs_are_launched_before_the_oldest_is_answered():
    """in_flight=3 (two lanes): jobs 0, 1 and 2 are launched before job 0 is finished; never more than
    three launched and unfinished at once."""
    log = Log()
    gate = threading.Event()
    launched_unfinished, most = [0], [0]

    def launch(job):
        if job == 0:
            gate.wait(5)  # the rest queue up behind it
        log.add("launch", job)
        launched_unfinished[0] += 1
        most[0] = max(most[0], launched_unfinished[0])

    def finish(job, handle, error):
        launched_unfinished[0] -= 1
        log.add("finish", job)

    p = Pipeline(launch, finish, depth=5, in_flight=3)  # room for jobs 1-5 while job 0 holds the worker
    for job in range(6):
        p.submit(job)
    gate.set()
    p.close()
    order = log.events
    assert [e[1] for e in order if e[0] == "finish"] == list(range(6))
    assert order.index(("launch", 2)) < order.index(("finish", 0))
    assert most[0] == 3
    with pytest.raises(ValueError):
        Pipeline(launch, finish, in_flight=0)


def test_streams_on_the_cpu_do_nothing():
    s = Streams(torch.device("cpu"), lanes=2)
    assert s.lanes == 1  # lanes are for CUDA streams
    t = torch.zeros(3)
    with s.preprocessing(), s.device_context(), s.lane(0):
        assert s.record_pre() is None
        s.hand_over(None, [t])
        s.before_forward(0, side_by_side=False)
        assert s.after_forward(0, side_by_side=False) is None
        s.wait(None)


def _until(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_stalled_worker_is_reported_once_and_an_idle_pipeline_never():
    """The watchdog: jobs held and no launch or finish for stall_s -> on_stall once (the adapter then
    logs every thread's stack); an empty pipeline, however long idle, is no stall."""
    reports, gate = [], threading.Event()
    p = Pipeline(lambda job: gate.wait(10) if job == "stuck" else job, lambda job, handle, error: None,
                 stall_s=0.2, on_stall=lambda seconds, what: reports.append((seconds, what)))
    time.sleep(0.5)  # idle: nothing held
    assert reports == []
    p.submit("stuck")  # the worker hangs in its launch
    _until(lambda: reports)
    time.sleep(0.5)  # still stuck: reported once, not every period
    assert len(reports) == 1
    seconds, what = reports[0]
    assert seconds >= 0.2 and what == "1 request(s) handed over and none launched or answered"
    gate.set()
    assert p.close(5)
    assert len(reports) == 1


def test_a_stuck_first_stage_is_reported_though_the_worker_holds_nothing():
    """A hang before submit (the caller's preprocessing) leaves the worker idle: first_stage() lets the
    watchdog see it."""
    reports, gate = [], threading.Event()
    p = Pipeline(lambda job: job, lambda job, handle, error: None, stall_s=0.2,
                 on_stall=lambda seconds, what: reports.append(what))

    def caller():
        with p.first_stage():
            gate.wait(10)
        p.submit("after")

    t = threading.Thread(target=caller)
    t.start()
    _until(lambda: reports)
    assert reports == ["a request still in preprocessing (the first stage)"]
    gate.set()
    t.join(5)
    assert p.close(5)
    assert len(reports) == 1


def test_a_failing_stall_report_does_not_stop_the_watch():
    calls, gates = [], [threading.Event(), threading.Event()]

    def on_stall(seconds, what):
        calls.append(what)
        raise RuntimeError("logging failed")

    p = Pipeline(lambda job: gates[job].wait(10), lambda job, handle, error: None, stall_s=0.1, on_stall=on_stall)
    p.submit(0)
    _until(lambda: calls)
    gates[0].set()  # progress resumes, then it stalls again on job 1: a second report
    p.submit(1)
    _until(lambda: len(calls) >= 2)
    gates[1].set()
    assert p.close(5)
    assert len(calls) == 2


def test_a_stall_limit_of_zero_is_refused():
    with pytest.raises(ValueError, match="stall_s"):
        Pipeline(lambda job: job, lambda job, handle, error: None, stall_s=0, on_stall=lambda s, w: None)
