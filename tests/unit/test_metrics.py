"""Our metrics leave the request path: the request adds to local sums, a sender thread hands them to
the server (here a recording stand-in for pb_utils' metric API)."""

import threading
import time

import pytest

from backends.errors import RequestError
from backends.serving.metrics import ModelMetrics
from fake_pb_utils import FakePbUtils


def test_request_path_sends_nothing_and_the_sender_sums():
    pb = FakePbUtils()
    m = ModelMetrics(pb, "kimi_preprocess", flush_s=3600)  # the thread never wakes on its own here
    for _ in range(3):
        m.preprocessed(8, 2048)
        m.decodes({("gpu", ""): 8})
        m.step_time(0.004)
    m.failure(RequestError("bad", "placeholder_mismatch"))
    assert pb.sent == []  # nothing left the request path
    m.close()
    incs = {(f, labels): v for kind, f, labels, v in pb.sent if kind == "inc"}
    assert incs[("kimi_vision_images_total", (("model", "kimi_preprocess"),))] == 24
    assert incs[("kimi_vision_patches_total", (("model", "kimi_preprocess"),))] == 3 * 2048
    assert incs[("kimi_vision_decodes_total", (("model", "kimi_preprocess"), ("path", "gpu"), ("reason", "-")))] == 24
    assert incs[("kimi_vision_rejections_total", (("model", "kimi_preprocess"), ("reason", "placeholder_mismatch")))] == 1
    assert incs[("kimi_vision_stub_failures_total", (("kind", "invalid_input"), ("model", "kimi_preprocess")))] == 1
    assert [v for kind, *_, v in pb.sent if kind == "obs"] == [0.004] * 3


def test_the_sender_thread_delivers_without_close():
    pb = FakePbUtils()
    m = ModelMetrics(pb, "moonvit3d", flush_s=0.01)
    m.step_time(0.02)
    deadline = time.monotonic() + 5
    while not pb.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pb.sent == [("obs", "kimi_vision_step_seconds", (("model", "moonvit3d"),), 0.02)]
    assert pb.threads == {"kimi-metrics-moonvit3d"}
    m.close()


def test_a_metric_error_is_swallowed_and_the_rest_still_sent():
    pb = FakePbUtils(fail_first=True)
    m = ModelMetrics(pb, "kimi_placeholder", flush_s=3600)
    m.preprocessed(1, 4)
    m.close()
    assert [f for _, f, _, _ in pb.sent] == ["kimi_vision_patches_total"]  # images_total failed, patches sent


def test_a_sender_that_cannot_start_costs_no_request(monkeypatch, caplog):
    pb = FakePbUtils()
    m = ModelMetrics(pb, "kimi_preprocess", flush_s=3600)

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    m.step_time(0.001)  # must not raise
    m.preprocessed(1, 4)
    assert m._thread is None and any("could not start the metrics sender" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    m.step_time(0.002)  # the next request starts it
    assert m._thread is not None
    m.close()
    assert sorted(v for kind, *_, v in pb.sent if kind == "obs") == [0.001, 0.002]


def test_cuda_memory_gauges_per_instance_set_when_they_change():
    pb = FakePbUtils()
    readings = iter([{"allocated": 100.0, "reserved": 200.0}, {"allocated": 100.0, "reserved": 200.0},
                     {"allocated": 150.0, "reserved": 200.0}])
    m = ModelMetrics(pb, "kimi_preprocess", flush_s=3600, instance="kimi_preprocess_0_1", memory=lambda: next(readings))
    for _ in range(3):
        m.send_memory()
    labels = lambda kind: (("instance", "kimi_preprocess_0_1"), ("kind", kind), ("model", "kimi_preprocess"))
    assert pb.sent == [("set", "kimi_vision_cuda_memory_bytes", labels("allocated"), 100.0),
                       ("set", "kimi_vision_cuda_memory_bytes", labels("reserved"), 200.0),
                       ("set", "kimi_vision_cuda_memory_bytes", labels("allocated"), 150.0)]  # unchanged: not re-sent
    m.close()


def test_allocator_gauges_read_the_nested_stats_once():
    from backends.serving.metrics import allocator_gauges

    pool = lambda n: {"current": n, "peak": 2 * n, "allocated": 3 * n, "freed": n}  # noqa: E731
    stats = {"allocated_bytes": {"all": pool(100), "small_pool": pool(40), "large_pool": pool(60)},
             "reserved_bytes": {"all": pool(300), "small_pool": pool(100), "large_pool": pool(200)},
             "num_alloc_retries": 0}
    assert allocator_gauges(stats) == {"allocated": 100.0, "reserved": 300.0}
    assert allocator_gauges({}) == {"allocated": 0.0, "reserved": 0.0}  # no CUDA context yet
    with pytest.raises(KeyError):  # a torch that renamed its counters: an error, never a silent zero
        allocator_gauges({"num_alloc_retries": 0})


def test_no_gauge_family_without_a_gpu():
    m = ModelMetrics(FakePbUtils(), "kimi_placeholder", flush_s=3600)
    assert "kimi_vision_cuda_memory_bytes" not in m._families
    m.close()


def test_the_memory_gauges_have_a_sender_before_any_request():
    m = ModelMetrics(FakePbUtils(), "moonvit3d", flush_s=3600, memory=lambda: {"allocated": 0.0, "reserved": 0.0})
    assert m._thread is not None and m._thread.is_alive()
    m.close()
    assert not m._thread.is_alive()


def test_close_does_not_wait_forever_on_a_sender_stuck_in_a_round_trip(caplog):
    m = ModelMetrics(FakePbUtils(), "kimi_preprocess", flush_s=3600)
    m.CLOSE_WAIT_S = 0.05
    m._sending.acquire()  # what a sender blocked inside a server call holds
    try:
        m.close()
    finally:
        m._sending.release()
    assert any("still busy" in r.getMessage() for r in caplog.records)


def test_the_embedding_caches_counts_go_out_as_they_grow_and_its_bytes_as_a_gauge():
    import torch

    from backends.cache.store import EmbeddingCache

    pb = FakePbUtils()
    m = ModelMetrics(pb, "moonvit3d", flush_s=3600, instance="moonvit3d_0_0")
    cache = EmbeddingCache(800)
    m.watch_cache(cache)
    m.flush()  # at load: the counters exist at 0
    assert {(f, v) for kind, f, _, v in pb.sent if kind == "set"} == {("kimi_vision_cache_bytes", 0)}
    cache.get(b"a")
    cache.put(b"a", torch.zeros(100))
    cache.get(b"a")
    cache.put(b"b", torch.zeros(150))  # evicts a
    m.flush()
    m.flush()  # nothing new: nothing sent again
    incs = [(f, v) for kind, f, _, v in pb.sent if kind == "inc"]
    assert sorted(incs) == [("kimi_vision_cache_evictions_total", 1), ("kimi_vision_cache_hits_total", 1),
                            ("kimi_vision_cache_misses_total", 1)]
    sets = [(f, labels, v) for kind, f, labels, v in pb.sent if kind == "set"]
    assert sets[-1] == ("kimi_vision_cache_bytes", (("instance", "moonvit3d_0_0"), ("model", "moonvit3d")), 600)
    m.close()
