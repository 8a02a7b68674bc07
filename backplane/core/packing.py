"""Packing a step's per-sequence facts into the batch layout of :mod:`backplane.core.metadata`.

One packer serves every producer of batches: the engine's input preparation
(:class:`backplane.engine.worker.inputs.InputBatch`, which packs into views of its
pinned host buffer and copies them to the device at once) and
:func:`build_batch_metadata` (the conformance kit,
``backplane warmup``, benchmarks), so a backend tested on the kit's batches sees
exactly the layout the engine hands it.

Packing takes two calls, because the sizes of the arrays depend on the facts:

1. :func:`measure_batch` checks the per-sequence counts and computes every size
   (tokens, padding, pages, block-table width) as a :class:`BatchShape`;
2. :func:`pack_batch` writes every field of a :class:`~backplane.core.metadata.HostBatch`
   sized for that shape (see :func:`allocate_host`), and optionally the step's
   input ids and the rows to sample.

Both are vectorised with numpy: the Python work is O(1) per sequence (one
page table per sequence is concatenated, or, with the engine's
:class:`~backplane.core.block_table.PersistentBlockTable`, written only when it
changed since the previous step), everything else runs in numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backplane.core.block_table import PersistentBlockTable
from backplane.core.launch import cdiv
from backplane.core.metadata import EAGER, NULL_PAGE, BatchMetadata, HostBatch, StepMode

__all__ = ["BatchShape", "allocate_host", "build_batch_metadata", "measure_batch", "pack_batch"]

_arange_cache = np.arange(4096, dtype=np.int64)
_arange_cache.flags.writeable = False


def _arange(n: int) -> np.ndarray:
    """A read-only ``0..n-1`` int64 view, made once and grown on demand (no per-step arange)."""
    global _arange_cache
    if n > len(_arange_cache):
        grown = np.arange(max(n, 2 * len(_arange_cache)), dtype=np.int64)
        grown.flags.writeable = False
        _arange_cache = grown
    return _arange_cache[:n]


@dataclass
class BatchShape:
    """The counts and sizes of one step, from :func:`measure_batch`.

    Per-sequence arrays are in packing order: prefill/extend sequences first,
    decode sequences (one new token on cached context) last.

    :param query_lens: int32 new tokens per sequence.
    :param cached_lens: int32 cached tokens per sequence.
    :param seq_lens: int32 total length per sequence after the step.
    :param pages_needed: int32 pages each sequence's table must provide.
    :param page_size: tokens per KV page.
    :param num_prefill_seqs: leading prefill/extend sequences.
    :param num_tokens: real tokens of the step.
    :param padded_num_tokens: tokens including padding.
    :param total_pages: page entries of all sequences (``page_indices`` length).
    :param max_pages: most pages one sequence needs.
    :param block_table_width: columns of the dense block table.
    :param max_query_len: most new tokens of one sequence.
    :param max_seq_len: longest sequence after the step.
    :param one_token_each: every sequence adds exactly one token (decode steps).
    :param order: the stable permutation of the given sequences that puts decode
        sequences last, when they were not already; ``None`` when the given
        order is the packing order.
    """

    query_lens: np.ndarray
    cached_lens: np.ndarray
    seq_lens: np.ndarray
    pages_needed: np.ndarray
    page_size: int
    num_prefill_seqs: int
    num_tokens: int
    padded_num_tokens: int
    total_pages: int
    max_pages: int
    block_table_width: int
    max_query_len: int
    max_seq_len: int
    one_token_each: bool
    order: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        """Number of sequences."""
        return len(self.query_lens)

    @property
    def num_decode_seqs(self) -> int:
        """Trailing decode sequences (one token each)."""
        return len(self.query_lens) - self.num_prefill_seqs

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of the prefill/extend sequences."""
        return self.num_tokens - self.num_decode_seqs


def measure_batch(
    query_lens: Sequence[int] | np.ndarray,
    cached_lens: Sequence[int] | np.ndarray,
    page_size: int,
    *,
    padded_num_tokens: int | None = None,
    block_table_width: int | None = None,
) -> BatchShape:
    """Check a step's per-sequence counts and compute the sizes of its layout.

    A sequence adding one token to cached context counts as decode for the
    kernels, even when it is the last chunk of a prefill; such sequences are
    packed after the prefill/extend ones (``BatchShape.order`` says how, when
    they were given out of order).

    :param query_lens: new tokens per sequence this step.
    :param cached_lens: tokens already in the cache per sequence.
    :param page_size: tokens per KV page.
    :param padded_num_tokens: pad the flat token dimension to this count
        (default: no padding).
    :param block_table_width: fixed column count of the dense block table
        (default: the most pages any sequence needs, at least 1).
    :return: the :class:`BatchShape`.
    :raises ValueError: a sequence without new tokens, counts of different
        lengths, or a padding or table width too small for the step.
    """
    q = np.asarray(query_lens, dtype=np.int32)
    c = np.asarray(cached_lens, dtype=np.int32)
    n = len(q)
    if len(c) != n:
        raise ValueError(
            f"query_lens has {n} entries but cached_lens {len(c)}; give one entry per sequence"
        )
    if n and q.min() < 1:
        raise ValueError("every sequence needs at least one new token")
    num_tokens = int(q.sum())
    one_each = num_tokens == n
    is_decode = c > 0 if one_each else (q == 1) & (c > 0)
    num_decode = int(np.count_nonzero(is_decode))
    num_prefill = n - num_decode
    order = None
    if 0 < num_decode < n and not is_decode[num_prefill:].all():
        order = np.argsort(is_decode, kind="stable")
        q, c = q[order], c[order]
    padded = num_tokens if padded_num_tokens is None else int(padded_num_tokens)
    if padded < num_tokens:
        raise ValueError(
            f"padded_num_tokens={padded} < num_tokens={num_tokens}; pad to at least the "
            "step's token count"
        )
    seq_lens = c + q
    pages_needed = (seq_lens + (page_size - 1)) // page_size
    if n:
        max_seq_len = int(seq_lens.max())
        max_pages = cdiv(max_seq_len, page_size)  # pages grow with length
        total_pages = int(pages_needed.sum())
        max_query_len = 1 if one_each else int(q.max())
    else:
        max_pages = total_pages = max_seq_len = max_query_len = 0
    width = max(max_pages, 1) if block_table_width is None else int(block_table_width)
    if width < max_pages:
        raise ValueError(
            f"block_table_width={width} < {max_pages} pages needed by the longest sequence"
        )
    return BatchShape(
        query_lens=q,
        cached_lens=c,
        seq_lens=seq_lens,
        pages_needed=pages_needed,
        page_size=int(page_size),
        num_prefill_seqs=num_prefill,
        num_tokens=num_tokens,
        padded_num_tokens=padded,
        total_pages=total_pages,
        max_pages=max_pages,
        block_table_width=width,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        one_token_each=one_each,
        order=order,
    )


def allocate_host(shape: BatchShape) -> HostBatch:
    """Allocate uninitialised host arrays sized for ``shape`` (every field is written by packing).

    :param shape: the step's shape.
    :return: a :class:`HostBatch` to pass to :func:`pack_batch`.
    """
    n, t = shape.num_seqs, shape.padded_num_tokens
    i32 = np.int32
    return HostBatch(
        query_start_loc=np.empty(n + 1, i32),
        query_lens=np.empty(n, i32),
        cached_lens=np.empty(n, i32),
        seq_lens=np.empty(n, i32),
        page_indptr=np.empty(n + 1, i32),
        page_indices=np.empty(shape.total_pages, i32),
        last_page_lens=np.empty(n, i32),
        block_table=np.empty((n, shape.block_table_width), i32),
        state_slots=np.empty(n, i32),
        has_initial_state=np.empty(n, np.bool_),
        positions=np.empty(t, np.int64),
        slot_mapping=np.empty(t, np.int64),
        token_seq_ids=np.empty(t, i32),
        last_token_indices=np.empty(n, np.int64),
    )


def pack_batch(
    shape: BatchShape,
    page_tables: Sequence[np.ndarray],
    state_slots: np.ndarray,
    out: HostBatch,
    *,
    token_ids: Sequence[np.ndarray] | None = None,
    input_ids: np.ndarray | None = None,
    sample: np.ndarray | None = None,
    logits_indices: np.ndarray | None = None,
    table: PersistentBlockTable | None = None,
) -> np.ndarray | None:
    """Write every field of the step's layout into ``out`` (and the input ids and sampled rows).

    Arguments are in packing order (apply ``shape.order`` first when it is set).

    :param shape: from :func:`measure_batch`.
    :param page_tables: the page ids of each sequence, at least
        ``shape.pages_needed[i]`` of them (longer tables are cut).
    :param state_slots: int32 recurrent-state slot per sequence.
    :param out: arrays sized for ``shape`` (:func:`allocate_host`, or views of a
        persistent buffer); every entry is overwritten.
    :param token_ids: the step's new tokens in order, in any number of pieces
        (one per sequence, or runs of sequences) whose concatenation has
        ``shape.num_tokens`` entries; written to ``input_ids``.
    :param input_ids: ``[padded_num_tokens]`` int64, filled from ``token_ids``
        with zeros in the padding.
    :param sample: bool per sequence: whether it samples a token this step.
    :param logits_indices: int64 with room for every sequence; its first entries
        receive the flat token row of the last token of each sampling sequence.
    :param table: a block table kept between steps (by the engine's input batch):
        ``page_tables`` are written into it, only where they changed since the
        previous step, and the step's page fields are read from it instead of
        joining every page table again. The result is the same.
    :return: the indices of the sampling sequences (in packing order) when
        ``sample`` is given, else ``None``.
    :raises ValueError: a page table too short for its sequence.
    """
    n = shape.num_seqs
    ps = shape.page_size
    q, c = shape.query_lens, shape.cached_lens
    num_tokens, padded = shape.num_tokens, shape.padded_num_tokens
    pages_needed = shape.pages_needed
    total_pages = shape.total_pages
    width = shape.block_table_width
    ar = _arange(max(n + 1, num_tokens, total_pages))

    # -- per sequence: offsets, lengths, pages ----------------------------------
    out.query_lens[:] = q
    out.cached_lens[:] = c
    out.seq_lens[:] = shape.seq_lens
    out.state_slots[:] = state_slots
    qsl, last_tok = out.query_start_loc, out.last_token_indices
    if shape.one_token_each:
        qsl[:] = ar[: n + 1]
        last_tok[:] = ar[:n]
    else:
        qsl[0] = 0
        np.add.accumulate(q, out=qsl[1:])  # cumsum, without its per-call overhead
        np.subtract(qsl[1:], 1, out=last_tok)
    page_indptr = out.page_indptr
    page_indptr[0] = 0
    np.add.accumulate(pages_needed, out=page_indptr[1:])
    page_indices = out.page_indices
    block_table = out.block_table
    if table is not None:
        _pack_pages_from(table, shape, page_tables, block_table, page_indices)
    elif n:
        # one concatenation of every page table, then one gather of the needed prefixes
        have = np.fromiter(map(len, page_tables), np.int64, n)
        if (have < pages_needed).any():
            bad = int(np.argmax(have < pages_needed))
            raise ValueError(
                f"sequence {bad} needs {pages_needed[bad]} pages for {shape.seq_lens[bad]} "
                f"tokens, its page table has {have[bad]}; allocate its pages before packing"
            )
        flat = np.concatenate(page_tables)
        if len(flat) == total_pages:
            page_indices[:] = flat
        else:
            shift = np.repeat(np.cumsum(have) - have - page_indptr[:n], pages_needed)
            page_indices[:] = flat[ar[:total_pages] + shift]
    if table is None:
        block_table.fill(NULL_PAGE)
        page_seq = np.repeat(ar[:n], pages_needed)
        page_col = ar[:total_pages] - np.repeat(page_indptr[:n], pages_needed)
        block_table.reshape(-1)[page_seq * width + page_col] = page_indices
    np.subtract(shape.seq_lens, (pages_needed - 1) * ps, out=out.last_page_lens)
    np.greater(c, 0, out=out.has_initial_state)

    # -- per token: positions (computed once), owners, cache slots ---------------
    positions, token_seq_ids, slot_mapping = out.positions, out.token_seq_ids, out.slot_mapping
    if shape.one_token_each:
        token_seq = ar[:n]
        positions[:n] = c
    else:
        token_seq = np.repeat(ar[:n], q)
        np.add(ar[:num_tokens], (c - qsl[:n])[token_seq], out=positions[:num_tokens])
    pos = positions[:num_tokens]
    token_seq_ids[:num_tokens] = token_seq
    sm = slot_mapping[:num_tokens]
    np.multiply(block_table.reshape(-1)[token_seq * width + pos // ps], ps, out=sm)
    sm += pos % ps
    if padded > num_tokens:
        positions[num_tokens:] = 0
        token_seq_ids[num_tokens:] = -1
        slot_mapping[num_tokens:] = -1

    # -- model inputs: token ids and the rows to sample ---------------------------
    if input_ids is not None and token_ids is not None:
        if len(token_ids) == 1:
            input_ids[:num_tokens] = token_ids[0]
        elif num_tokens:
            np.concatenate(token_ids, out=input_ids[:num_tokens], casting="same_kind")
        if padded > num_tokens:
            input_ids[num_tokens:padded] = 0
    if sample is None:
        return None
    rows = np.flatnonzero(sample)
    if logits_indices is not None:
        logits_indices[: len(rows)] = rows if shape.one_token_each else last_tok[rows]
    return rows


def _pack_pages_from(
    table: PersistentBlockTable,
    shape: BatchShape,
    page_tables: Sequence[np.ndarray],
    block_table: np.ndarray,
    page_indices: np.ndarray,
) -> None:
    """The step's dense block table and flat page indices, read from a kept block table.

    Each sequence's row keeps its first ``pages_needed`` entries, the rest is
    ``NULL_PAGE``; the flat page indices are those entries, row by row.
    """
    n = shape.num_seqs
    table.update(page_tables)
    pages_needed = shape.pages_needed
    have = table.lens[:n]
    if n and (have < pages_needed).any():
        bad = int(np.argmax(have < pages_needed))
        raise ValueError(
            f"sequence {bad} needs {pages_needed[bad]} pages for {shape.seq_lens[bad]} "
            f"tokens, its page table has {have[bad]}; allocate its pages before packing"
        )
    if shape.max_pages > table.max_pages:
        raise ValueError(
            f"a sequence needs {shape.max_pages} pages, more than the block table's "
            f"{table.max_pages} columns; size it for the longest sequence"
        )
    w = min(shape.block_table_width, table.max_pages)
    keep = _arange(w)[None, :] < pages_needed[:, None]
    if w < shape.block_table_width:
        block_table[:, w:] = NULL_PAGE
    if np.array_equal(have, pages_needed):
        # every table holds just the pages its sequence needs (the usual case): its row
        # is already what the step's table must hold, NULL_PAGE past its pages
        block_table[:, :w] = table.rows[:n, :w]
    else:
        block_table[:, :w] = NULL_PAGE
        np.copyto(block_table[:, :w], table.rows[:n, :w], where=keep)
    page_indices[:] = block_table[:, :w][keep]


def build_batch_metadata(
    query_lens: Sequence[int] | np.ndarray,
    cached_lens: Sequence[int] | np.ndarray,
    page_tables: Sequence[Sequence[int] | np.ndarray],
    page_size: int,
    *,
    state_slots: Sequence[int] | np.ndarray | None = None,
    padded_num_tokens: int | None = None,
    block_table_width: int | None = None,
    device: torch.device | str = "cpu",
    mode: StepMode = EAGER,
) -> BatchMetadata:
    """Build batch metadata from per-sequence facts with the engine's packer.

    The arrays are packed by :func:`pack_batch`, the same
    code that prepares the engine's steps, so tests and tools see the engine's
    exact layout.

    :param query_lens: new tokens per sequence this step; prefill/extend
        sequences first, then decode sequences (``query_len == 1`` with cached
        context).
    :param cached_lens: tokens already in the cache per sequence.
    :param page_tables: the page ids of each sequence, enough to hold
        ``cached_len + query_len`` tokens.
    :param page_size: tokens per page.
    :param state_slots: recurrent-state slot per sequence (default ``1..n``).
    :param padded_num_tokens: flat token count including padding (default: no padding).
    :param block_table_width: columns of the dense block table, padded with page 0
        (default: the most pages any sequence needs).
    :param device: where the device tensors go.
    :param mode: how the step runs (a decode graph or piecewise bucket must match
        the batch's padded size).
    :return: the metadata.
    :raises ValueError: on inconsistent input.
    """
    n = len(query_lens)
    if len(cached_lens) != n or len(page_tables) != n:
        raise ValueError(
            f"query_lens, cached_lens and page_tables must have one entry per sequence "
            f"(got {n}, {len(cached_lens)} and {len(page_tables)})"
        )
    shape = measure_batch(
        query_lens,
        cached_lens,
        page_size,
        padded_num_tokens=padded_num_tokens,
        block_table_width=block_table_width,
    )
    if shape.order is not None:
        raise ValueError(
            "prefill/extend sequences must come before decode sequences (one new token "
            "on cached context)"
        )
    slots = (
        np.arange(1, n + 1, dtype=np.int32)
        if state_slots is None
        else np.asarray(state_slots, dtype=np.int32)
    )
    tables = [np.asarray(t, dtype=np.int32) for t in page_tables]
    host = allocate_host(shape)
    pack_batch(shape, tables, slots, host)
    return BatchMetadata.from_host(
        host,
        num_prefill_seqs=shape.num_prefill_seqs,
        page_size=page_size,
        padded_num_tokens=shape.padded_num_tokens,
        device=device,
        mode=mode.check(shape.num_seqs, shape.num_decode_seqs, shape.padded_num_tokens),
    )
