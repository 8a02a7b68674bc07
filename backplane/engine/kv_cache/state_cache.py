"""Recurrent-state snapshots at page boundaries: prefix reuse for models with recurrent layers.

The KV of a prefix lives in pages any request can share, but the state of a
recurrent layer (Mamba2 SSM, causal conv, gated delta rule) after a prefix is
one tensor row per sequence, overwritten as the sequence goes on. To let a new
request skip a cached prefix, the state after that prefix is copied into a
spare state slot (a *snapshot*) when its owner finishes computing the page
that ends it, keyed by the chained hash of that page
(:func:`~backplane.engine.kv_cache.prefix_cache.hash_pages`). A request whose
cached pages reach such a page copies the snapshot into its own slot and goes
on from there.

Snapshots live in the same :class:`StateSlotPool` as the live sequences'
slots, and live sequences come first: an idle snapshot is evicted, least
recently used first, whenever a live sequence needs a slot and none is free.
A snapshot a waiting request has claimed is pinned (not evictable) until the
copy out of it is queued.

The copies themselves run on the device, in the order of the step stream:
:meth:`StateSnapshots.take_copies` hands the scheduler the saves (live slot ->
snapshot slot) and the restores (snapshot slot -> live slot) to issue before
the next step's forward, saves first, so a restore may read a snapshot saved
in the same batch.
"""

from __future__ import annotations

from collections import OrderedDict

from backplane.engine.kv_cache.state_slots import StateSlotPool

__all__ = ["StateCopies", "StateSnapshots"]

#: ``(source slot, destination slot)`` pairs of one batch of state copies.
StateCopies = list[tuple[int, int]]


#: running sequences per spare snapshot slot (a recurrent state can be tens of MiB a sequence)
SEQS_PER_SNAPSHOT = 4


def snapshot_slot_count(max_num_seqs: int) -> int:
    """How many spare state slots keep the snapshots of cached prefixes.

    A quarter of the running sequences, at least two: each slot is one more
    sequence's recurrent state taken from the KV cache's memory (the Nemotron-H
    8B shape keeps about 100 MiB per sequence: float32 SSM states), and
    snapshots are evicted least recently used first, so a multi-turn
    conversation keeps its own while it runs.

    :param max_num_seqs: the most sequences the engine runs at once.
    :return: the spare slot count.
    """
    return min(int(max_num_seqs), max(2, int(max_num_seqs) // SEQS_PER_SNAPSHOT))


class StateSnapshots:
    """Recurrent-state snapshots keyed by chained page hash, in slots of a shared pool.

    :param slots: the pool the live sequences' slots come from too.
    """

    def __init__(self, slots: StateSlotPool) -> None:
        self.slots = slots
        self._slot_of: dict[int, int] = {}  # page hash -> snapshot slot
        self._hash_of: dict[int, int] = {}  # snapshot slot -> page hash
        # Unpinned snapshots, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[int, int] = {}  # snapshot slot -> claims holding it
        self._saves: StateCopies = []
        self._restores: StateCopies = []
        self.saved = 0  #: snapshots taken (monotonic)
        self.restored = 0  #: snapshots copied into a request's slot (monotonic)
        self.evicted = 0  #: snapshots dropped to free their slot (monotonic)

    def __len__(self) -> int:
        """Snapshots held."""
        return len(self._slot_of)

    @property
    def num_evictable(self) -> int:
        """Snapshots no waiting request has claimed (their slots can go to live sequences)."""
        return len(self._lru)

    def held_slots(self) -> set[int]:
        """The slots holding snapshots (for checks)."""
        return set(self._hash_of)

    def get(self, h: int) -> int | None:
        """The slot holding the state after the prefix whose last page hashes to ``h``, if any."""
        return self._slot_of.get(h)

    def pin(self, slot: int) -> None:
        """A claim will copy out of ``slot``: keep it until :meth:`unpin`."""
        n = self._pins.get(slot, 0)
        if n == 0:
            del self._lru[slot]
        self._pins[slot] = n + 1

    def unpin(self, slot: int) -> None:
        """A claim of ``slot`` ended (its copy is queued, or it was given back)."""
        n = self._pins[slot] - 1
        if n:
            self._pins[slot] = n
            return
        del self._pins[slot]
        self._lru[slot] = None  # most recently used

    def take_slot(self) -> int:
        """A slot for a live sequence: a free one, else the least recently used snapshot's.

        :raises MemoryError: when every slot is live or pinned (a caller bug: the
            manager reserves a slot before it takes one).
        """
        if not self.slots.num_free and self._lru:
            self._evict_one()
        return self.slots.allocate()

    def save(self, h: int, src_slot: int) -> bool:
        """Record a snapshot of ``src_slot`` for the prefix whose last page hashes to ``h``.

        The copy is queued for the next batch of :meth:`take_copies`. A snapshot
        takes a free slot, or else the least recently used idle snapshot's;
        with neither, no snapshot is taken.

        :param h: chained hash of the prefix's last page.
        :param src_slot: the live slot holding the state after that prefix.
        :return: True if the snapshot was recorded.
        """
        if h in self._slot_of:
            return False
        if not self.slots.num_free:
            if not self._lru:
                return False
            self._evict_one()
        slot = self.slots.allocate()
        self._slot_of[h] = slot
        self._hash_of[slot] = h
        self._lru[slot] = None
        self._saves.append((src_slot, slot))
        self.saved += 1
        return True

    def restore(self, slot: int, dst_slot: int) -> None:
        """Queue the copy of snapshot ``slot`` into the live slot ``dst_slot``."""
        self._restores.append((slot, dst_slot))
        self.restored += 1
        if slot in self._lru:
            self._lru.move_to_end(slot)

    def take_copies(self) -> tuple[StateCopies, StateCopies]:
        """The queued copies, to issue before the next forward: saves first, then restores.

        :return: ``(saves, restores)``, each a list of ``(source, destination)`` slots.
        """
        saves, restores = self._saves, self._restores
        self._saves, self._restores = [], []
        return saves, restores

    def discard(self, saves: StateCopies) -> None:
        """Forget the snapshots of ``saves`` whose copies never ran (their step failed)."""
        for _, slot in saves:
            h = self._hash_of.get(slot)
            if h is not None and slot not in self._pins:
                self._drop(slot)

    def _evict_one(self) -> None:
        slot, _ = self._lru.popitem(last=False)
        self._drop(slot, in_lru=False)
        self.evicted += 1

    def _drop(self, slot: int, *, in_lru: bool = True) -> None:
        """Forget the snapshot in ``slot`` and give the slot back to the pool."""
        h = self._hash_of.pop(slot)
        del self._slot_of[h]
        if in_lru:
            del self._lru[slot]
        # a save into this slot not yet issued would write a slot that is no longer a snapshot
        self._saves = [c for c in self._saves if c[1] != slot]
        self.slots.free(slot)

    def check_invariants(self) -> None:
        """Assert the maps, the LRU and the pins agree (tests)."""
        assert len(self._slot_of) == len(self._hash_of)
        for h, s in self._slot_of.items():
            assert self._hash_of[s] == h
        assert set(self._lru) | set(self._pins) == set(self._hash_of)
        assert not set(self._lru) & set(self._pins)
