"""Ragged batches the conformance kit runs every backend on.

Each :class:`BatchCase` is a small, fully described batch: per-sequence query
and cached lengths, the page table and state slot of every sequence, the pool
sizes and the padded token count. :func:`batch_cases` returns the standard set,
which together cover every layout rule of :mod:`backplane.core.metadata`:

* pure prefill, pure decode, and mixed prefill + extend + decode batches;
* chunked prefill continuing from cached context;
* sequences whose tokens cross page boundaries (small pages);
* non-contiguous, shuffled page tables (pages are never in sequence order);
* recurrent-state slots out of order;
* padded token counts (rows past ``num_tokens`` must come back zero).

Shapes are deliberately tiny so that a family's whole suite runs in seconds on
a CPU; page 0 and state slot 0 are never handed out, as in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from backplane.core.launch import cdiv
from backplane.core.metadata import BatchMetadata
from backplane.core.packing import build_batch_metadata

#: Kinds accepted by :func:`batch_cases`.
KINDS = ("all", "prefill", "decode", "mixed")


@dataclass(frozen=True)
class BatchCase:
    """One ragged batch, described on the host.

    :param name: a short id used in test names.
    :param query_lens: new tokens per sequence (prefill/extend first, decode last).
    :param cached_lens: tokens already cached per sequence.
    :param page_size: tokens per KV page.
    :param num_pages: pages in the pool, including the reserved page 0.
    :param page_tables: the pages of each sequence, in sequence order.
    :param state_slots: the recurrent-state slot of each sequence.
    :param num_slots: slots in the state pool, including the reserved slot 0.
    :param padded_num_tokens: the flat token count including padding.
    """

    name: str
    query_lens: tuple[int, ...]
    cached_lens: tuple[int, ...]
    page_size: int
    num_pages: int
    page_tables: tuple[tuple[int, ...], ...]
    state_slots: tuple[int, ...]
    num_slots: int
    padded_num_tokens: int

    @property
    def num_seqs(self) -> int:
        """Number of sequences."""
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        """Number of real (unpadded) tokens."""
        return int(sum(self.query_lens))

    @property
    def num_decode_seqs(self) -> int:
        """Number of decode sequences (one new token on top of cached context)."""
        return sum(
            1 for q, c in zip(self.query_lens, self.cached_lens, strict=True) if q == 1 and c > 0
        )

    @property
    def num_prefill_seqs(self) -> int:
        """Number of prefill and extend sequences."""
        return self.num_seqs - self.num_decode_seqs

    def seq_lens(self) -> list[int]:
        """Total length of each sequence after this step."""
        return [q + c for q, c in zip(self.query_lens, self.cached_lens, strict=True)]

    def metadata(
        self, device: torch.device | str = "cpu", *, table_width: int | None = None
    ) -> BatchMetadata:
        """Build the batch metadata of this case on ``device``.

        :param device: where the metadata's device tensors go.
        :param table_width: pad the dense ``block_table`` with page 0 to this
            many columns, as the engine's persistent input buffers do (default:
            just wide enough for the longest sequence).
        :return: the :class:`~backplane.core.metadata.BatchMetadata`.
        """
        return build_batch_metadata(
            list(self.query_lens),
            list(self.cached_lens),
            [list(t) for t in self.page_tables],
            self.page_size,
            state_slots=list(self.state_slots),
            padded_num_tokens=self.padded_num_tokens,
            block_table_width=table_width,
            device=device,
        )


def make_case(
    name: str,
    query_lens: list[int],
    cached_lens: list[int],
    *,
    page_size: int = 4,
    shuffle_pages: bool = False,
    shuffle_slots: bool = False,
    padding: int = 0,
    spare_pages: int = 3,
    spare_slots: int = 2,
    seed: int = 0,
) -> BatchCase:
    """Build a :class:`BatchCase`, allocating pages and slots like a cache manager would.

    :param name: the case id.
    :param query_lens: new tokens per sequence (prefill/extend first, decode last).
    :param cached_lens: cached tokens per sequence.
    :param page_size: tokens per page.
    :param shuffle_pages: hand out pages in a random order (non-contiguous
        tables) instead of ``1, 2, 3, ...``.
    :param shuffle_slots: hand out state slots in a random order.
    :param padding: extra padded token rows after the real tokens.
    :param spare_pages: unused pages in the pool (they hold data no sequence
        may read).
    :param spare_slots: unused state slots in the pool.
    :param seed: seeds the shuffles.
    :return: the case.
    """
    rng = np.random.default_rng(seed)
    seq_lens = [q + c for q, c in zip(query_lens, cached_lens, strict=True)]
    need = [cdiv(s, page_size) for s in seq_lens]
    num_pages = 1 + sum(need) + spare_pages
    pool = np.arange(1, num_pages)
    if shuffle_pages:
        pool = rng.permutation(pool)
    tables: list[tuple[int, ...]] = []
    start = 0
    for k in need:
        tables.append(tuple(int(p) for p in pool[start : start + k]))
        start += k
    num_slots = 1 + len(query_lens) + spare_slots
    slot_pool = np.arange(1, num_slots)
    if shuffle_slots:
        slot_pool = rng.permutation(slot_pool)
    slots = tuple(int(s) for s in slot_pool[: len(query_lens)])
    return BatchCase(
        name=name,
        query_lens=tuple(int(q) for q in query_lens),
        cached_lens=tuple(int(c) for c in cached_lens),
        page_size=page_size,
        num_pages=num_pages,
        page_tables=tuple(tables),
        state_slots=slots,
        num_slots=num_slots,
        padded_num_tokens=sum(query_lens) + padding,
    )


def batch_cases(kind: str = "all", seed: int = 0, page_size: int | None = None) -> list[BatchCase]:
    """Return the standard ragged batches.

    :param kind: ``"all"``; ``"prefill"`` (no decode sequence and no cached
        context); ``"decode"`` (decode sequences only); or ``"mixed"``
        (everything else: extend chunks, mixtures).
    :param seed: seeds the page and slot shuffles.
    :param page_size: use this page size in every case (for backends that
        support only some page sizes); by default the cases use pages of 4 and
        2 tokens so that short sequences cross page boundaries.
    :return: the cases, each with a unique ``name``.
    :raises ValueError: for an unknown ``kind``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown batch kind {kind!r}; expected one of {', '.join(KINDS)}")
    specs: list[tuple[str, list[int], list[int], dict[str, Any]]] = [
        # Pure prefill: two fresh prompts, one spanning several pages, padded.
        ("prefill", [6, 3], [0, 0], {"padding": 2}),
        # Pure decode with padding, as a CUDA-graph bucket would pad it.
        ("decode", [1, 1, 1], [5, 8, 2], {"shuffle_pages": True, "padding": 1}),
        # Chunked prefill: second chunk of a prompt continuing from 8 cached
        # tokens (exactly two full pages), plus a chunk starting mid-page.
        ("chunked_prefill", [5, 4], [8, 6], {}),
        # Prefill + extend + decode in one step, shuffled pages and slots, padded.
        (
            "mixed",
            [5, 3, 1, 1],
            [0, 6, 9, 3],
            {"shuffle_pages": True, "shuffle_slots": True, "padding": 3},
        ),
        # Long-ish sequences over tiny pages: every sequence crosses many page
        # boundaries, pages shuffled.
        ("page_crossing", [7, 1, 1], [3, 10, 4], {"page_size": 2, "shuffle_pages": True}),
        # Single-token prefill (query_len 1, nothing cached) next to a decode.
        ("single_token_prefill", [1, 2, 1], [0, 0, 7], {"shuffle_slots": True}),
    ]
    cases = []
    for i, (name, query_lens, cached_lens, options) in enumerate(specs):
        options = dict(options)
        if page_size is not None:
            options["page_size"] = page_size
        cases.append(make_case(name, query_lens, cached_lens, seed=seed + i, **options))
    if kind == "all":
        return cases
    out = []
    for case in cases:
        has_decode = case.num_decode_seqs > 0
        has_cache = any(c > 0 for c in case.cached_lens)
        if kind == "prefill" and not has_cache:
            out.append(case)
        elif kind == "decode" and case.num_decode_seqs == case.num_seqs:
            out.append(case)
        elif kind == "mixed" and has_cache and (not has_decode or case.num_prefill_seqs > 0):
            out.append(case)
    return out
