"""Verify graphs: a step of short chunks on cached context, one decode row per position.

A speculative step verifies ``d + 1`` positions of each sequence. For a model
without recurrent state the graph runner spreads them into one decode row per
position and replays a captured decode graph; each row attends up to its own
position, so the hidden states, the cache writes and the logits must equal the
eager forward of the chunks. On CPU the graphs are eager stand-ins (the
dispatch, padding and row bookkeeping are the real thing); the ``gpu`` cases
replay real CUDA graphs over the torch and Triton backends.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from graph_helpers import graph_runner_for
from test_graph_runner import PAGE, _Req, _Seq, fill_caches_, restore_, snapshot

from backplane.core.forward_context import forward_context, plan_step
from backplane.engine.engine import Engine
from backplane.engine.worker.graph.buckets import verify_rows
from backplane.engine.worker.graph.mode import GraphMode
from backplane.engine.worker.inputs import position_rows

VERIFY_LEN = 4
MAX_SEQS = 4


def _case(device: str, model: str, attention: str) -> pytest.param:
    marks = [pytest.mark.gpu] if device == "cuda" else []
    return pytest.param((device, model, attention), id=f"{device}-{model}-{attention}", marks=marks)


# FlashInfer is not among them: it takes none of the tiny presets' head sizes (its
# attention needs head_dim 64/128/256, its MLA DeepSeek-V3's own latent sizes).
CASES = [_case("cpu", m, "torch") for m in ("tiny-llama", "tiny-deepseek-v3")] + [
    _case("cuda", m, a) for m in ("tiny-llama", "tiny-deepseek-v3") for a in ("torch", "triton")
]


@pytest.fixture(scope="module", params=CASES)
def setup(request):
    device, model, attention = request.param
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; torch.cuda.is_available() is False")
    if attention == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    rows = verify_rows(MAX_SEQS, 64, VERIFY_LEN)
    engine = Engine(
        model=model,
        device=device,
        dtype="float32",
        max_num_seqs=rows,  # the input batch holds one sequence per row
        max_num_tokens=64,
        max_model_len=64,
        page_size=PAGE,
        num_kv_pages=160,
        cuda_graphs="off",
        backends={"attention": attention, "mla": attention},
    )
    runner = graph_runner_for(
        engine,
        mode=GraphMode.FULL_AND_PIECEWISE,
        max_num_tokens=64,
        max_num_seqs=MAX_SEQS,
        token_bucket_sizes=[16, 32],
        verify_len=VERIFY_LEN,
    )
    runner.capture()
    assert runner.verify.failed == {}
    assert sorted(runner.verify.graphs) == [1, 2, 4, 8, 16]
    yield engine, runner
    runner.release()
    engine.shutdown()


def _chunks(engine: Engine, new: list[int], cached: list[int], seed: int, final=None):
    """Sequences adding ``new[i]`` tokens to ``cached[i]`` cached ones, on distinct pages."""
    rng = np.random.default_rng(seed)
    free = rng.permutation(np.arange(1, engine.num_pages))  # page 0 is scratch
    seqs, used = [], 0
    for i, (q, c) in enumerate(zip(new, cached, strict=True)):
        need = -(-(q + c) // engine.page_size)
        pages = free[used : used + need].astype(np.int32)
        used += need
        tokens = rng.integers(0, engine.vocab_size, size=q + c + 1).astype(np.int32)
        last = True if final is None else final[i]
        seqs.append(_Seq(_Req(tokens), q, c, pages, state_slot=i + 1, is_prefill_chunk_final=last))
    return seqs


def _run(engine, runner, seqs):
    inputs = runner.prepare_inputs(seqs)
    with forward_context(inputs.metadata, plan_step(engine.backends, inputs.metadata)):
        hidden = runner.run(inputs)
    n = sum(s.num_new_tokens for s in seqs)
    return inputs, hidden[:n].clone()


def _eager(engine, seqs):
    inputs = engine.input_batch.prepare(seqs)
    with forward_context(inputs.metadata, plan_step(engine.backends, inputs.metadata)):
        hidden = engine.model(inputs.input_ids, inputs.positions)[: inputs.num_tokens].clone()
    return inputs, hidden


def _tol(engine):
    return 1e-5 if engine.device.type == "cpu" else 2e-4


@pytest.mark.parametrize(
    ("new", "cached"),
    [
        ([4, 1, 3, 2], [5, 9, 13, 2]),
        ([4], [30]),
        ([2, 2], [1, 15]),
        ([3, 4, 4, 4], [4, 7, 1, 20]),
        ([2, 3, 1, 1], [12, 3, 8, 40]),
    ],
)
def test_chunks_replay_as_position_rows_equal_to_the_eager_forward(setup, new, cached):
    engine, runner = setup
    seqs = _chunks(engine, new, cached, seed=sum(new) + len(cached))
    fill_caches_(engine, seed=3)
    before = snapshot(engine)
    inputs, got = _run(engine, runner, seqs)
    after = snapshot(engine)
    assert inputs.mode.is_decode_graph and inputs.mode.rows_share_pages
    assert inputs.mode.bucket == min(b for b in runner.verify.graphs if b >= sum(new))
    # the step's inputs are valid until the next step is prepared: read them now
    idx = np.arange(len(seqs))
    starts = np.concatenate([[0], np.cumsum(new)[:-1]])
    assert inputs.first_token_rows(idx).tolist() == starts.tolist()
    # each sampled row is its sequence's last position
    assert inputs.sample_seqs.tolist() == list(range(len(seqs)))
    assert inputs.logits_indices.tolist() == (starts + np.asarray(new) - 1).tolist()
    graph_logits = inputs.logits.clone()
    restore_(engine, before)
    eager, want = _eager(engine, seqs)
    tol = _tol(engine)
    # row by row of each sequence (the eager step packs extends before decodes)
    mine = np.concatenate([np.arange(q) + f for q, f in zip(new, starts, strict=True)])
    theirs = np.concatenate(
        [np.arange(q) + f for q, f in zip(new, eager.first_token_rows(idx), strict=True)]
    )
    torch.testing.assert_close(got[mine], want[theirs], rtol=tol, atol=tol)
    for key, t in snapshot(engine).items():
        # every row's key and value written as the eager step writes them; padding rows
        # touch only the scratch page
        torch.testing.assert_close(after[key][1:], t[1:], rtol=tol, atol=tol)
    # the graph projected every row: the verification reads its logits
    logits = engine.model.compute_logits(want[theirs])
    torch.testing.assert_close(graph_logits[mine], logits, rtol=tol * 10, atol=tol * 10)


def test_a_chunk_that_ends_short_of_its_prompt_samples_nothing(setup):
    engine, runner = setup
    seqs = _chunks(engine, [3, 2, 4], [6, 3, 8], seed=7, final=[True, False, True])
    inputs, _ = _run(engine, runner, seqs)
    assert inputs.mode.rows_share_pages
    assert inputs.sample_seqs.tolist() == [0, 2]
    assert inputs.logits_indices.tolist() == [2, 8]


@pytest.mark.parametrize(
    ("new", "cached", "why"),
    [
        ([5, 1], [4, 4], "a chunk longer than verify_len"),
        ([3, 2], [0, 4], "a prompt without cached context"),
        ([4, 4, 4, 4, 4], [4, 4, 4, 4, 4], "more rows than the largest verify bucket"),
        ([1, 1, 1], [3, 5, 7], "a decode-only step"),
    ],
)
def test_other_steps_do_not_run_as_rows(setup, new, cached, why):
    engine, runner = setup
    seqs = _chunks(engine, new, cached, seed=11)
    inputs = runner.prepare_inputs(seqs)
    assert not inputs.mode.rows_share_pages, why
    assert inputs.seq_rows is None


def test_position_rows_spread_each_chunk_over_its_positions():
    seqs = [
        _Seq(_Req(np.arange(9, dtype=np.int32)), 3, 5, np.array([4, 7], np.int32), 2, True),
        _Seq(_Req(np.arange(4, dtype=np.int32)), 1, 3, np.array([9], np.int32), 3, False),
    ]
    rows, starts = position_rows(seqs)
    assert starts.tolist() == [0, 3]
    assert [(r.num_new_tokens, r.num_cached_tokens) for r in rows] == [
        (1, 5),
        (1, 6),
        (1, 7),
        (1, 3),
    ]
    assert [r.is_prefill_chunk_final for r in rows] == [False, False, True, False]
    assert all(r.page_ids is seqs[0].page_ids for r in rows[:3]) and rows[3].state_slot == 3


def test_verify_rows_are_bounded_by_the_budget_and_off_without_speculation():
    assert verify_rows(4, 64, 0) == 0 and verify_rows(4, 64, 1) == 0
    assert verify_rows(4, 64, 4) == 16
    assert verify_rows(256, 8192, 5) == 256
    assert verify_rows(16, 40, 8) == 40
    assert verify_rows(512, 8192, 3) == 512


@dataclass
class _PendingReq:
    """A request whose last token is still on the device (asynchronous scheduling)."""

    token_buffer: np.ndarray
    pending_source_row: int


def test_rows_beside_tokens_in_flight_read_those_tokens_on_the_device(setup):
    # A short chunk on cached context (a prompt's last chunk) beside decodes whose tokens
    # the step in flight sampled: the decode rows take those tokens from the device, the
    # chunk's rows their own tokens from the host.
    engine, runner = setup
    seqs = _chunks(engine, [3, 1, 1], [6, 9, 4], seed=21)
    in_flight = torch.tensor([11, 17, 23, 29], dtype=torch.int64, device=engine.device)
    for s, row in zip(seqs, (-1, 2, 0), strict=True):
        s.request = _PendingReq(s.request.token_buffer, row)
    ib = engine.input_batch
    ib.pending_source = in_flight
    try:
        inputs = runner.prepare_inputs(seqs)
    finally:
        ib.pending_source = None
    assert inputs.mode.rows_share_pages
    ids = inputs.input_ids[:5].tolist()
    assert ids[:3] == seqs[0].request.token_buffer[6:9].tolist()
    assert ids[3:] == [23, 11]
