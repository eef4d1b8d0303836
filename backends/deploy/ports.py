"""The server's ports: free ones for tests, and a check before a start that each asked-for port is free.

A tritonserver started on a port another process holds fails to bind it and exits, but a readiness probe
on that port meanwhile reaches the other process and reads "ready". So the launcher checks its ports
first and stops with one line naming the port and, where /proc tells, the process that holds it.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports free now. The sockets stay bound until all are chosen: one at a time,
    the kernel could hand out the same port twice."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def bind_error(address: str, port: int) -> OSError | None:
    """Why binding `address:port` for listening fails now (as tritonserver's would: it sets SO_REUSEADDR,
    so a port left in TIME_WAIT binds), or None where it binds."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except (OSError, UnicodeError) as exc:  # UnicodeError: an address no resolver takes
            return exc if isinstance(exc, OSError) else OSError(str(exc))
    return None


def port_taken(address: str, port: int) -> bool:
    """Whether another socket holds `address:port`."""
    error = bind_error(address, port)
    return error is not None and error.errno == errno.EADDRINUSE


def _listening_inodes(port: int, proc: Path) -> set[str]:
    """Socket inodes listening on `port` (any address), from /proc/net/tcp and tcp6."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])  # 0A: LISTEN
    return inodes


def port_holder(port: int, proc: Path = Path("/proc")) -> str:
    """'pid N (name)' of a process listening on `port`, '' where /proc does not say (another user's process,
    another network namespace, no /proc)."""
    inodes = _listening_inodes(port, proc)
    if not inodes:
        return ""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:  # per descriptor: one closed since the listing must not end the look at this process
                if os.readlink(fd) in wanted:
                    return f"pid {entry.name} ({(entry / 'comm').read_text().strip()})"
            except OSError:
                continue
    return ""


def taken(address: str, ports: dict[str, int]) -> list[str]:
    """One line per asked-for port that is not free: what it is for, and who holds it where known."""
    problems = []
    for what, port in ports.items():
        error = bind_error(address, port)
        if error is None:
            continue
        if error.errno == errno.EADDRINUSE:
            holder = port_holder(port)
            problems.append(f"the {what} port {port} on {address} is already in use"
                            + (f" by {holder}" if holder else ""))
        else:  # an address of no interface here, a name that does not resolve, a port below 1024 ...
            problems.append(f"cannot listen on {address}:{port} for {what}: {error.strerror or error}")
    return problems
