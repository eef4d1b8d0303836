"""The server's own CUDA MPS daemon (backends/deploy/mps.py) and the launcher's --mps. A small script stands
in for nvidia-cuda-mps-control: it records how it was called (arguments, the pipe and log folders in its
environment, what came on stdin), which is all our code decides. The daemon itself runs on the GPU
machine (docs/triton_runtime.md#cuda-mps)."""

import os
import stat
from pathlib import Path

import pytest

from backends.deploy import mps
from backends.deploy.launcher import TritonInstall, build_parser, server_env, start_mps

FAKE = """#!/bin/sh
log="{log}"
if [ "$1" = "-d" ]; then
  [ -n "{refuse}" ] && {{ echo "An instance of this daemon is already running" >&2; exit 1; }}
  echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$log"
else
  read -r line; echo "stdin $line $CUDA_MPS_PIPE_DIRECTORY" >> "$log"
fi
"""


def fake_control(tmp_path, refuse=False):
    path = tmp_path / "nvidia-cuda-mps-control"
    log = tmp_path / "calls.log"
    path.write_text(FAKE.format(log=log, refuse="yes" if refuse else ""))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path), log


def test_start_runs_the_daemon_with_its_own_folders_and_stop_asks_it_to_quit(tmp_path):
    binary, log = fake_control(tmp_path)
    daemon = mps.start(tmp_path / "mps", binary)
    pipe, logs = tmp_path / "mps" / "pipe", tmp_path / "mps" / "log"
    assert daemon.env() == {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    assert pipe.is_dir() and logs.is_dir()
    assert daemon.stop(timeout_s=5) and daemon.stop(timeout_s=5)  # the second call does nothing
    assert log.read_text().splitlines() == [f"start {pipe} {logs}", f"stdin quit {pipe}"]
    assert folder_mode(tmp_path / "mps") == 0o700  # a predictable path in a shared folder: ours alone


def folder_mode(path):
    return path.stat().st_mode & 0o777


def test_a_daemon_left_on_the_same_folder_is_asked_to_quit_first(tmp_path, monkeypatch):
    binary, log = fake_control(tmp_path)
    def pids(pipe_dir, proc=None):  # what /proc shows: the leftover, until it has been told to quit
        return [4242] if "stdin quit" not in (log.read_text() if log.exists() else "") else []

    monkeypatch.setattr(mps, "daemon_pids", pids)
    mps.start(tmp_path / "mps", binary)
    pipe = tmp_path / "mps" / "pipe"
    assert log.read_text().splitlines() == [f"stdin quit {pipe}", f"start {pipe} {tmp_path / 'mps' / 'log'}"]


def test_unusable_folders_are_reported_not_raised_as_os_errors(tmp_path, monkeypatch):
    binary, _ = fake_control(tmp_path)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(mps.MpsUnavailable, match="cannot make its folders"):
        mps.start(tmp_path / "a-file" / "mps", binary)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "elsewhere")  # planted where our folder would be
    with pytest.raises(mps.MpsUnavailable, match="is not a folder"):
        mps.start(tmp_path / "linked", binary)
    owner = os.stat(tmp_path).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(mps.MpsUnavailable, match="belongs to another user"):
        mps.start(tmp_path / "mps", binary)


def test_a_folder_left_by_an_older_run_is_made_ours_alone_again(tmp_path):
    binary, _ = fake_control(tmp_path)
    (tmp_path / "mps" / "pipe").mkdir(parents=True)
    os.chmod(tmp_path / "mps", 0o755)
    mps.start(tmp_path / "mps", binary).stop(timeout_s=5)
    assert folder_mode(tmp_path / "mps") == folder_mode(tmp_path / "mps" / "pipe") == 0o700


def test_a_daemon_still_in_use_is_not_asked_to_quit(tmp_path, monkeypatch):
    binary, log = fake_control(tmp_path)
    monkeypatch.setattr(mps, "daemon_pids", lambda pipe_dir, proc=None: [4242])
    monkeypatch.setattr(mps, "client_pids", lambda pipe_dir, proc=None: [5151])
    with pytest.raises(mps.MpsUnavailable, match=r"used by processes \[5151\]"):
        mps.start(tmp_path / "mps", binary)
    assert not log.exists()  # neither quit nor -d was sent


def test_a_refusing_daemon_is_reported_with_what_it_said(tmp_path):
    binary, _ = fake_control(tmp_path, refuse=True)
    with pytest.raises(mps.MpsUnavailable, match="exited with status 1: An instance of this daemon is already running"):
        mps.start(tmp_path / "mps", binary)


def test_no_control_binary_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(mps.MpsUnavailable, match="nvidia-cuda-mps-control is not on PATH"):
        mps.start(tmp_path / "mps")


def test_launcher_starts_no_daemon_unless_asked_and_only_for_a_gpu_deployment(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KIMI_MPS", raising=False)
    assert build_parser().parse_args([]).mps is False
    for on in ("1", "true", "on"):
        monkeypatch.setenv("KIMI_MPS", on)
        assert build_parser().parse_args([]).mps is True
    assert build_parser().parse_args(["--no-mps"]).mps is False
    binary, log = fake_control(tmp_path)  # a control binary on PATH that would start: not asked, not run
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert start_mps(False, "gpu", tmp_path / "mps") is None
    assert not log.exists() and capsys.readouterr().out == ""
    assert start_mps(True, "cpu", tmp_path / "mps") is None
    assert not log.exists() and "GPU deployment only" in capsys.readouterr().out
    daemon = start_mps(True, "gpu", tmp_path / "mps")  # the same binary does start when asked on a GPU
    assert daemon is not None and log.read_text().startswith("start ")


def test_stop_says_false_when_the_daemon_outlives_the_timeout(tmp_path, monkeypatch):
    binary, log = fake_control(tmp_path)
    daemon = mps.start(tmp_path / "mps", binary)
    monkeypatch.setattr(mps, "daemon_pids", lambda pipe_dir, proc=None: [4242])  # it never goes
    assert daemon.stop(timeout_s=0.5) is False
    assert log.read_text().splitlines()[-1] == f"stdin quit {daemon.pipe_dir}"  # it was asked


def test_a_leftover_that_will_not_quit_refuses_the_start(tmp_path, monkeypatch):
    binary, log = fake_control(tmp_path)
    monkeypatch.setattr(mps, "daemon_pids", lambda pipe_dir, proc=None: [4242])
    monkeypatch.setattr(mps, "client_pids", lambda pipe_dir, proc=None: [])
    with pytest.raises(mps.MpsUnavailable, match="did not quit"):
        mps.start(tmp_path / "mps", binary, timeout_s=0.5)
    assert log.read_text().splitlines() == [f"stdin quit {tmp_path / 'mps' / 'pipe'}"]  # asked; no second daemon


@pytest.mark.parametrize("exc, raised", [(KeyboardInterrupt(), KeyboardInterrupt),
                                         (SystemExit(143), SystemExit),
                                         (OSError("exec failed"), mps.MpsUnavailable)])
def test_a_failed_or_interrupted_start_stops_the_daemon_then_goes_on(tmp_path, monkeypatch, exc, raised):
    """-d may have forked the daemon before the interruption: it is asked to quit, then the exception goes
    on unwinding (Ctrl-C, SIGTERM) or becomes MpsUnavailable (the binary could not run)."""
    binary, log = fake_control(tmp_path)
    real_run = mps.subprocess.run

    def run(cmd, *args, **kwargs):
        if cmd[1:] == ["-d"]:
            raise exc
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(mps.subprocess, "run", run)
    with pytest.raises(raised):
        mps.start(tmp_path / "mps", binary)
    assert log.read_text().splitlines() == [f"stdin quit {tmp_path / 'mps' / 'pipe'}"]


def test_launcher_serves_on_with_a_warning_where_mps_cannot_start(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert start_mps(True, "gpu", tmp_path / "mps") is None
    assert "serving without MPS" in capsys.readouterr().out


def test_the_daemons_environment_goes_to_the_server_alone(tmp_path, monkeypatch):
    """The launcher passes Daemon.env() to the server (TritonServer's env), not to its own environment:
    a CUDA context in the launching process would make it a client that keeps the daemon alive."""
    _, log = fake_control(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    before = dict(os.environ)
    daemon = start_mps(True, "gpu", tmp_path / "mps")
    assert daemon is not None and dict(os.environ) == before
    install = TritonInstall(binary=tmp_path / "tritonserver", backend_dir=tmp_path)
    env = server_env(install, tmp_path / "stub-bin", daemon.env())
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps" / "pipe")
    assert "CUDA_MPS_PIPE_DIRECTORY" not in server_env(install, tmp_path / "stub-bin")
    assert daemon.stop(timeout_s=5)
    assert log.read_text().splitlines()[-1] == f"stdin quit {tmp_path / 'mps' / 'pipe'}"


def test_daemon_processes_are_found_by_their_pipe_folder(tmp_path):
    """stop() waits for the daemon and its server to exit: they are told apart from other MPS daemons
    by the pipe folder in their environment (a /proc stand-in here)."""
    proc = tmp_path / "proc"
    # The kernel keeps 15 characters of a process name: control daemon and server both read so.
    for pid, comm, pipe in ((11, "nvidia-cuda-mps", "/tmp/a/pipe"), (12, "nvidia-cuda-mps", "/tmp/a/pipe"),
                            (13, "nvidia-cuda-mps", "/tmp/b/pipe"), (14, "python3", "/tmp/a/pipe")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) S 1 {pid} {pid} 0 -1\n")
        (proc / str(pid) / "environ").write_bytes(b"PATH=/bin\0CUDA_MPS_PIPE_DIRECTORY=" + pipe.encode() + b"\0")
    (proc / "15").mkdir()  # gone while we looked: skipped
    assert sorted(mps.daemon_pids(Path("/tmp/a/pipe"), proc)) == [11, 12]
    assert mps.client_pids(Path("/tmp/a/pipe"), proc) == [14]
    assert mps.daemon_pids(Path("/tmp/c/pipe"), proc) == []


def test_the_launcher_stops_its_daemon_when_serving_fails_or_sigterm_comes_early(monkeypatch):
    """The daemon outlives nothing: a server that fails to start, or a SIGTERM before the server is up
    (the launcher turns it into SystemExit until its drain handler takes over), still reaches stop()."""
    import signal

    from backends.deploy import launcher

    stops = []

    class StandIn:
        def stop(self):
            stops.append(1)
            return True

    monkeypatch.setattr(launcher, "start_mps", lambda asked, device, folder: StandIn() if asked else None)
    monkeypatch.setattr(launcher.port_check, "taken", lambda address, ports: [])  # whatever holds 8000-8002 here
    before = signal.getsignal(signal.SIGTERM)
    try:
        def fails(*_):
            raise RuntimeError("tritonserver exited with code 1 while starting")

        monkeypatch.setattr(launcher, "_render_and_serve", fails)
        with pytest.raises(RuntimeError, match="while starting"):
            launcher.main(["--device", "cpu", "--mps"])
        assert stops == [1]

        def sigterm(*_):
            launcher._exit_on_sigterm(signal.SIGTERM, None)

        monkeypatch.setattr(launcher, "_render_and_serve", sigterm)
        with pytest.raises(SystemExit) as exit_:
            launcher.main(["--device", "cpu", "--mps"])
        assert exit_.value.code == 128 + signal.SIGTERM and stops == [1, 1]
        assert signal.getsignal(signal.SIGTERM) is launcher._exit_on_sigterm
    finally:
        signal.signal(signal.SIGTERM, before)
