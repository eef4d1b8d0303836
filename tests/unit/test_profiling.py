"""The stubs' profiling switch (backends/serving/profiling.py, KIMI_PROFILE_DIR): its window, without a server."""

import json

from backends.serving.profiling import ExecuteProfiler


def _calls(profiler, n):
    for _ in range(n):
        with profiler():
            sum(range(1000))


def test_off_without_a_directory(monkeypatch):
    monkeypatch.delenv("KIMI_PROFILE_DIR", raising=False)
    p = ExecuteProfiler("m")
    _calls(p, 20)
    p.close()
    assert p.prof is None and p.seen == 0


def test_the_window_after_the_first_calls_writes_its_tables_and_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_PROFILE_DIR", str(tmp_path))
    p = ExecuteProfiler("m", skip=2, calls=3)
    _calls(p, 10)
    (out,) = tmp_path.glob("m-*.txt")
    text = out.read_text()
    assert text.startswith("m: 3 execute calls from call 3\n")
    assert "Python, by cumulative time" in text and "function calls" in text
    assert "traceEvents" in json.loads(out.with_suffix(".json").read_text())


def test_unloading_writes_a_window_that_saw_fewer_calls(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_PROFILE_DIR", str(tmp_path))
    p = ExecuteProfiler("m", skip=0, calls=5)
    _calls(p, 2)
    assert not list(tmp_path.glob("m-*.txt"))
    p.close()
    (out,) = tmp_path.glob("m-*.txt")
    assert out.read_text().startswith("m: 2 execute calls from call 1\n")


def test_a_profiler_that_cannot_write_turns_itself_off(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # KIMI_PROFILE_DIR names a file: writing the tables must fail
    monkeypatch.setenv("KIMI_PROFILE_DIR", str(blocker))
    p = ExecuteProfiler("m", skip=0, calls=0)  # 0 calls: clamped to 1
    _calls(p, 5)  # the window closes at the second call, fails to write, and profiling stops
    assert p.prof is None and p.dir == "" and p.calls == 1
