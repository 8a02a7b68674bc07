"""build_batch_metadata against a naive per-sequence, per-token construction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backplane.core.metadata import (
    NULL_PAGE,
    BatchMetadata,
    HostBatch,
    StepMode,
)
from backplane.core.packing import build_batch_metadata
from backplane.testing.batches import batch_cases


def naive_metadata(query_lens, cached_lens, page_tables, page_size, state_slots, padded):
    """Every HostBatch field built with plain Python loops, one sequence and token at a time."""
    n = len(query_lens)
    qsl, page_indptr, page_indices, last_page_lens = [0], [0], [], []
    positions, slot_mapping, token_seq_ids, last_token_indices = [], [], [], []
    seq_lens, pages_per_seq = [], []
    for i in range(n):
        total = cached_lens[i] + query_lens[i]
        seq_lens.append(total)
        pages = (total + page_size - 1) // page_size
        pages_per_seq.append(list(page_tables[i][:pages]))
        page_indices.extend(page_tables[i][:pages])
        page_indptr.append(page_indptr[-1] + pages)
        last_page_lens.append(total - (pages - 1) * page_size)
        for j in range(query_lens[i]):
            pos = cached_lens[i] + j
            positions.append(pos)
            slot_mapping.append(page_tables[i][pos // page_size] * page_size + pos % page_size)
            token_seq_ids.append(i)
        qsl.append(qsl[-1] + query_lens[i])
        last_token_indices.append(qsl[-1] - 1)
    width = max([len(p) for p in pages_per_seq] + [1])
    block_table = [p + [NULL_PAGE] * (width - len(p)) for p in pages_per_seq]
    pad = padded - len(positions)
    return {
        "query_start_loc": qsl,
        "query_lens": list(query_lens),
        "cached_lens": list(cached_lens),
        "seq_lens": seq_lens,
        "page_indptr": page_indptr,
        "page_indices": page_indices,
        "last_page_lens": last_page_lens,
        "block_table": block_table if n else np.zeros((0, 1)),
        "state_slots": list(state_slots),
        "has_initial_state": [c > 0 for c in cached_lens],
        "positions": positions + [0] * pad,
        "slot_mapping": slot_mapping + [-1] * pad,
        "token_seq_ids": token_seq_ids + [-1] * pad,
        "last_token_indices": last_token_indices,
    }


def check_against_naive(
    meta: BatchMetadata, query_lens, cached_lens, tables, page_size, slots, padded
):
    expected = naive_metadata(query_lens, cached_lens, tables, page_size, slots, padded)
    for name, want in expected.items():
        got = getattr(meta.host, name)
        np.testing.assert_array_equal(got, np.asarray(want).reshape(got.shape), err_msg=name)
        dev = getattr(meta, name)
        assert isinstance(dev, torch.Tensor), name
        np.testing.assert_array_equal(dev.cpu().numpy(), got, err_msg=f"device copy of {name}")
    num_decode = sum(1 for q, c in zip(query_lens, cached_lens, strict=True) if q == 1 and c > 0)
    assert meta.num_decode_seqs == num_decode
    assert meta.num_prefill_seqs == len(query_lens) - num_decode
    assert meta.num_tokens == sum(query_lens)
    assert meta.num_decode_tokens == num_decode
    assert meta.num_prefill_tokens == sum(query_lens) - num_decode
    assert meta.padded_num_tokens == padded
    assert meta.max_query_len == (max(query_lens) if query_lens else 0)
    assert meta.max_seq_len == (max(expected["seq_lens"]) if query_lens else 0)
    assert meta.is_decode_only == (num_decode == len(query_lens) > 0)


@pytest.mark.parametrize("case", batch_cases(), ids=lambda c: c.name)
def test_kit_cases_match_naive(case) -> None:
    meta = case.metadata("cpu")
    check_against_naive(
        meta,
        case.query_lens,
        case.cached_lens,
        case.page_tables,
        case.page_size,
        case.state_slots,
        case.padded_num_tokens,
    )


@st.composite
def ragged_batches(draw):
    page_size = draw(st.sampled_from([1, 2, 3, 4, 16]))
    num_prefill = draw(st.integers(0, 4))
    num_decode = draw(st.integers(0, 4))
    query_lens = [draw(st.integers(1, 9)) for _ in range(num_prefill)] + [1] * num_decode
    cached_lens = [draw(st.integers(0, 12)) for _ in range(num_prefill)]
    # A prefill of one token on top of cache would count as decode; keep prefill distinct.
    cached_lens = [0 if q == 1 else c for q, c in zip(query_lens, cached_lens, strict=False)]
    cached_lens += [draw(st.integers(1, 20)) for _ in range(num_decode)]
    need = [-(-(q + c) // page_size) for q, c in zip(query_lens, cached_lens, strict=True)]
    pool = draw(st.permutations(list(range(1, sum(need) + 2 * len(need) + 2))))
    tables, start = [], 0
    for k in need:
        extra = draw(st.integers(0, 2))  # tables may be longer than needed
        tables.append(list(pool[start : start + k + extra]))
        start += k + extra
    slots = draw(st.permutations(list(range(1, len(query_lens) + 3))))[: len(query_lens)]
    padding = draw(st.integers(0, 5))
    return query_lens, cached_lens, tables, page_size, list(slots), sum(query_lens) + padding


@settings(max_examples=60, deadline=None)
@given(ragged_batches())
def test_random_batches_match_naive(batch) -> None:
    query_lens, cached_lens, tables, page_size, slots, padded = batch
    meta = build_batch_metadata(
        query_lens, cached_lens, tables, page_size, state_slots=slots, padded_num_tokens=padded
    )
    check_against_naive(meta, query_lens, cached_lens, tables, page_size, slots, padded)


def test_default_state_slots_skip_the_reserved_slot() -> None:
    meta = build_batch_metadata([2, 1], [0, 3], [[1], [2]], 4)
    np.testing.assert_array_equal(meta.host.state_slots, [1, 2])


def test_empty_batch() -> None:
    meta = build_batch_metadata([], [], [], 4, padded_num_tokens=3)
    assert meta.num_seqs == 0 and meta.num_tokens == 0 and meta.padded_num_tokens == 3
    np.testing.assert_array_equal(meta.host.slot_mapping, [-1, -1, -1])
    assert isinstance(meta.host, HostBatch)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (([1, 3], [4, 0], [[1, 2], [3]], 4), {}, "before decode"),
        (([3], [6], [[1, 2]], 4), {}, "needs 3 pages"),
        (([0], [0], [[1]], 4), {}, "at least one new token"),
        (([3], [0], [[1]], 4), {"padded_num_tokens": 2}, "padded_num_tokens"),
        (([3, 1], [0], [[1]], 4), {}, "one entry per sequence"),
    ],
)
def test_inconsistent_input_is_rejected(args, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        build_batch_metadata(*args, **kwargs)


def test_positions_and_slots_of_padding_never_write() -> None:
    meta = build_batch_metadata([3, 1], [0, 5], [[4], [2, 7]], 4, padded_num_tokens=8)
    assert (meta.host.slot_mapping[4:] == -1).all()
    assert (meta.host.token_seq_ids[4:] == -1).all()


def test_step_mode_must_fit_the_batch() -> None:
    decode = build_batch_metadata([1, 1], [3, 5], [[1], [2, 3]], 4, mode=StepMode.decode_graph(2))
    assert decode.mode.is_decode_graph and decode.mode.bucket == 2
    # fewer sequences than the bucket: the rest of the bucket must be padding tokens
    padded = build_batch_metadata(
        [1, 1], [3, 5], [[1], [2, 3]], 4, padded_num_tokens=4, mode=StepMode.decode_graph(4)
    )
    assert padded.mode == StepMode.decode_graph(4)
    with pytest.raises(ValueError, match="decode graph of bucket 4"):
        build_batch_metadata([1, 1], [3, 5], [[1], [2, 3]], 4, mode=StepMode.decode_graph(4))
    with pytest.raises(ValueError, match="decode graph of bucket 3"):
        build_batch_metadata([2, 1], [0, 5], [[1], [2, 3]], 4, mode=StepMode.decode_graph(3))
    with pytest.raises(ValueError, match="piecewise bucket 8"):
        build_batch_metadata([3], [0], [[1]], 4, padded_num_tokens=6, mode=StepMode.piecewise(8))
    assert build_batch_metadata([3], [0], [[1]], 4).mode == StepMode()
