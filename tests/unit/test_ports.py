"""The launcher's port check (backends/deploy/ports.py): a taken port stops it at once with one line that
names the port and its holder, instead of a readiness probe answered by whoever holds it."""

import os
import socket

from backends.deploy import launcher
from backends.deploy.ports import port_holder, port_taken, taken


def test_a_listening_port_is_taken_and_its_holder_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_taken("127.0.0.1", port)
        if os.path.exists("/proc/net/tcp"):
            assert port_holder(port) == f"pid {os.getpid()} ({open('/proc/self/comm').read().strip()})"
        (line,) = taken("127.0.0.1", {"gRPC": port})
        assert line.startswith(f"the gRPC port {port} on 127.0.0.1 is already in use")
    assert not port_taken("127.0.0.1", port)  # closed again: free
    assert taken("127.0.0.1", {"gRPC": port}) == []


def test_the_launcher_stops_with_one_line_and_status_2_on_a_taken_port(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code = launcher.main(["--device", "cpu", "--address", "127.0.0.1", "--http-port", str(port)])
    out = capsys.readouterr().err
    assert code == 2
    assert f"error: the HTTP port {port} on 127.0.0.1 is already in use" in out
    assert "--http-port" in out and "Traceback" not in out


def test_each_launch_renders_its_own_repository_and_removes_it_at_exit(monkeypatch, tmp_path):
    """Two servers from one checkout must never share a rendering: a restart of one would otherwise heal
    into the other's models or checkpoint. A repository the operator names stays."""
    import argparse

    seen = []

    def serve(args, device, dep, daemon, repository):
        repository.mkdir(parents=True)
        seen.append(repository)
        return 0

    monkeypatch.setattr(launcher, "_serve_rendered", serve)
    args = argparse.Namespace(repository_dir=None)
    assert launcher._render_and_serve(args, "cpu", None, None) == 0
    assert seen[0].name == f"model_repository-cpu-{os.getpid()}" and not seen[0].exists()
    named = argparse.Namespace(repository_dir=tmp_path / "mine")
    launcher._render_and_serve(named, "cpu", None, None)
    assert seen[1] == tmp_path / "mine" and seen[1].exists()


def test_a_descriptor_closed_while_looking_does_not_hide_the_holder(tmp_path, monkeypatch):
    """A fake /proc: process 7 holds the listening socket on two descriptors, and the first one read is
    gone by then (closed since the listing): the other one still names the holder."""
    from backends.deploy import ports

    (tmp_path / "net").mkdir()
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    (tmp_path / "net" / "tcp").write_text(header + "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 "
                                          "00:00000000 00000000     0        0 4242 1\n")
    fds = tmp_path / "7" / "fd"
    fds.mkdir(parents=True)
    (tmp_path / "7" / "comm").write_text("holder\n")
    for fd in ("3", "4"):
        os.symlink("socket:[4242]", fds / fd)
    real, calls = os.readlink, []

    def racy(path):
        calls.append(path)
        if len(calls) == 1:
            raise FileNotFoundError(path)
        return real(path)

    monkeypatch.setattr(ports.os, "readlink", racy)
    assert ports.port_holder(0x1F90, proc=tmp_path) == "pid 7 (holder)"
    assert len(calls) == 2
