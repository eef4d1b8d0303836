"""The GPU soak's device-memory verdict (lab/bench/soak.py), without a server: what the stubs' allocator
gauges add up to, and when idle memory outside our caches counts as a leak."""

from lab.bench.soak import IDLE_SLACK_MIB, cuda_allocator, idle_verdict


def test_allocator_gauges_sum_over_instances_and_uncached_is_alloc_minus_cached():
    instances = {("kimi_preprocess_0_0", "alloc"): 2.0, ("kimi_preprocess_0_0", "reserved"): 20.0,
                 ("moonvit3d_0_0", "alloc"): 150.0, ("moonvit3d_0_0", "cached"): 50.0,
                 ("moonvit3d_0_0", "reserved"): 300.0}
    assert cuda_allocator(instances) == {"alloc": 152.0, "reserved": 320.0, "cached": 50.0, "uncached": 102.0}
    assert cuda_allocator({}) == {}  # a CPU server: no gauges, no columns


def test_idle_uncached_may_not_grow_beyond_the_slack():
    line, ok = idle_verdict({"uncached": 100.0}, {"uncached": 102.0}, 0.05, gpu=True)
    assert ok and "flat" in line and "NOT" not in line
    # One leaked cuBLAS workspace (32 MiB), the leak this verdict was made for, fails.
    line, ok = idle_verdict({"uncached": 100.0}, {"uncached": 132.0}, 0.05, gpu=True)
    assert not ok and "NOT flat" in line
    assert IDLE_SLACK_MIB < 32
    # The relative bound applies to large baselines; shrinking is never a leak.
    assert idle_verdict({"uncached": 1000.0}, {"uncached": 1040.0}, 0.05, gpu=True)[1]
    assert idle_verdict({"uncached": 1000.0}, {"uncached": 100.0}, 0.05, gpu=True)[1]


def test_a_gpu_soak_without_gauges_fails_and_a_cpu_soak_has_no_device_verdict():
    line, ok = idle_verdict({"rss": 1.0}, {"rss": 1.0}, 0.05, gpu=True)
    assert not ok and "no CUDA allocator gauges" in line
    assert idle_verdict({"rss": 1.0}, {"rss": 1.0}, 0.05, gpu=False) == ("", True)


def test_a_scrape_that_fails_in_any_way_gives_no_gauges_not_a_crash(monkeypatch):
    """The soak reads the gauges between phases: a metrics endpoint that is down, cuts its answer short or
    sends bytes that are not text leaves the columns empty ("-") instead of ending a long run."""
    import http.client
    from types import SimpleNamespace

    from lab.bench import soak

    server = SimpleNamespace(metrics_url="127.0.0.1:1")
    for exc in (ConnectionRefusedError(), http.client.IncompleteRead(b"kimi"),
                UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")):
        def fail(url, exc=exc):
            raise exc
        monkeypatch.setattr(soak, "scrape", fail)
        assert soak.allocator_by_instance(server) == {}
    monkeypatch.setattr(soak, "scrape", lambda url: [("kimi_vision_cuda_memory_bytes",
                                                      {"instance": "moonvit3d_0_0", "kind": "cached"}, 2.0**21)])
    assert soak.allocator_by_instance(server) == {("moonvit3d_0_0", "cached"): 2.0}
