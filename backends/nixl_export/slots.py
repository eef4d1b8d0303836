"""Slots of a fixed arena for rows waiting to be read: a byte budget, a lifetime, no NIXL and no torch.

Each slot lives until its reader says it is done (`release`) or its lifetime ends (`expire`). Nothing is
ever moved or evicted early: a reader may be copying out of a slot at any moment before it expires, so a
request that finds no room is refused (a per-request error naming the budget) rather than making room.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from backends.errors import RequestError

# Slot offsets are multiples of this: every dtype's rows start aligned, as a GPU copy likes them.
ALIGN = 256


@dataclass(frozen=True)
class Slot:
    id: int  # random: a notification can free only a slot whose descriptor its sender was given
    offset: int
    nbytes: int
    expires: float  # on the table's clock (monotonic seconds)

    @property
    def end(self) -> int:
        return self.offset + _aligned(self.nbytes)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _new_id() -> int:
    return secrets.randbits(63) or 1  # 0 means "no rows" in a descriptor


class SlotTable:
    """First fit over the arena [0, capacity); the bookkeeping of one encoder instance (callers lock)."""

    def __init__(self, capacity: int, lifetime_s: float, *, budget_name: str = "nixl_bytes", new_id=_new_id):
        if capacity < 0 or lifetime_s <= 0:
            raise ValueError(f"capacity must be >= 0 and lifetime_s > 0, got {capacity}, {lifetime_s}")
        self.capacity, self.lifetime_s, self.budget_name = capacity, lifetime_s, budget_name
        self._new_id = new_id
        self._slots: dict[int, Slot] = {}
        self.released = 0  # slots freed by their reader
        self.expired = 0  # slots freed unread, at the end of their lifetime

    @property
    def outstanding(self) -> int:
        return len(self._slots)

    @property
    def held_bytes(self) -> int:
        """The rows' bytes waiting to be read (without alignment padding)."""
        return sum(s.nbytes for s in self._slots.values())

    def take(self, nbytes: int, now: float) -> Slot:
        """A slot for `nbytes` (> 0) that lives until `now + lifetime_s`; expired slots are freed first.
        A RequestError naming the budget when there is no room."""
        if nbytes <= 0:
            raise ValueError(f"a slot holds at least one byte, asked {nbytes}")
        self.expire(now)
        if _aligned(nbytes) > self.capacity:
            raise RequestError(f"the request's embeddings are {nbytes} bytes, more than the NIXL arena holds "
                               f"({self.budget_name}={self.capacity})", "nixl_budget")
        offset = self._gap(_aligned(nbytes))
        if offset is None:
            soonest = min(s.expires for s in self._slots.values()) - now
            raise RequestError(f"no room for the request's {nbytes} bytes of embeddings in the NIXL arena "
                               f"({self.budget_name}={self.capacity}): {self.outstanding} descriptor(s) not yet read "
                               f"hold {self.held_bytes} bytes, the next expires in {max(soonest, 0.0):.1f} s; read or "
                               f"release them, or retry", "nixl_budget")
        slot_id = self._new_id()
        while slot_id in self._slots:
            slot_id = self._new_id()
        slot = self._slots[slot_id] = Slot(slot_id, offset, nbytes, now + self.lifetime_s)
        return slot

    def _gap(self, size: int) -> int | None:
        at = 0
        for s in sorted(self._slots.values(), key=lambda s: s.offset):
            if s.offset - at >= size:
                return at
            at = s.end
        return at if self.capacity - at >= size else None

    def release(self, slot_id: int) -> Slot | None:
        """The reader is done with the slot: free it. None for an id no slot has (read twice, expired)."""
        slot = self._slots.pop(slot_id, None)
        if slot is not None:
            self.released += 1
        return slot

    def expire(self, now: float) -> list[Slot]:
        """Free the slots whose lifetime has ended by `now`, and return them."""
        gone = [s for s in self._slots.values() if s.expires <= now]
        for s in gone:
            del self._slots[s.id]
        self.expired += len(gone)
        return gone
