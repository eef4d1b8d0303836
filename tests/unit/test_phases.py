"""The phase clock (backends/phases.py): off, it records nothing; on, each mark charges the time since
the previous one, per thread; and the real preprocessing path marks its phases, adding up to no more
than its own wall time."""

import threading
import time

import numpy as np
import pytest

from backends import phases
from backends.config import DEMO_CONFIG, Limits
from backends.preprocess import Preprocessor
from backends.serving.metrics import ModelMetrics
from clients.samples import encode, photo_like
from fake_pb_utils import FakePbUtils


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setattr(phases, "ENABLED", True)


def test_off_it_records_nothing(monkeypatch):
    monkeypatch.setattr(phases, "ENABLED", False)  # the default, unless KIMI_PHASES says otherwise
    monkeypatch.setattr(phases._local, "clock", None, raising=False)  # whatever an earlier test left open
    phases.begin()
    phases.mark("a")
    assert getattr(phases._local, "clock", None) is None  # no clock was opened, nothing was charged
    assert phases.end() == {}


def test_marks_charge_the_time_since_the_previous_one_in_first_marked_order(on):
    assert getattr(phases._local, "clock", None) is None
    phases.mark("before any request")  # no clock open: nothing
    assert getattr(phases._local, "clock", None) is None
    phases.begin()
    time.sleep(0.02)
    phases.mark("slow")
    phases.mark("quick")
    time.sleep(0.01)
    phases.mark("slow")  # again: adds up
    got = phases.end()
    assert list(got) == ["slow", "quick"]
    assert got["slow"] >= 0.03 and got["quick"] < got["slow"]
    assert phases.end() == {}  # closed


def test_each_thread_has_its_own_clock(on):
    seen = {}

    def other():
        phases.begin()
        phases.mark("other thread")
        seen.update(phases.end())

    phases.begin()
    t = threading.Thread(target=other)
    t.start()
    t.join()
    phases.mark("this thread")
    assert list(phases.end()) == ["this thread"] and list(seen) == ["other thread"]


def test_the_preprocessing_path_marks_its_phases(on):
    pre = Preprocessor(DEMO_CONFIG.media, Limits())
    blobs = [encode(photo_like(300, 200, seed=1), "JPEG", quality=90), encode(photo_like(64, 48, seed=2), "PNG")]
    start = time.perf_counter()
    phases.begin()
    pixels, grids, _ = pre(blobs)
    got = phases.end()
    wall = time.perf_counter() - start
    assert pixels.shape[0] == int(np.prod(grids, axis=1).sum())
    assert {"scan checks started", "headers", "plan", "route", "Pillow decode", "resize", "patchify"} <= set(got)
    assert list(got)[:3] == ["scan checks started", "headers", "plan"]
    assert 0 < sum(got.values()) <= wall


def test_the_phase_counter_exists_only_when_asked_for():
    pb = FakePbUtils()
    m = ModelMetrics(pb, "kimi_preprocess", flush_s=3600, phases_on=True)
    m.phases({"headers": 0.001, "plan": 0.0005})
    m.phases({"headers": 0.002})
    m.flush()
    sent = {(f, labels): v for _, f, labels, v in pb.sent}
    assert sent[("kimi_vision_phase_seconds_total", (("model", "kimi_preprocess"), ("phase", "headers")))] == pytest.approx(0.003)
    m.close()
    pb = FakePbUtils()
    m = ModelMetrics(pb, "kimi_preprocess", flush_s=3600)
    m.phases({"headers": 0.001})
    m.flush()
    assert pb.sent == []
    m.close()
