"""backends.deploy.native_stacks: the report a stalled run leaves (bench.perf on a perf_analyzer timeout,
tools/lanes_probe.py on a failed request). Found by command name, every thread listed, with gdb's
backtraces where gdb can attach and /proc's thread states where it cannot."""

import os
import subprocess
import time

from backends.deploy import native_stacks


def test_a_process_named_tritonserver_is_found_and_reported(tmp_path):
    fake = tmp_path / "tritonserver"  # argv0's name is what identifies a server
    fake.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(fake), "30"])
    try:
        deadline = time.monotonic() + 5
        while proc.pid not in native_stacks.server_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.pid in native_stacks.server_pids()
        assert os.getpid() not in native_stacks.server_pids()
        out = tmp_path / "stacks.txt"
        text = native_stacks.dump(out, pids=[proc.pid])
        assert out.read_text() == text
        assert f"== pid {proc.pid}: {fake} 30" in text
        # gdb's frames (e.g. nanosleep) where it could attach, else one /proc line per thread
        assert "#0" in text or f"  {proc.pid} 'sleep' state S" in text, text
    finally:
        proc.kill()
        proc.wait()


def test_without_gdb_each_thread_has_its_state_and_wait_channel(monkeypatch):
    monkeypatch.setattr(native_stacks.shutil, "which", lambda name: None)
    text = native_stacks.dump(pids=[os.getpid()])
    assert text.startswith("native stacks (no gdb: /proc threads only), 1 process(es)")
    assert f"  {os.getpid()} " in text and " state R wchan " in text  # this thread, running
