"""The kit's standard batches cover every layout rule they promise to."""

from __future__ import annotations

import pytest

from backplane.testing.batches import KINDS, batch_cases, make_case


def test_names_are_unique_and_metadata_builds() -> None:
    cases = batch_cases()
    assert len({c.name for c in cases}) == len(cases)
    for case in cases:
        meta = case.metadata("cpu")
        assert meta.num_tokens == case.num_tokens
        assert meta.padded_num_tokens == case.padded_num_tokens
        assert meta.num_decode_seqs == case.num_decode_seqs


def test_reserved_page_and_slot_are_never_used() -> None:
    for case in batch_cases():
        pages = [p for table in case.page_tables for p in table]
        assert 0 not in pages and max(pages) < case.num_pages
        assert len(set(pages)) == len(pages), "two sequences share a page"
        assert 0 not in case.state_slots and max(case.state_slots) < case.num_slots
        assert len(set(case.state_slots)) == len(case.state_slots)


def test_the_promised_situations_are_covered() -> None:
    cases = batch_cases()

    def any_case(pred) -> bool:
        return any(pred(c) for c in cases)

    assert any_case(lambda c: c.num_decode_seqs == 0 and not any(c.cached_lens)), "pure prefill"
    assert any_case(lambda c: c.num_decode_seqs == c.num_seqs), "pure decode"
    # prefill (no cache) + extend (cache, >1 token) + decode in one batch
    assert any_case(
        lambda c: (
            any(cl == 0 for cl in c.cached_lens)
            and any(q > 1 and cl > 0 for q, cl in zip(c.query_lens, c.cached_lens, strict=True))
            and c.num_decode_seqs > 0
        )
    ), "mixed"
    assert any_case(
        lambda c: any(q > 1 and cl > 0 for q, cl in zip(c.query_lens, c.cached_lens, strict=True))
    ), "chunked prefill continuing from cache"
    # new tokens of one sequence that straddle a page boundary
    assert any_case(
        lambda c: any(
            cl // c.page_size != (cl + q - 1) // c.page_size
            for q, cl in zip(c.query_lens, c.cached_lens, strict=True)
        )
    ), "page crossing"
    assert any_case(
        lambda c: (
            any(list(t) != sorted(t) for t in c.page_tables)
            or [t[0] for t in c.page_tables] != sorted(t[0] for t in c.page_tables)
        )
    ), "non-contiguous page tables"
    assert any_case(lambda c: list(c.state_slots) != sorted(c.state_slots)), "slots out of order"
    assert any_case(lambda c: c.padded_num_tokens > c.num_tokens), "padding"
    assert any_case(
        lambda c: c.padded_num_tokens > c.num_tokens and c.num_decode_seqs == c.num_seqs
    )


@pytest.mark.parametrize("kind", KINDS)
def test_kinds_filter(kind: str) -> None:
    cases = batch_cases(kind)
    assert cases
    for case in cases:
        if kind == "prefill":
            assert not any(case.cached_lens)
        if kind == "decode":
            assert case.num_decode_seqs == case.num_seqs


def test_unknown_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown batch kind"):
        batch_cases("prefil")


def test_page_size_override_and_seed() -> None:
    for case in batch_cases(page_size=16):
        assert case.page_size == 16
        case.metadata("cpu")
    assert batch_cases(seed=1) != batch_cases(seed=2)
    assert batch_cases(seed=3) == batch_cases(seed=3)


def test_make_case_allocates_enough_pages() -> None:
    case = make_case("x", [5, 1], [7, 30], page_size=4, shuffle_pages=True, padding=2)
    assert [len(t) for t in case.page_tables] == [3, 8]
    assert case.padded_num_tokens == 8


def test_table_width_pads_with_the_null_page() -> None:
    case = batch_cases("decode")[0]
    narrow = case.metadata("cpu")
    wide = case.metadata("cpu", table_width=narrow.host.block_table.shape[1] + 2)
    assert wide.block_table.shape[1] == narrow.block_table.shape[1] + 2
    assert (wide.host.block_table[:, -2:] == 0).all()
    assert (wide.host.block_table[:, :-2] == narrow.host.block_table).all()
    assert (wide.slot_mapping == narrow.slot_mapping).all()
    with pytest.raises(ValueError, match="table_width"):
        case.metadata("cpu", table_width=1)
