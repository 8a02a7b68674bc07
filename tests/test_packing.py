"""One packer: the engine's input preparation and build_batch_metadata give identical batches."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backplane.core.metadata import BatchMetadata, HostBatch
from backplane.core.packing import allocate_host, build_batch_metadata, measure_batch, pack_batch
from backplane.engine.worker.inputs import InputBatch

COUNTS = (
    "num_prefill_seqs",
    "num_prefill_tokens",
    "num_decode_seqs",
    "num_decode_tokens",
    "padded_num_tokens",
    "page_size",
    "max_query_len",
    "max_seq_len",
)


@dataclass
class _Req:
    token_buffer: np.ndarray


@dataclass
class _Seq:
    request: _Req
    num_new_tokens: int
    num_cached_tokens: int
    page_ids: np.ndarray
    state_slot: int
    is_prefill_chunk_final: bool = True


def assert_same_batch(got: BatchMetadata, want: BatchMetadata) -> None:
    """Every count, host array and device tensor equal, with the same dtypes and shapes."""
    for name in COUNTS:
        assert getattr(got, name) == getattr(want, name), name
    for f in fields(HostBatch):
        g, w = getattr(got.host, f.name), getattr(want.host, f.name)
        assert g.dtype == w.dtype and g.shape == w.shape, f.name
        np.testing.assert_array_equal(g, w, err_msg=f.name)
        gd, wd = getattr(got, f.name), getattr(want, f.name)
        assert gd.dtype == wd.dtype and tuple(gd.shape) == tuple(wd.shape), f"device {f.name}"
        np.testing.assert_array_equal(gd.cpu().numpy(), wd.numpy(), err_msg=f"device {f.name}")


@st.composite
def steps(draw):
    """A step of prefill (fresh), extend (on cached context) and decode sequences, maybe padded."""
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    kinds = draw(st.lists(st.sampled_from(["prefill", "extend", "decode"]), max_size=7))
    kinds.sort(key=lambda k: k == "decode")  # the layout's order: decode sequences last
    lens = []
    for kind in kinds:
        if kind == "prefill":
            lens.append((draw(st.integers(1, 20)), 0))
        elif kind == "extend":
            lens.append((draw(st.integers(2, 12)), draw(st.integers(1, 30))))
        else:
            lens.append((1, draw(st.integers(1, 40))))
    pool = iter(draw(st.permutations(list(range(1, 400)))))
    seqs = []
    for i, (q, c) in enumerate(lens):
        pages = -(-(q + c) // page_size) + draw(st.integers(0, 2))  # tables may be longer
        table = np.array([next(pool) for _ in range(pages)], dtype=np.int32)
        tokens = np.arange(q + c + 1, dtype=np.int32) * 7 + i
        final = draw(st.booleans())
        seqs.append(_Seq(_Req(tokens), q, c, table, draw(st.integers(1, 50)), final))
    num_tokens = sum(q for q, _ in lens)
    padded = num_tokens + draw(st.integers(0, 6))
    widest = max([-(-(q + c) // page_size) for q, c in lens] + [1])
    width = draw(st.one_of(st.none(), st.integers(widest, widest + 3)))
    return seqs, page_size, padded, width


@settings(max_examples=80, deadline=None)
@given(steps())
def test_engine_and_kit_pack_identical_batches(step) -> None:
    seqs, page_size, padded, width = step
    ib = InputBatch(max_num_tokens=256, max_num_seqs=8, max_pages_per_seq=64, page_size=page_size)
    inputs = ib.prepare(seqs, padded_num_tokens=padded, block_table_width=width)
    kit = build_batch_metadata(
        [s.num_new_tokens for s in seqs],
        [s.num_cached_tokens for s in seqs],
        [s.page_ids for s in seqs],
        page_size,
        state_slots=[s.state_slot for s in seqs],
        padded_num_tokens=padded,
        block_table_width=width,
    )
    assert_same_batch(inputs.metadata, kit)


def test_packer_orders_decode_last_and_fills_model_inputs() -> None:
    # a one-token extend scheduled between two prefills counts as decode: it moves last
    q, c = [3, 1, 2], [0, 5, 0]
    shape = measure_batch(q, c, 4, padded_num_tokens=8)
    np.testing.assert_array_equal(shape.order, [0, 2, 1])
    assert (shape.num_prefill_seqs, shape.num_tokens, shape.total_pages) == (2, 6, 4)
    given_tables = [np.array([9], np.int32), np.array([4, 5], np.int32), np.array([7], np.int32)]
    tables = [given_tables[i] for i in shape.order]
    host = allocate_host(shape)
    input_ids = np.full(8, 99, np.int64)
    logits = np.full(3, 99, np.int64)
    rows = pack_batch(
        shape,
        tables,
        np.array([1, 3, 2], np.int32),
        host,
        token_ids=[np.array([10, 11, 12, 20, 21], np.int32), np.array([30], np.int64)],
        input_ids=input_ids,
        sample=np.array([True, False, True]),
        logits_indices=logits,
    )
    np.testing.assert_array_equal(input_ids, [10, 11, 12, 20, 21, 30, 0, 0])
    np.testing.assert_array_equal(rows, [0, 2])
    np.testing.assert_array_equal(logits[:2], [2, 5])  # last token of sequences 0 and 2
    np.testing.assert_array_equal(host.positions, [0, 1, 2, 0, 1, 5, 0, 0])
    np.testing.assert_array_equal(host.slot_mapping, [36, 37, 38, 28, 29, 21, -1, -1])
    with pytest.raises(ValueError, match="before decode"):
        build_batch_metadata(q, c, given_tables, 4)


def test_short_page_table_is_reported_with_the_sequence() -> None:
    shape = measure_batch([5], [0], 4)
    with pytest.raises(ValueError, match="sequence 0 needs 2 pages for 5 tokens"):
        pack_batch(shape, [np.array([3], np.int32)], np.ones(1, np.int32), allocate_host(shape))
