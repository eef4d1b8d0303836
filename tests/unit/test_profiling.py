"""The stubs' optional profiler (backends/serving/profiling.py): its window, without a server."""

from backends.serving.profiling import ExecuteProfiler


def _window(monkeypatch, folder, skip, calls, trigger=None):
    """The profiler's settings for one test: its folder, the calls it skips, the calls in its window."""
    monkeypatch.setenv("KIMI_PROFILE_DIR", str(folder))
    monkeypatch.setenv("KIMI_PROFILE_SKIP", str(skip))
    monkeypatch.setenv("KIMI_PROFILE_CALLS", str(calls))
    if trigger is None:
        monkeypatch.delenv("KIMI_PROFILE_TRIGGER", raising=False)
    else:
        monkeypatch.setenv("KIMI_PROFILE_TRIGGER", str(trigger))


def _calls(profiler, n):
    for _ in range(n):
        with profiler():
            sum(range(1000))


def test_off_without_a_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("KIMI_PROFILE_DIR", raising=False)
    p = ExecuteProfiler("m")
    _calls(p, 20)
    p.close()
    assert p.prof is None and p.seen == 0


def test_window_after_skip_holds_the_asked_calls(tmp_path, monkeypatch):
    _window(monkeypatch, tmp_path, skip=2, calls=3)
    p = ExecuteProfiler("m")
    _calls(p, 10)
    (out,) = tmp_path.glob("m-*.txt")
    text = out.read_text()
    assert text.startswith("m: 3 execute calls from call 3\n")
    assert "Python, by cumulative time" in text and "function calls" in text


def test_trigger_file_opens_the_window_and_unloading_writes_it(tmp_path, monkeypatch):
    trigger = tmp_path / "START"
    _window(monkeypatch, tmp_path, skip=0, calls=5, trigger=trigger)
    p = ExecuteProfiler("m")
    _calls(p, 4)
    assert p.prof is None and not list(tmp_path.glob("m-*.txt"))
    trigger.touch()
    _calls(p, 2)  # fewer calls than the window: written at unload
    p.close()
    (out,) = tmp_path.glob("m-*.txt")
    assert out.read_text().startswith("m: 2 execute calls from call 5\n")


def test_a_profiler_that_cannot_write_turns_itself_off(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # KIMI_PROFILE_DIR names a file: writing the tables must fail
    _window(monkeypatch, blocker, skip=0, calls=0)  # 0 calls: clamped to 1
    p = ExecuteProfiler("m")
    _calls(p, 5)  # the window closes at the second call, fails to write, and profiling stops
    assert p.prof is None and p.dir == "" and p.calls == 1


def test_the_trace_is_written_beside_the_tables_when_asked(tmp_path, monkeypatch):
    from tools import gpu_timeline

    _window(monkeypatch, tmp_path, skip=0, calls=2)
    monkeypatch.setenv("KIMI_PROFILE_TRACE", "1")
    p = ExecuteProfiler("m")
    _calls(p, 4)
    (trace,) = tmp_path.glob("m-*.json")
    assert trace.with_suffix(".txt").exists()
    assert "traceEvents" in gpu_timeline.load(trace)  # tools/gpu_timeline.py reads it (no GPU events here)
