"""The block table kept between steps packs what joining every page table packs.

Steps of decodes and prefills whose page tables grow (as new views, the way the
KV manager hands them out), shrink, move between positions, come and go, and
are longer than their sequences need, are packed twice: with a
:class:`PersistentBlockTable` and by joining the tables (the kit's path). Every
field must agree, and only the rows whose tables changed are rewritten.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from backplane.core.block_table import PersistentBlockTable
from backplane.core.metadata import NULL_PAGE
from backplane.core.packing import allocate_host, measure_batch, pack_batch

PAGE = 4


def _pack(q, c, tables, table=None, width=None):
    shape = measure_batch(q, c, PAGE, block_table_width=width)
    host = allocate_host(shape)
    # stale values everywhere: packing must write every entry
    for f in dataclasses.fields(host):
        getattr(host, f.name).fill(7)
    slots = np.arange(len(q), dtype=np.int32)
    pack_batch(shape, tables, slots, host, table=table)
    return host


def _same(a, b):
    for f in dataclasses.fields(a):
        np.testing.assert_array_equal(getattr(a, f.name), getattr(b, f.name), err_msg=f.name)


class _Req:
    """A request whose page table is a view of one page array, a new view when it grows."""

    def __init__(self, rng, first_page, length):
        self.pages = np.arange(first_page, first_page + 200, dtype=np.int32)
        rng.shuffle(self.pages)
        self.length = length
        self.view = self.pages[: -(-length // PAGE)]

    def grow(self, n, spare=0):
        self.length += n
        need = -(-self.length // PAGE) + spare
        if need != len(self.view):
            self.view = self.pages[:need]


@pytest.mark.parametrize("vectorise_from", [0, 1000])
@pytest.mark.parametrize("width", [None, 80])
def test_kept_table_packs_like_joined_tables(width, vectorise_from):
    rng = np.random.default_rng(3)
    reqs = [_Req(rng, 1000 * i, int(rng.integers(1, 60))) for i in range(12)]
    kept = PersistentBlockTable(max_rows=16, max_pages=80)
    kept.vectorise_from = vectorise_from  # rows rewritten one by one, or all in one pass
    for step in range(60):
        live = [r for r in reqs if rng.random() < 0.8]  # some sit out a step: rows move
        if step % 7 == 3:
            live = live[::-1]
        if step % 11 == 5 and live:  # a request preempted: its table starts again, shorter
            live[0].length = 1
            live[0].view = live[0].pages[:1].copy()
        prefill = [r for r in live if rng.random() < 0.25]
        decode = [r for r in live if r not in prefill]
        q = [int(rng.integers(2, 9)) for _ in prefill] + [1] * len(decode)
        order = prefill + decode
        c = [r.length for r in order]
        for r, n in zip(order, q, strict=True):
            # a few tables hold a page more than needed (reserved ahead)
            r.grow(n, spare=int(rng.random() < 0.2))
        tables = [r.view for r in order]
        before = [kept._sources[j] for j in range(len(order))]
        got = _pack(q, c, tables, kept, width)
        _same(got, _pack(q, c, tables, None, width))
        assert kept.rewritten == sum(t is not b for t, b in zip(tables, before, strict=True))
        # past each sequence's pages its row of the step's table is NULL_PAGE
        bt = got.block_table
        cols = np.arange(bt.shape[1])[None, :]
        assert (bt[cols >= np.diff(got.page_indptr)[:, None]] == NULL_PAGE).all()


def test_a_steady_decode_rewrites_only_rows_that_gained_a_page():
    rng = np.random.default_rng(0)
    reqs = [_Req(rng, 500 * i, 4 * i + 1) for i in range(8)]
    kept = PersistentBlockTable(max_rows=8, max_pages=64)
    q = [1] * 8
    _pack(q, [r.length for r in reqs], [r.view for r in reqs], kept)
    assert kept.rewritten == 8
    for r in reqs:
        r.grow(1)
    # each length was 4i+1 (+1 now = 4i+2): no table crossed a page boundary
    c = [r.length - 1 for r in reqs]
    _pack(q, c, [r.view for r in reqs], kept)
    assert kept.rewritten == 0
    for _ in range(3):
        for r in reqs:
            r.grow(1)
    c = [r.length - 1 for r in reqs]
    got = _pack(q, c, [r.view for r in reqs], kept)
    assert kept.rewritten == 8  # 4i+5 tokens: every table gained a page
    _same(got, _pack(q, c, [r.view for r in reqs]))


def test_a_short_table_is_refused_by_both_paths():
    kept = PersistentBlockTable(max_rows=4, max_pages=8)
    tables = [np.array([3], np.int32), np.array([4], np.int32)]
    for table in (kept, None):
        with pytest.raises(ValueError, match="sequence 1 needs 2 pages"):
            _pack([1, 1], [2, 4], tables, table)


def test_more_tables_than_rows_is_an_error_saying_what_to_raise():
    kept = PersistentBlockTable(max_rows=1, max_pages=8)
    with pytest.raises(ValueError, match="max_num_seqs"):
        kept.update([np.array([1], np.int32)] * 2)
