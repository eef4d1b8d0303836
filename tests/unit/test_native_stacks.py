"""backends.deploy.native_stacks: the report a stalled run leaves (bench.perf on a perf_analyzer timeout,
tools/lanes_probe.py on a failed request). The server and its live stubs (found as the supervisor finds
them), every thread listed, with gdb's backtraces where gdb can attach and /proc's thread states where
it cannot."""

import os
import subprocess
import sys
import time

from backends.deploy import native_stacks


def test_a_server_and_its_stub_are_reported(tmp_path):
    stub = tmp_path / "triton_python_backend_stub"  # argv[0] names a stub; argv[8] its instance
    stub.symlink_to(sys.executable)
    spawn = (f"import subprocess, time; subprocess.Popen([{str(stub)!r}, '-c', 'import time; time.sleep(30)', "
             f"'1', '2', '3', '4', '5', 'fused_0_0']); time.sleep(30)")
    server = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        deadline = time.monotonic() + 10
        while len(native_stacks.server_and_stubs(server.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = native_stacks.server_and_stubs(server.pid)
        assert len(pids) == 2 and pids[0] == server.pid
        out = tmp_path / "stacks.txt"
        text = native_stacks.dump(pids, out)
        assert out.read_text() == text
        assert f"== pid {server.pid}: " in text and f"== pid {pids[1]}: {stub} -c" in text
        # gdb's frames where it could attach, else one /proc line per thread
        assert "#0" in text or f"  {pids[1]} " in text, text
    finally:
        subprocess.run(["pkill", "-P", str(server.pid)], check=False)
        server.kill()
        server.wait()


def test_without_gdb_each_thread_has_its_state_and_wait_channel(monkeypatch):
    monkeypatch.setattr(native_stacks.shutil, "which", lambda name, **kw: None)
    text = native_stacks.dump([os.getpid()])
    assert text.startswith("native stacks (no gdb: /proc threads only), 1 process(es)")
    assert f"  {os.getpid()} " in text and " state R wchan " in text  # this thread, running


def test_a_process_gone_meanwhile_is_named_not_raised():
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert "(FileNotFoundError)" in native_stacks.proc_threads(proc.pid)


def test_cuda_gdb_stands_in_where_gdb_is_missing(monkeypatch):
    """The GPU machine has no gdb, only CUDA's cuda-gdb (which attaches to any process)."""
    found = {"cuda-gdb": "/opt/cuda/bin/cuda-gdb"}
    monkeypatch.setattr(native_stacks.shutil, "which", lambda name, path=None: found.get(name))
    assert native_stacks.debugger() == "/opt/cuda/bin/cuda-gdb"
    found.clear()
    assert native_stacks.debugger() is None
    found["gdb"] = "/usr/bin/gdb"
    found["cuda-gdb"] = "/opt/cuda/bin/cuda-gdb"
    assert native_stacks.debugger() == "/usr/bin/gdb"
