"""State slots of recurrent families (SSM, causal conv, gated delta).

Each live sequence of a model with recurrent layers owns one slot: index into
dim 0 of every recurrent state tensor. Slot 0 is reserved scratch (padding
sequences point at it), so the pool hands out ``1 .. num_slots - 1``.
"""

from __future__ import annotations

from backplane.core.metadata import NULL_SLOT

__all__ = ["StateSlotPool"]


class StateSlotPool:
    """Free list of recurrent-state slots; O(1) allocate and free.

    :param num_slots: total slots including the reserved slot 0 (0 = no recurrent state).
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = max(int(num_slots), 0)
        self._free = list(range(self.num_slots - 1, NULL_SLOT, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Slots available now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Slots held by live sequences."""
        return len(self._used)

    def allocate(self) -> int:
        """Take a free slot (never 0).

        :raises MemoryError: if none is free (callers check :attr:`num_free`).
        """
        if not self._free:
            raise MemoryError("no free state slot")
        s = self._free.pop()
        self._used.add(s)
        return s

    def free(self, slot: int) -> None:
        """Return a slot taken with :meth:`allocate`."""
        self._used.remove(slot)
        self._free.append(slot)
