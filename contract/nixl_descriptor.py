"""What IMAGE_EMBEDS_NIXL carries: where a request's embedding rows wait for the consumer to read them
with NIXL, and the message that tells the server they have been read. Standard library only: the
server writes it, a client (clients/nixl_pull.py) reads it.

Layout: b"KNX1", a little-endian uint32 header length, the header as UTF-8 JSON, then the server agent's
NIXL metadata (the rest). The header names the server agent, the memory ("DRAM" on the CPU deployment,
"VRAM" on a GPU one) and its device, the rows' address and size in the server's registered arena, their
shape and Triton dtype, the descriptor's id (what the consumer's notification names) and its lifetime.
The rows stay where they are until the server gets the notification or the lifetime ends
(docs/llm_handoff.md#pulling-the-embeddings-with-nixl).
"""

from __future__ import annotations

import importlib
import json
import struct
from dataclasses import asdict, dataclass

MAGIC = b"KNX1"
_HEAD = struct.Struct("<4sI")
ITEM_BYTES = {"FP32": 4, "BF16": 2, "FP16": 2}
MEMORY_KINDS = ("DRAM", "VRAM")
# The consumer's notification once its READ is done (sent with the transfer, so it arrives after the
# data has left), or to give the rows up unread: this prefix, then the descriptor's id in decimal.
NOTIFY_PREFIX = b"kimi-nixl-done:"


@dataclass(frozen=True)
class NixlDescriptor:
    agent: str  # the server agent's name (what add_remote_agent returns for `metadata`)
    metadata: bytes  # its NIXL agent metadata
    mem: str  # "DRAM" or "VRAM"
    device: int  # the server's GPU (VRAM); 0 for DRAM
    addr: int  # the rows' address in the server's registered arena
    nbytes: int
    shape: tuple[int, int]  # (rows, text_hidden)
    dtype: str  # Triton's name: "FP32" or "BF16"
    id: int  # names this descriptor in the notification; 0 for a request without rows (nothing to read)
    lifetime_ms: int  # how long after the server made it the rows are kept unread
    expires_unix_ms: int  # the server's clock: made + lifetime

    def __post_init__(self):
        if self.mem not in MEMORY_KINDS:
            raise ValueError(f"mem must be one of {MEMORY_KINDS}, got {self.mem!r}")
        if self.dtype not in ITEM_BYTES:
            raise ValueError(f"dtype must be one of {sorted(ITEM_BYTES)}, got {self.dtype!r}")
        if len(self.shape) != 2 or min(self.shape) < 0:
            raise ValueError(f"shape must be (rows, hidden), got {self.shape}")
        if self.nbytes != self.shape[0] * self.shape[1] * ITEM_BYTES[self.dtype]:
            raise ValueError(f"nbytes {self.nbytes} does not match shape {self.shape} of {self.dtype}")
        if min(self.addr, self.device, self.id, self.lifetime_ms) < 0:
            raise ValueError("addr, device, id and lifetime_ms must not be negative")

    def notification(self) -> bytes:
        return notification(self.id)


def encode(d: NixlDescriptor) -> bytes:
    header = {k: v for k, v in asdict(d).items() if k != "metadata"}
    header["shape"] = list(d.shape)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return _HEAD.pack(MAGIC, len(text)) + text + d.metadata


def decode(data) -> NixlDescriptor:
    """A descriptor from IMAGE_EMBEDS_NIXL's bytes (bytes, or a uint8 array's buffer); ValueError naming
    what is wrong with anything else."""
    data = bytes(data)
    if len(data) < _HEAD.size:
        raise ValueError(f"not a NIXL descriptor: {len(data)} bytes")
    magic, size = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not a NIXL descriptor (starts with {magic!r}, expected {MAGIC!r})")
    if _HEAD.size + size > len(data):
        raise ValueError(f"NIXL descriptor cut short: its header says {size} bytes, {len(data) - _HEAD.size} follow")
    try:
        header = json.loads(data[_HEAD.size:_HEAD.size + size])
        return NixlDescriptor(metadata=data[_HEAD.size + size:], agent=str(header["agent"]), mem=header["mem"],
                              device=int(header["device"]), addr=int(header["addr"]), nbytes=int(header["nbytes"]),
                              shape=tuple(int(n) for n in header["shape"]), dtype=header["dtype"],
                              id=int(header["id"]), lifetime_ms=int(header["lifetime_ms"]),
                              expires_unix_ms=int(header["expires_unix_ms"]))
    except (KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"bad NIXL descriptor header: {exc!r}") from None


def notification(descriptor_id: int) -> bytes:
    return NOTIFY_PREFIX + str(int(descriptor_id)).encode()


def notified_id(message: bytes) -> int | None:
    """The descriptor id a notification names; None for any other message."""
    if not message.startswith(NOTIFY_PREFIX):
        return None
    digits = message[len(NOTIFY_PREFIX):]
    return int(digits) if digits.isdigit() else None


def load_nixl_api():
    """The NIXL Python API module (its nixl_agent): the `nixl` meta package where installed, else a CUDA
    variant's wheel itself (nixl-cu13, nixl-cu12: each runs on a host without a GPU too). ImportError
    naming what to install where none imports."""
    errors = []
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("NIXL is not installed (pip install nixl-cu12 or nixl-cu13, the CUDA major of torch): "
                      + "; ".join(errors))
