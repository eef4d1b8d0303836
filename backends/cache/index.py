"""Which media the encoders hold, where preprocessing can see it: a hint that lets a request's cached
media skip their decode.

The rows live in each encoder instance's own process; preprocessing runs in other processes. So each
encoder instance publishes the keys it holds in a small table in /dev/shm (`KeyTable`, written by that
instance alone), and preprocessing reads every instance's table (`KeyTables`) before it decodes. The
table is direct-mapped (a key's slot is its first 8 bytes modulo the slot count) and only ever a hint:
a key overwritten by another in its slot reads as absent (the media is decoded; the encoder still finds
its rows), and one evicted after it was read makes the encoder preprocess that media itself from the
request's IMAGES. Neither can change an answer. A slot torn by a concurrent write reads as neither key.

The tables are named after the server's Python-backend shared-memory prefix, which every stub gets on
its command line, so that the server's own clean-up (and the launcher's reaper) removes them with its
other regions, and two servers never read each other's.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np

from backends.cache.keys import KEY_BYTES

SHM = Path("/dev/shm")
SLOTS = 1 << 16  # 2 MiB per encoder instance


def server_prefix(cmdline: Path = Path("/proc/self/cmdline")) -> str | None:
    """The Python-backend region prefix of the server this stub belongs to: its region's name (the stub's
    third argument) less the trailing UUID. None outside a stub."""
    try:
        argv = cmdline.read_bytes().split(b"\0")
    except OSError:
        return None
    if len(argv) < 3 or not argv[0].endswith(b"triton_python_backend_stub"):
        return None
    region = argv[2].decode(errors="replace").lstrip("/")
    return region[:-36] if len(region) > 36 else None


def _slot(key: bytes, slots: int) -> int:
    return int.from_bytes(key[:8], "little") % slots


class KeyTable:
    """An encoder instance's table: it alone writes it."""

    def __init__(self, path: Path, slots: int = SLOTS):
        self.path, self.slots = Path(path), slots
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, slots * KEY_BYTES)
            self._map = mmap.mmap(fd, slots * KEY_BYTES)
        finally:
            os.close(fd)
        self._keys = np.frombuffer(self._map, dtype=np.uint8).reshape(slots, KEY_BYTES)

    def add(self, key: bytes) -> None:
        self._keys[_slot(key, self.slots)] = np.frombuffer(key, dtype=np.uint8)

    def remove(self, key: bytes) -> None:
        row = self._keys[_slot(key, self.slots)]
        if row.tobytes() == key:
            row[:] = 0

    def close(self) -> None:
        del self._keys
        self._map.close()
        self.path.unlink(missing_ok=True)


class KeyTables:
    """Preprocessing's view: every encoder instance's table under `prefix` (looked for again at most once
    a second, as instances start and go)."""

    def __init__(self, prefix: str, shm: Path = SHM, refresh_s: float = 1.0, clock=time.monotonic):
        self.pattern, self.shm, self.refresh_s, self.clock = f"{prefix}cache_*", shm, refresh_s, clock
        self._tables: dict[Path, np.ndarray] = {}
        self._seen = float("-inf")

    def _refresh(self) -> None:
        now = self.clock()
        if now - self._seen < self.refresh_s:
            return
        self._seen = now
        found = set(self.shm.glob(self.pattern))
        for gone in set(self._tables) - found:
            del self._tables[gone]
        for path in found - set(self._tables):
            try:
                with open(path, "rb") as f:
                    view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            except (OSError, ValueError):  # gone meanwhile, or still empty
                continue
            self._tables[path] = np.frombuffer(view, dtype=np.uint8).reshape(-1, KEY_BYTES)

    def held(self, key: bytes) -> bool:
        """Whether every encoder instance holds `key` (the request may go to any of them)."""
        self._refresh()
        if not self._tables:
            return False
        return all(t[_slot(key, len(t))].tobytes() == key for t in self._tables.values())
