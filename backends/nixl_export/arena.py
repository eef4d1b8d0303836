"""One encoder instance's NIXL agent and the arena it registers: rows in, descriptors out.

The agent and the arena are made at the first request that asks for a descriptor (a server whose clients
never do opens no NIXL listener and holds no arena). The arena is one buffer of the instance's memory (host
memory on the CPU deployment, GPU memory on a GPU one), registered once: a request's rows are copied into
a slot of it (backends/nixl_export/slots.py), and the descriptor says where. A thread frees the slots
whose reader has notified (contract.nixl_descriptor.NOTIFY_PREFIX) and those whose lifetime has ended.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time

import torch

from backends.errors import RequestError
from backends.nixl_export.slots import SlotTable
from contract import NIXL_PARAMETER
from contract.nixl_descriptor import NixlDescriptor, encode, load_nixl_api, notified_id

log = logging.getLogger("kimi_vision")

_TRITON_DTYPES = {torch.float32: "FP32", torch.bfloat16: "BF16", torch.float16: "FP16"}


def nixl_requested(parameters: dict) -> bool:
    """Whether a request's parameters ask for a descriptor instead of IMAGE_EMBEDS (contract.NIXL_PARAMETER):
    true, 1 or "true"/"1"/"yes"/"on" (any case); false, 0, their words, or absent: no. Anything else is the
    request's error, never taken as one or the other."""
    value = parameters.get(NIXL_PARAMETER)
    if value is None or value is False or value == 0:
        return False
    if value is True or value == 1:
        return True
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise RequestError(f"request parameter {NIXL_PARAMETER}={value!r}: expected true or false", "bad_parameter")


class NixlExport:
    """Descriptors for rows, from an arena of `capacity` bytes on `device`, each kept `lifetime_s` unread at most."""

    POLL_S = 0.05  # how often the reaper looks for notifications and ended lifetimes

    def __init__(self, capacity: int, lifetime_s: float, device: torch.device | str, name: str, clock=time.monotonic):
        self.device = torch.device(device)
        self.table = SlotTable(capacity, lifetime_s)
        self.name = f"kimi-{name}-{os.getpid()}-{secrets.token_hex(4)}"  # a restarted server is a new agent
        self.clock = clock
        self._lock = threading.Lock()  # the table, and every call into the agent (made without thread sync)
        self._agent = self._arena = self._reg = self._metadata = None
        self._failed: str | None = None
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    @property
    def arena_bytes(self) -> int:
        """Bytes the arena takes in the instance's memory (0 until the first descriptor)."""
        return self.table.capacity if self._arena is not None else 0

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"outstanding": self.table.outstanding, "bytes": self.table.held_bytes,
                    "reads": self.table.released, "expired": self.table.expired}

    def _start(self) -> None:
        """The agent (UCX backend) and the registered arena, once; a failure is every later request's error too."""
        if self._agent is not None:
            return
        if self._failed is not None:
            raise RequestError(self._failed, "nixl_unavailable")
        try:
            api = load_nixl_api()
            t0 = time.perf_counter()
            agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"]))
            arena = torch.empty(self.table.capacity, dtype=torch.uint8, device=self.device)
            reg = agent.register_memory(arena)
            metadata = agent.get_agent_metadata()
        except Exception as exc:  # noqa: BLE001 - not installed, no UCX, no memory: said once, to every such request
            self._failed = f"this server cannot hand out NIXL descriptors: {type(exc).__name__}: {exc}"
            log.error("%s: %s", self.name, self._failed)
            raise RequestError(self._failed, "nixl_unavailable") from None
        self._agent, self._arena, self._reg, self._metadata = agent, arena, reg, metadata
        log.info("%s: NIXL agent up with a %d-byte arena on %s in %.0f ms", self.name, self.table.capacity,
                 self.device, (time.perf_counter() - t0) * 1000)
        self._reaper = threading.Thread(target=self._reap_loop, name="kimi-nixl-reaper", daemon=True)
        self._reaper.start()

    def export(self, rows: list[torch.Tensor]) -> list[bytes | Exception]:
        """Each request's rows copied into a slot of the arena, and its descriptor (or its error)."""
        out: list[bytes | Exception] = []
        with self._lock:
            try:
                self._start()
                self._poll()
            except Exception as exc:  # noqa: BLE001 - every request of the batch gets it
                return [exc] * len(rows)
            for r in rows:
                try:
                    out.append(self._put(r))
                except Exception as exc:  # noqa: BLE001 - this request alone
                    out.append(exc)
            if self.device.type == "cuda":  # the copies are done before any consumer can start reading
                torch.cuda.current_stream(self.device).synchronize()
        return out

    def _put(self, rows: torch.Tensor) -> bytes:
        rows = rows.contiguous()
        nbytes = rows.numel() * rows.element_size()
        now = self.clock()
        slot_id, addr = 0, 0
        if nbytes:
            slot = self.table.take(nbytes, now)
            slot_id, addr = slot.id, self._arena.data_ptr() + slot.offset
            self._arena[slot.offset:slot.offset + nbytes].copy_(rows.view(-1).view(torch.uint8), non_blocking=True)
        lifetime_ms = int(self.table.lifetime_s * 1000)
        return encode(NixlDescriptor(
            agent=self.name, metadata=self._metadata, mem="VRAM" if self.device.type == "cuda" else "DRAM",
            device=self.device.index or 0, addr=addr, nbytes=nbytes, shape=tuple(rows.shape), dtype=_TRITON_DTYPES[rows.dtype],
            id=slot_id, lifetime_ms=lifetime_ms, expires_unix_ms=int(time.time() * 1000) + lifetime_ms))

    def _poll(self) -> None:
        """Free the slots whose readers notified, then those whose lifetime ended (the lock is held)."""
        for messages in self._agent.get_new_notifs().values():
            for message in messages:
                slot_id = notified_id(bytes(message))
                if slot_id is not None:
                    self.table.release(slot_id)
        self.table.expire(self.clock())

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.POLL_S):
            try:
                with self._lock:
                    self._poll()
            except Exception:  # noqa: BLE001 - keep reaping; the next request polls too
                log.exception("%s: polling NIXL notifications failed", self.name)

    def close(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=2)
        with self._lock:
            if self._agent is not None:
                try:
                    self._agent.deregister_memory(self._reg)
                except Exception:  # noqa: BLE001 - unloading anyway
                    log.exception("%s: deregistering the NIXL arena failed", self.name)
            self._agent = self._arena = self._reg = None
