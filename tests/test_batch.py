"""Input preparation agrees with build_batch_metadata and with the requests' tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import numpy as np
import pytest
import torch

from backplane.core.metadata import HostBatch
from backplane.core.packing import build_batch_metadata
from backplane.engine.worker.inputs import InputBatch


@dataclass
class FakeRequest:
    token_buffer: np.ndarray


@dataclass
class Seq:
    request: FakeRequest
    num_new_tokens: int
    num_cached_tokens: int
    page_ids: np.ndarray
    state_slot: int
    is_prefill_chunk_final: bool


PAGE = 4


def random_batch(rng: np.random.Generator, *, n_prefill: int, n_decode: int, extra_pages: bool):
    """Random scheduled sequences with distinct shuffled pages, prefill first."""
    seqs = []
    next_page = iter(rng.permutation(np.arange(1, 5000)))
    for i in range(n_prefill + n_decode):
        if i < n_prefill:
            cached = int(rng.choice([0, 0, rng.integers(1, 30)]))
            new = int(rng.integers(1, 20)) if cached == 0 else int(rng.integers(2, 20))
        else:
            cached, new = int(rng.integers(1, 60)), 1
        total = cached + new
        pages = -(-total // PAGE) + (int(rng.integers(0, 3)) if extra_pages else 0)
        table = np.array([next(next_page) for _ in range(pages)], dtype=np.int32)
        tokens = rng.integers(0, 1000, size=total + 5).astype(np.int32)
        final = bool(rng.integers(0, 2)) if i < n_prefill else True
        seqs.append(Seq(FakeRequest(tokens), new, cached, table, int(rng.integers(1, 200)), final))
    return seqs


def check_against_reference(ib: InputBatch, seqs, padded=None):
    inputs = ib.prepare(seqs, padded_num_tokens=padded)
    ref = build_batch_metadata(
        [s.num_new_tokens for s in seqs],
        [s.num_cached_tokens for s in seqs],
        [s.page_ids for s in seqs],
        PAGE,
        state_slots=[s.state_slot for s in seqs],
        padded_num_tokens=padded,
    )
    md = inputs.metadata
    for name in (
        "num_prefill_seqs",
        "num_prefill_tokens",
        "num_decode_seqs",
        "num_decode_tokens",
        "padded_num_tokens",
        "page_size",
        "max_query_len",
        "max_seq_len",
    ):
        assert getattr(md, name) == getattr(ref, name), name
    for f in fields(HostBatch):
        got_h, want = getattr(md.host, f.name), getattr(ref.host, f.name)
        assert got_h.dtype == want.dtype, f.name
        np.testing.assert_array_equal(got_h, want, err_msg=f.name)
        got_d = getattr(md, f.name)
        assert got_d.dtype == getattr(ref, f.name).dtype, f.name
        np.testing.assert_array_equal(got_d.cpu().numpy(), want, err_msg=f"device {f.name}")
    # input ids: each sequence's tokens at its new positions, zeros in padding
    expect_ids = np.concatenate(
        [
            s.request.token_buffer[s.num_cached_tokens : s.num_cached_tokens + s.num_new_tokens]
            for s in seqs
        ]
        + [np.zeros(md.padded_num_tokens - md.num_tokens, np.int32)]
    )
    np.testing.assert_array_equal(inputs.input_ids.cpu().numpy(), expect_ids)
    assert inputs.positions.data_ptr() == md.positions.data_ptr()
    rows = [i for i, s in enumerate(seqs) if s.is_prefill_chunk_final]
    np.testing.assert_array_equal(inputs.sample_seqs, rows)
    np.testing.assert_array_equal(
        inputs.logits_indices.cpu().numpy(), ref.host.last_token_indices[rows]
    )
    return inputs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "shape",
    [(0, 5), (4, 0), (3, 6), (1, 1), (0, 1)],
    ids=["decode", "prefill", "mixed", "one_each", "single"],
)
def test_agrees_with_build_batch_metadata(seed, shape):
    rng = np.random.default_rng(seed)
    ib = InputBatch(max_num_tokens=512, max_num_seqs=16, max_pages_per_seq=32, page_size=PAGE)
    seqs = random_batch(rng, n_prefill=shape[0], n_decode=shape[1], extra_pages=bool(seed % 2))
    check_against_reference(ib, seqs)
    # the same buffers serve the next step (with padding) without stale values
    seqs2 = random_batch(rng, n_prefill=shape[1], n_decode=shape[0], extra_pages=True)
    if seqs2:
        n_tok = sum(s.num_new_tokens for s in seqs2)
        check_against_reference(ib, seqs2, padded=n_tok + int(rng.integers(0, 9)))


def test_decode_like_sequences_are_moved_last():
    rng = np.random.default_rng(7)
    seqs = random_batch(rng, n_prefill=3, n_decode=2, extra_pages=False)
    # a one-token extend (cached context, one new token) scheduled among prefills
    seqs[1] = Seq(seqs[1].request, 1, 5, seqs[1].page_ids, 9, True)
    ib = InputBatch(max_num_tokens=256, max_num_seqs=8, max_pages_per_seq=32, page_size=PAGE)
    inputs = ib.prepare(seqs)
    order = [0, 2, 1, 3, 4]
    check_against_reference(
        InputBatch(max_num_tokens=256, max_num_seqs=8, max_pages_per_seq=32, page_size=PAGE),
        [seqs[i] for i in order],
    )
    final = [i for i in order if seqs[i].is_prefill_chunk_final]
    np.testing.assert_array_equal(inputs.sample_seqs, final)
    assert inputs.metadata.num_decode_seqs == 3


def test_limits_and_bad_tables_raise():
    rng = np.random.default_rng(3)
    ib = InputBatch(max_num_tokens=16, max_num_seqs=2, max_pages_per_seq=4, page_size=PAGE)
    seqs = random_batch(rng, n_prefill=3, n_decode=0, extra_pages=False)
    with pytest.raises(ValueError, match="max_num_seqs"):
        ib.prepare(seqs)
    big = Seq(FakeRequest(np.zeros(40, np.int32)), 17, 0, np.arange(1, 6, dtype=np.int32), 1, True)
    with pytest.raises(ValueError, match="max_num_tokens"):
        ib.prepare([big])
    short = Seq(FakeRequest(np.zeros(40, np.int32)), 9, 0, np.arange(1, 2, dtype=np.int32), 1, True)
    with pytest.raises(ValueError, match="pages"):
        ib.prepare([short])
    with pytest.raises(ValueError, match="padded_num_tokens"):
        ib.prepare(
            random_batch(rng, n_prefill=0, n_decode=2, extra_pages=False), padded_num_tokens=1
        )


def test_fixed_block_table_width():
    rng = np.random.default_rng(11)
    seqs = random_batch(rng, n_prefill=2, n_decode=2, extra_pages=False)
    ib = InputBatch(max_num_tokens=256, max_num_seqs=8, max_pages_per_seq=32, page_size=PAGE)
    md = ib.prepare(seqs, block_table_width=32).metadata
    ref = build_batch_metadata(
        [s.num_new_tokens for s in seqs],
        [s.num_cached_tokens for s in seqs],
        [s.page_ids for s in seqs],
        PAGE,
        state_slots=[s.state_slot for s in seqs],
    )
    w = ref.host.block_table.shape[1]
    assert md.block_table.shape == (4, 32)
    np.testing.assert_array_equal(md.host.block_table[:, :w], ref.host.block_table)
    assert (md.host.block_table[:, w:] == 0).all()
    np.testing.assert_array_equal(md.host.slot_mapping, ref.host.slot_mapping)


@pytest.mark.gpu
def test_cuda_one_copy_agrees():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = np.random.default_rng(5)
    ib = InputBatch(
        max_num_tokens=512, max_num_seqs=16, max_pages_per_seq=32, page_size=PAGE, device="cuda"
    )
    for _ in range(3):
        inputs = check_against_reference(
            ib, random_batch(rng, n_prefill=3, n_decode=5, extra_pages=True)
        )
        assert inputs.input_ids.is_cuda and inputs.metadata.block_table.is_cuda


def test_bench_cpu_command_reports_every_size(capsys):
    from backplane.cli import main

    assert main(["bench", "cpu", "--quick", "--json", "--steps", "3"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in res["decode_step"]] == [1, 64]
    for r in res["decode_step"]:
        assert r["prepare_us"] > 0 and r["schedule_us"] > 0
        assert r["total_us"] == pytest.approx(r["schedule_us"] + r["prepare_us"] + r["update_us"])
    rc = res["request_construction"]
    assert [r["prompt_tokens"] for r in rc] == [128, 1024]
    assert res["machine"]["cores"] >= 1


def test_device_addresses_depend_only_on_the_step_shape():
    """A CUDA graph captured for (num_seqs, padded tokens, table width) reads later steps' data."""
    rng = np.random.default_rng(21)
    ib = InputBatch(max_num_tokens=64, max_num_seqs=8, max_pages_per_seq=32, page_size=PAGE)

    def addresses(seqs):
        inputs = ib.prepare(seqs, padded_num_tokens=8, block_table_width=32)
        md = inputs.metadata
        ptrs = {f.name: getattr(md, f.name).data_ptr() for f in fields(HostBatch)}
        ptrs["input_ids"] = inputs.input_ids.data_ptr()
        ptrs["logits_indices"] = inputs.logits_indices.data_ptr()
        return ptrs, inputs

    first, _ = addresses(random_batch(rng, n_prefill=0, n_decode=6, extra_pages=False))
    for _ in range(3):
        seqs = random_batch(rng, n_prefill=0, n_decode=6, extra_pages=True)
        for s in seqs[::2]:
            s.is_prefill_chunk_final = False  # fewer sampled rows
        ptrs, inputs = addresses(seqs)
        assert ptrs == first
        assert len(inputs.sample_seqs) == 3
