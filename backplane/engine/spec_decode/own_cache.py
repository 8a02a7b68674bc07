"""The KV pages and state slots of a proposer that runs a model of its own.

A draft model or the MTP layers keep caches apart from the target's: the
scheduler never sees them, so the proposer hands out their pages and slots
itself, one page table and one slot per request, and takes them back when the
request goes away. Page 0 and slot 0 stay reserved (the backends' scratch),
as in the engine's own pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from backplane.core.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from backplane.models.base import CachedModule

__all__ = ["OwnCache", "SequenceCache", "allocate_own_cache", "common_prefix"]


@dataclass
class SequenceCache:
    """One request's share of a proposer's cache.

    :param slot: its recurrent-state slot.
    :param pages: its page ids, in order.
    :param tokens: the token ids whose keys and values (or state) are in the cache, in order.
    :param checked: how many leading entries a rollback found fed committed tokens; those
        never change, so the next rollback checks only the entries after them.
    """

    slot: int
    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    checked: int = 0

    def cut(self, keep: int) -> None:
        """Drop every entry from ``keep`` on.

        :param keep: how many leading entries stay.
        """
        del self.tokens[keep:]
        self.checked = min(self.checked, keep)


class OwnCache:
    """Pages and slots of a proposer's own caches, handed out per request.

    :param num_pages: pages per layer, page 0 included (reserved).
    :param page_size: tokens per page.
    :param num_slots: state slots, slot 0 included (reserved).
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        # Popped from the end: the lowest ids go out first.
        self._free_pages = list(range(num_pages - 1, 0, -1))
        self._free_slots = list(range(num_slots - 1, 0, -1))
        self.sequences: dict[str, SequenceCache] = {}

    def get(self, request_id: str) -> SequenceCache:
        """The request's cache, taking a slot for a request seen for the first time.

        :param request_id: the request.
        :return: its :class:`SequenceCache`.
        :raises ConfigError: when every slot is taken.
        """
        seq = self.sequences.get(request_id)
        if seq is None:
            if not self._free_slots:
                raise ConfigError(
                    f"the speculative proposer's cache holds {self.num_slots - 1} sequences and "
                    "all are in use; lower max_num_seqs or give the proposer more sequences"
                )
            seq = self.sequences[request_id] = SequenceCache(slot=self._free_slots.pop())
        return seq

    def reserve(self, seq: SequenceCache, num_tokens: int) -> np.ndarray:
        """Make ``seq``'s pages hold ``num_tokens`` tokens.

        :param seq: the request's cache.
        :param num_tokens: tokens it must hold.
        :return: its page table (int32).
        :raises ConfigError: when the pages run out.
        """
        need = -(-num_tokens // self.page_size) - len(seq.pages)
        if need > len(self._free_pages):
            raise ConfigError(
                f"the speculative proposer's cache ran out of pages ({self.num_pages - 1} of "
                f"{self.page_size} tokens); lower max_num_seqs or max_model_len"
            )
        for _ in range(max(need, 0)):
            seq.pages.append(self._free_pages.pop())
        return np.asarray(seq.pages, dtype=np.int32)

    def release(self, request_id: str) -> None:
        """Give a request's pages and slot back (nothing for an unknown request).

        :param request_id: the request.
        """
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return
        self._free_pages.extend(reversed(seq.pages))
        self._free_slots.append(seq.slot)


def common_prefix(cached: list[int], tokens: np.ndarray, start: int = 0) -> int:
    """How many leading tokens of ``cached`` equal those of ``tokens``.

    :param cached: the token ids in a cache.
    :param tokens: the sequence now.
    :param start: how many leading tokens are known to be equal already (not compared).
    :return: the length of the common prefix.
    """
    n = min(len(cached), len(tokens))
    start = min(start, n)
    if n == start:
        return n
    diff = np.flatnonzero(np.asarray(cached[start:n]) != np.asarray(tokens[start:n]))
    return start + int(diff[0]) if len(diff) else n


def allocate_own_cache(
    model: CachedModule,
    *,
    max_num_seqs: int,
    max_model_len: int,
    num_speculative_tokens: int,
    page_size: int,
) -> tuple[OwnCache, dict[str, dict[str, torch.Tensor]]]:
    """Pages and slots for ``max_num_seqs`` sequences, and ``model``'s caches of that size.

    Every sequence may hold ``max_model_len`` tokens plus a full draft; the
    caches take the dtype and device of the model's parameters.

    :param model: the module whose caches these are (a draft model or the MTP layers).
    :param max_num_seqs: the most sequences drafted for at once.
    :param max_model_len: the longest sequence (tokens).
    :param num_speculative_tokens: ``k``, the most tokens drafted per sequence.
    :param page_size: tokens per page.
    :return: the pages and slots handed out per request, and the allocated caches.
    """
    pages_per_seq = -(-(max_model_len + num_speculative_tokens) // page_size)
    cache = OwnCache(max_num_seqs * pages_per_seq + 1, page_size, max_num_seqs + 1)
    param = next(model.parameters())
    caches = model.allocate_caches(
        num_pages=cache.num_pages,
        page_size=page_size,
        num_slots=cache.num_slots,
        dtype=param.dtype,
        device=param.device,
    )
    return cache, caches
