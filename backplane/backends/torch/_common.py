"""Paged-cache helpers shared by the torch attention and MLA backends.

Both work on device tensors only and take host integers for shapes and
slicing, so they never synchronise with the device.
"""

from __future__ import annotations

import torch

#: Upper bound on the elements of one float32 score block ``[heads, queries, keys]``
#: in prefill; longer prompts are processed in query chunks so that memory stays
#: bounded (64 Mi elements = 256 MiB).
MAX_SCORE_ELEMENTS = 1 << 26


def write_slots(
    cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor, page_size: int
) -> None:
    """Write ``values[i]`` to cache slot ``slot_mapping[i]``, skipping ``-1``.

    Skipped rows are redirected to slot 0 and rewrite the value already there,
    so no sequence-visible (or scratch) entry changes, without a data-dependent
    selection (which would need ``nonzero`` and a host synchronisation).

    :param cache: ``[num_pages, page_size, *row]``, possibly a strided view
        (e.g. the K half of a paged KV cache); written in place.
    :param values: ``[N, *row]``.
    :param slot_mapping: ``[N]`` integer slots ``page * page_size + offset``, ``-1`` = skip.
    :param page_size: tokens per page.
    """
    if values.shape[0] == 0:
        return
    slots = slot_mapping.to(torch.long)
    valid = slots >= 0
    safe = torch.where(valid, slots, torch.zeros_like(slots))
    page = torch.div(safe, page_size, rounding_mode="floor")
    offset = safe - page * page_size
    current = cache[page, offset]
    keep = valid.view(-1, *([1] * (values.dim() - 1)))
    cache.index_put_((page, offset), torch.where(keep, values.to(cache.dtype), current))


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """Gather the first ``length`` token rows of a sequence from its pages.

    :param cache: ``[num_pages, page_size, *row]`` (may be a strided view).
    :param pages: the sequence's page ids, in order (device tensor).
    :param length: tokens to return (``<= len(pages) * page_size``).
    :return: ``[length, *row]`` (a new tensor).
    """
    rows = cache[pages.to(torch.long)]
    return rows.reshape(-1, *cache.shape[2:])[:length]


def query_chunk(num_heads: int, num_keys: int) -> int:
    """Return how many query rows to score at once under :data:`MAX_SCORE_ELEMENTS`."""
    return max(1, MAX_SCORE_ELEMENTS // max(1, num_heads * num_keys))
