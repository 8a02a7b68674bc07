"""Paged-cache helpers shared by the torch attention and MLA backends.

Both work on device tensors only and take host integers for shapes and
slicing, so they never synchronise with the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from backplane.core.launch import cdiv
from backplane.core.metadata import BatchMetadata

#: Upper bound on the elements of one float32 score block ``[heads, queries, keys]``
#: in prefill; longer prompts are processed in query chunks so that memory stays
#: bounded (64 Mi elements = 256 MiB).
MAX_SCORE_ELEMENTS = 1 << 26


def slots_known_valid(batch: BatchMetadata) -> bool:
    """Whether the host says every real token of ``batch`` has a cache slot (none is ``-1``).

    Only steps that run op by op may trust their host values: a captured decode
    graph replays whatever was decided while it was captured, so it always
    takes the general path of :func:`write_slots`.

    :param batch: the step's metadata.
    :return: ``True`` when the cheap, unmasked write is safe.
    """
    if batch.mode.is_decode_graph:
        return False
    n = batch.num_tokens
    return n == 0 or int(batch.host.slot_mapping[:n].min()) >= 0


@dataclass(frozen=True)
class SlotIndex:
    """Where each of a step's token rows goes in a paged cache: page and offset.

    :param page: ``[N]`` int64 page of each row.
    :param offset: ``[N]`` int64 offset in the page.
    :param valid: ``[N]`` bool, ``False`` for rows to skip (their page and offset
        point at slot 0); ``None`` when every row is written.
    """

    page: torch.Tensor
    offset: torch.Tensor
    valid: torch.Tensor | None
    #: flat row index per rows-per-page count, built by the first :meth:`write`
    #: and reused by every later layer of the step
    _flat: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, slot_mapping: torch.Tensor, page_size: int, *, all_valid: bool) -> SlotIndex:
        """Split slots ``page * page_size + offset`` (``-1`` = skip) into pages and offsets.

        :param slot_mapping: ``[N]`` integer slots.
        :param page_size: tokens per page.
        :param all_valid: the caller knows no slot is ``-1`` (see
            :func:`slots_known_valid`): no skip mask is built.
        :return: the index.
        """
        slots = slot_mapping.to(torch.long)
        valid = None
        if not all_valid:
            valid = slots >= 0
            slots = torch.where(valid, slots, torch.zeros_like(slots))
        page = torch.div(slots, page_size, rounding_mode="floor")
        return cls(page, slots - page * page_size, valid)

    def write(self, caches: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Write ``values[j][i]`` to row ``i``'s slot of ``caches[j]``, skipping invalid rows.

        Skipped rows are redirected to slot 0 and rewrite the value already
        there, so no sequence-visible (or scratch) entry changes, without a
        data-dependent selection (which would need ``nonzero`` and a host
        synchronisation).

        :param caches: each ``[num_pages, page_size, *row]``, possibly a strided view
            (e.g. the K half of a paged KV cache); written in place.
        :param values: one ``[N, *row]`` per cache.
        """
        if self.page.shape[0] == 0:
            return
        flat_index = self._flat
        for cache, rows in zip(caches, values, strict=True):
            if rows.dtype != cache.dtype:
                rows = rows.to(cache.dtype)
            flat = _token_rows(cache)
            if flat is not None:
                # One index into a [rows, row_numel] view of the cache's memory: a
                # row copy per token, where (page, offset) indexing of the strided
                # view goes element by element (~20x slower for a long prompt on CPU).
                per_page = cache.stride(0) // cache.stride(1)
                index = flat_index.get(per_page)
                if index is None:
                    index = flat_index[per_page] = self.page * per_page + self.offset
                target, key, rows = flat, (index,), rows.reshape(rows.shape[0], -1)
            else:
                target, key = cache, (self.page, self.offset)
            if self.valid is not None:
                keep = self.valid.view(-1, *([1] * (rows.dim() - 1)))
                rows = torch.where(keep, rows, target[key])
            target.index_put_(key, rows)


def _token_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """A ``[rows, row_numel]`` view of a paged cache's memory with one row per token slot.

    Token ``(page, offset)`` is row ``page * (stride(0) // stride(1)) + offset``;
    rows between pages (e.g. the other half of a K/V cache) are never indexed.

    :param cache: ``[num_pages, page_size, *row]`` (possibly a strided view).
    :return: the view, or ``None`` when a token's row is not contiguous in memory
        or pages do not start on a row boundary.
    """
    if cache.dim() < 3 or cache.shape[0] == 0:
        return None
    row_numel = 1
    for size in cache.shape[2:]:
        row_numel *= size
    if cache.stride(1) != row_numel or cache.stride(0) % row_numel:
        return None
    if not cache[0, 0].is_contiguous():
        return None
    num_rows = (cache.shape[0] - 1) * (cache.stride(0) // row_numel) + cache.shape[1]
    return cache.as_strided((num_rows, row_numel), (row_numel, 1), cache.storage_offset())


def write_slots(
    caches: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    page_size: int,
    *,
    all_valid: bool = False,
) -> None:
    """Write ``values[j][i]`` to slot ``slot_mapping[i]`` of ``caches[j]``, skipping ``-1``.

    The slot arithmetic is done once for every cache (see :class:`SlotIndex`).

    :param caches: each ``[num_pages, page_size, *row]``, possibly a strided view
        (e.g. the K half of a paged KV cache); written in place.
    :param values: one ``[N, *row]`` per cache.
    :param slot_mapping: ``[N]`` integer slots ``page * page_size + offset``, ``-1`` = skip.
    :param page_size: tokens per page.
    :param all_valid: the caller knows no slot is ``-1`` (see
        :func:`slots_known_valid`): the rows are written directly, without
        reading back the entries a skipped row would have preserved.
    """
    SlotIndex.of(slot_mapping, page_size, all_valid=all_valid).write(caches, values)


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """Gather the first ``length`` token rows of a sequence from its pages.

    :param cache: ``[num_pages, page_size, *row]`` (may be a strided view).
    :param pages: the sequence's page ids, in order (device tensor).
    :param length: tokens to return (``<= len(pages) * page_size``).
    :return: ``[length, *row]`` (a new tensor).
    """
    # index_select copies whole pages; advanced indexing of a strided view goes
    # element by element and is several times slower on CPU.
    rows = cache.index_select(0, pages)
    return rows.reshape(-1, *cache.shape[2:])[:length]


def kv_page_rows(pages: torch.Tensor) -> torch.Tensor:
    """Rows of the key halves, then of the value halves, of ``pages`` in a ``[num_pages * 2, ...]`` view.

    :param pages: page ids (any shape; flattened in order).
    :return: ``[2 * pages.numel()]`` row indices for :func:`gather_kv_pages`.
    """
    pages = pages.reshape(-1).to(torch.long)
    return torch.cat((pages * 2, pages * 2 + 1))


def gather_kv_pages(
    kv_cache: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather whole pages of a paged KV cache, keys and values at once.

    :param kv_cache: ``[num_pages, 2, page_size, *row]`` (keys at ``[:, 0]``,
        values at ``[:, 1]``).
    :param pages: page ids (any shape; flattened in order), device tensor.
    :param rows: ``kv_page_rows(pages)``, when the caller keeps it for several layers.
    :return: ``(keys, values)``, each ``[pages.numel() * page_size, *row]``, contiguous.
    """
    row = kv_cache.shape[3:]
    if kv_cache.is_contiguous():
        # Each page's key half and value half are one contiguous block: gathering
        # them as rows of a 2-D view copies block by block, and the keys and the
        # values come out contiguous with no second copy (a strided gather of
        # [:, 0] goes element by element, about 50x slower on CPU for decode sizes).
        if rows is None:
            rows = kv_page_rows(pages)
        halves = kv_cache.view(kv_cache.shape[0] * 2, -1).index_select(0, rows)
        halves = halves.view(2, -1, *row)
        return halves[0], halves[1]
    gathered = kv_cache.index_select(0, pages.reshape(-1))
    return gathered[:, 0].reshape(-1, *row), gathered[:, 1].reshape(-1, *row)


def query_chunk(num_heads: int, num_keys: int) -> int:
    """Return how many query rows to score at once under :data:`MAX_SCORE_ELEMENTS`."""
    return max(1, MAX_SCORE_ELEMENTS // max(1, num_heads * num_keys))


def decode_table(batch: BatchMetadata) -> torch.Tensor:
    """The block-table rows of the decode sequences, as wide as this step needs.

    Op by op, the host lengths hold for this very step, so only the columns of
    the longest decode sequence are kept. A captured decode graph keeps the whole
    table: its width is fixed by the engine's persistent buffers, so the graph
    stays valid as sequences grow (the callers mask keys past each length).

    :param batch: the step's metadata (with at least one decode sequence).
    :return: ``[num_decode_seqs, pages]`` int page ids (a view of ``batch.block_table``).
    """
    first, nd = batch.num_prefill_seqs, batch.num_decode_seqs
    table = batch.block_table[first : first + nd]
    if batch.mode.is_decode_graph:
        return table
    longest = int(batch.host.seq_lens[first : first + nd].max())
    return table[:, : cdiv(longest, batch.page_size)]
