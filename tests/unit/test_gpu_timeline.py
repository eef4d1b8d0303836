"""tools/gpu_timeline.py's summary of a trace's GPU events, on hand-made traces."""

import json

from tools import gpu_timeline


def event(ts, dur, stream=7, name="k", cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_busy_is_the_union_and_gaps_are_what_lies_between():
    events = [event(0, 10), event(5, 10, stream=8), event(40, 20), event(1100, 5, cat="gpu_memcpy")]
    s = gpu_timeline.summarize(events)
    assert s["span_us"] == 1105
    assert s["busy_us"] == 15 + 20 + 5  # 0-15 (two streams overlapping), 40-60, 1100-1105
    assert s["idle_us"] == 1105 - 40
    assert s["overlap_us"] == 5  # 5-10 covered twice
    assert s["gaps"][10.0] == (2, 25 + 1040)
    assert s["gaps"][100.0] == (1, 1040)
    assert s["gaps"][1000.0] == (1, 1040)
    assert s["largest_gaps_us"] == [1040, 25]
    assert s["streams"]["7"] == (3, 35) and s["streams"]["8"] == (1, 10)


def test_a_nested_event_does_not_end_the_busy_stretch_early():
    s = gpu_timeline.summarize([event(0, 100), event(10, 5), event(50, 70)])
    assert s["busy_us"] == 120 and s["idle_us"] == 0


def test_only_complete_gpu_events_count(tmp_path):
    trace = {"traceEvents": [event(0, 10), event(0, 10, cat="cpu_op"), {"ph": "i", "cat": "kernel", "ts": 3},
                             event(20, 1, cat="gpu_memset")]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    events = gpu_timeline.gpu_events(gpu_timeline.load(path))
    assert [e["cat"] for e in events] == ["kernel", "gpu_memset"]
    assert gpu_timeline.main([str(path), "--requests", "2", "--compare", str(path), "--compare-requests", "1"]) == 0


def test_kernels_by_name_and_their_comparison_per_request():
    a = gpu_timeline.kernels_by_name([event(0, 10, name="gemm"), event(20, 30, name="gemm"), event(60, 4, name="rope")])
    b = gpu_timeline.kernels_by_name([event(0, 15, name="gemm")])
    assert a == {"gemm": (2, 40.0), "rope": (1, 4.0)}
    lines = gpu_timeline.compare(a, 2, b, 1, ("server", "alone"))
    assert lines[2] == "| gemm | 1.0, 20.0 | 1.0, 15.0 | +5.0 |"
    assert lines[-1] == "| all | 22.0 | 15.0 | +7.0 |"


def test_a_gap_names_what_launched_the_event_after_it_and_when():
    trace = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "tid": 5, "args": {"name": "worker"}},
        {"ph": "X", "cat": "cpu_op", "name": "encode", "tid": 5, "ts": 100, "dur": 400},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "tid": 5, "ts": 300, "dur": 5,
         "args": {"correlation": 9}},
        {**event(0, 100), "name": "first"},
        {**event(400, 10), "name": "second", "args": {"stream": 7, "correlation": 9}},
    ]}
    (line,) = gpu_timeline.gap_details(trace)
    assert line.startswith("- 300 us idle at +0.1 ms: after first (stream 7), then second (stream 7)")
    assert line.endswith("launched by cudaGraphLaunch at +200 us from the gap's start on worker, inside encode")
