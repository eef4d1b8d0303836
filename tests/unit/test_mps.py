"""The server's own CUDA MPS daemon (backends/deploy/mps.py) and the launcher's --mps. A small script stands
in for nvidia-cuda-mps-control: it records how it was called (arguments, the pipe and log folders in its
environment, what came on stdin), which is all our code decides. The daemon itself runs on the GPU
machine (tools/gpu_session.sh launcher and mps)."""

import os
import stat

import pytest

from backends.deploy import mps
from backends.deploy.launcher import build_parser, start_mps

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
    daemon.stop()
    assert log.read_text().splitlines() == [f"start {pipe} {logs}", f"stdin quit {pipe}"]


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
    monkeypatch.setenv("KIMI_MPS", "1")
    assert build_parser().parse_args([]).mps is True
    assert build_parser().parse_args(["--no-mps"]).mps is False
    assert start_mps(False, "gpu", tmp_path) is None
    assert start_mps(True, "cpu", tmp_path) is None
    assert "GPU deployment only" in capsys.readouterr().out


def test_launcher_serves_on_with_a_warning_where_mps_cannot_start(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "")  # recorded, so that the test's end restores it
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    assert start_mps(True, "gpu", tmp_path / "mps") is None
    assert "serving without MPS" in capsys.readouterr().out
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_launcher_gives_the_server_the_daemons_environment(tmp_path, monkeypatch):
    _, log = fake_control(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    for name in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        monkeypatch.setenv(name, "")  # recorded first, so that the test's end restores what was there
        monkeypatch.delenv(name)
    daemon = start_mps(True, "gpu", tmp_path / "mps")
    assert daemon is not None
    # The server's environment is built from ours when it starts (launcher.server_env).
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps" / "pipe")
    daemon.stop()
    assert log.read_text().splitlines()[-1] == f"stdin quit {tmp_path / 'mps' / 'pipe'}"
