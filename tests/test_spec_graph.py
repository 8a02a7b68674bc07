"""Drafting steps replayed from graphs: the same drafts as running every step eagerly.

On a CPU the graphs are the capture module's eager stand-ins: a replay re-runs
the captured chain of steps on the persistent inputs, so the bucket padding,
the in-place metadata moves between steps and the capture's postprocess hook
are exercised exactly as on a GPU (tests/test_spec_graph_gpu.py captures real
graphs).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from model_run_helpers import torch_backends

from backplane.core.metadata import NULL_PAGE
from backplane.core.packing import build_batch_metadata
from backplane.engine.spec_decode.draft import DraftModelProposer
from backplane.engine.spec_decode.mtp import MTPProposer
from backplane.engine.spec_decode.proposer import ProposalContext, ProposalRequest
from backplane.engine.spec_decode.step_graphs import (
    ChainedDraftGraphs,
    advance_metadata,
    retreat_metadata,
)
from backplane.models.presets import VOCAB_SIZE, build_preset

FAMILIES = ("attention", "ssm", "mla", "delta")
PAGE = 4
MAX_LEN = 48


def _backends() -> dict[str, Any]:
    return torch_backends(FAMILIES)


def _draft(preset: str, k: int, graphs: bool) -> DraftModelProposer:
    backends = _backends()
    torch.manual_seed(0)
    draft = build_preset(preset, backends=backends).model
    return DraftModelProposer(
        draft,
        backends,
        num_speculative_tokens=k,
        target_vocab_size=VOCAB_SIZE,
        max_num_seqs=3,
        max_model_len=MAX_LEN,
        page_size=PAGE,
        cuda_graphs=graphs,
    )


def _mtp(preset: str, k: int, graphs: bool) -> tuple[MTPProposer, int]:
    backends = _backends()
    torch.manual_seed(0)
    target = build_preset(preset, backends=backends, mtp=True).model
    proposer = MTPProposer(
        target,
        backends,
        num_speculative_tokens=k,
        max_num_seqs=3,
        max_model_len=MAX_LEN,
        page_size=PAGE,
        cuda_graphs=graphs,
    )
    return proposer, target.hidden_size


def _req(rid: str, tokens: list[int], max_tokens: int) -> ProposalRequest:
    return ProposalRequest(
        request_id=rid,
        token_ids=np.asarray(tokens, dtype=np.int32),
        max_tokens=max_tokens,
        num_verified_tokens=len(tokens) - 1,
    )


def _drive(proposers: list[Any], k: int, hidden_size: int = 0) -> list[list[list[int]]]:
    """Run the proposers over the same requests for several steps, with acceptance and
    rejection, a request short of ``k`` (eager fallback) and a request joining late; return
    each proposer's drafts per step."""
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(3)
    seqs = {"a": rng.integers(0, 256, 6).tolist(), "b": rng.integers(0, 256, 3).tolist()}
    out: list[list[list[int]]] = [[] for _ in proposers]
    for step in range(6):
        if step == 2:
            seqs["c"] = rng.integers(0, 256, 9).tolist()
        ids = list(seqs)
        limits = {r: (1 if r == "b" and step == 3 else k) for r in ids}
        ctx = None
        if hidden_size:
            ctx = ProposalContext(hidden_states=torch.randn(len(ids), hidden_size, generator=gen))
        drafts = None
        for j, p in enumerate(proposers):
            got = p.propose([_req(r, seqs[r], limits[r]) for r in ids], ctx)
            out[j].append(got)
            drafts = got
        # "a" accepts everything, "b" its first draft, "c" nothing
        seqs["a"] = seqs["a"] + drafts[0] + [int(rng.integers(0, 256))]
        seqs["b"] = seqs["b"] + drafts[1][:1] + [(drafts[1][-1] + 1) % 256]
        if "c" in seqs:
            seqs["c"] = seqs["c"] + [(drafts[2][0] + 7) % 256]
    return out


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-nemotron-h"])
def test_draft_model_steps_from_graphs_equal_eager_token_for_token(preset):
    k = 4
    eager, graphed = _draft(preset, k, False), _draft(preset, k, True)
    assert graphed.graphs is not None and graphed.graphs.failed == {}
    assert graphed.graphs.has(1) and graphed.graphs.has(2)
    calls = []
    run = graphed.graphs.run
    graphed.graphs.run = lambda *a, **kw: calls.append(len(a[0])) or run(*a, **kw)
    want, got = _drive([eager, graphed], k)
    assert got == want
    # the graphs ran (batches of 2 and 3 padded to buckets 2 and 4), the short step eagerly
    assert 2 in calls and 3 in calls
    assert len(calls) == 5


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-deepseek-v3"])
def test_mtp_steps_from_graphs_equal_eager_token_for_token(preset, k):
    eager, hidden_size = _mtp(preset, k, False)
    graphed, _ = _mtp(preset, k, True)
    assert graphed.graphs is not None and graphed.graphs.failed == {}
    # every step is in the graph, the first one (fed the target's hidden state) included
    assert graphed.graphs.first_step == 0 and graphed.graphs.num_steps == k
    calls = []
    run = graphed.graphs.run
    graphed.graphs.run = lambda *a, **kw: calls.append(len(a[0])) or run(*a, **kw)
    want, got = _drive([eager, graphed], k, hidden_size)
    assert got == want
    # the first step of each sequence has no MTP entry to attend to (eager); every later
    # step replays unless a request drafts fewer than k
    assert len(calls) >= 3
    # the caches' bookkeeping agrees too (entries, their tokens and positions)
    for rid in ("a", "b", "c"):
        assert graphed.cache.get(rid).tokens == eager.cache.get(rid).tokens
        assert graphed._positions[rid] == eager._positions[rid]


def _full_scan_rollback(proposer: MTPProposer, request: ProposalRequest) -> Any:
    """The reference rollback: scan the whole cache, cut at the first entry whose token the
    sequence no longer holds or whose position step 0 is about to run at."""
    seq = proposer.cache.get(request.request_id)
    positions = proposer._positions.setdefault(request.request_id, [])
    last = len(request.token_ids) - 2
    keep = 0
    for pos, tok in zip(positions, seq.tokens, strict=True):
        if pos >= last or int(request.token_ids[pos + 1]) != tok:
            break
        keep += 1
    del seq.tokens[keep:], positions[keep:]
    seq.checked = 0
    return seq


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-deepseek-v3"])
def test_mtp_rollback_from_the_entries_checked_before_equals_a_full_scan(preset):
    k = 3
    incremental, hidden_size = _mtp(preset, k, False)
    full, _ = _mtp(preset, k, False)
    full._rolled_back = lambda request: _full_scan_rollback(full, request)
    want, got = _drive([full, incremental], k, hidden_size)
    assert got == want
    for rid in ("a", "b", "c"):
        assert incremental.cache.get(rid).tokens == full.cache.get(rid).tokens
        assert incremental._positions[rid] == full._positions[rid]
        # and it did skip: what it checked before is remembered
        assert incremental.cache.get(rid).checked > 0


def _decode_batch(cached: list[int], tables: list[np.ndarray], width: int) -> Any:
    return build_batch_metadata([1] * len(cached), cached, tables, PAGE, block_table_width=width)


def test_advancing_the_metadata_equals_packing_the_next_step():
    width = 5
    tables = [np.arange(1, 1 + width, dtype=np.int32), np.arange(11, 11 + width, dtype=np.int32)]
    cached = [3, 9]
    batch = _decode_batch(cached, tables, width)
    # the chained steps write into pages reserved ahead: the table lists them all
    batch.block_table.copy_(torch.from_numpy(np.stack(tables)))
    pos = torch.tensor([30, 40])
    advance_metadata(batch, pos, 2)
    # the step two tokens on, as the engine's packer lays it out
    want = _decode_batch([c + 2 for c in cached], tables, width)
    for name in ("positions", "cached_lens", "seq_lens", "slot_mapping", "last_page_lens"):
        assert torch.equal(getattr(batch, name), getattr(want, name)), name
    assert pos.tolist() == [32, 42]
    retreat_metadata(batch, pos, 2)
    again = _decode_batch(cached, tables, width)
    for name in ("positions", "cached_lens", "seq_lens", "slot_mapping", "last_page_lens"):
        assert torch.equal(getattr(batch, name), getattr(again, name)), name
    assert pos.tolist() == [30, 40]


def _graphs(num_steps: int) -> tuple[ChainedDraftGraphs, list[list[int]]]:
    """Chained graphs whose step records the cache length it ran at and writes it as a token."""
    seen: list[list[int]] = []

    def step(s: int, ids: torch.Tensor, pos: torch.Tensor, hidden: Any) -> tuple[None, Any]:
        from backplane.core.forward_context import get_forward_context

        batch = get_forward_context().batch
        seen.append(batch.seq_lens.tolist())
        logits = torch.nn.functional.one_hot(batch.seq_lens.long() % 50, 50).float()
        return None, logits

    graphs = ChainedDraftGraphs(
        step,
        {},
        num_steps=num_steps,
        max_num_seqs=2,
        max_model_len=16,
        page_size=PAGE,
        cuda=False,
    )
    return graphs, seen


def test_the_postprocess_hook_undoes_the_chained_steps_metadata_moves():
    n = 3
    graphs, seen = _graphs(n)
    graphs.capture()
    assert graphs.failed == {}
    batch = graphs._slots[2].batch
    # after the warm-ups and the capture the inputs are where they started
    scratch = graphs._scratch_batch(2)
    for name in ("positions", "cached_lens", "seq_lens", "slot_mapping"):
        assert torch.equal(getattr(batch, name), getattr(scratch, name)), name
    # each of the three runs of a bucket (two warm-ups, the capture) saw the same lengths
    first = int(scratch.seq_lens[0])
    assert [lens[0] for lens in seen[: 3 * n]] == list(range(first, first + n)) * 3
    # and replays draft from the lengths they are given
    table = np.full(graphs.width, NULL_PAGE, dtype=np.int32)
    rest = graphs.run([1, 2], [5, 6], [5, 8], [table, table], [0, 0])
    # chained step s (0..n-1) adds entry cached + s, so it runs at seq_len cached + s + 1
    assert rest == [[6, 7, 8], [9, 10, 11]]


def test_without_the_postprocess_hook_capture_starts_from_moved_inputs_and_fails():
    n = 3
    graphs, seen = _graphs(n)
    graphs.capture(postprocess=False)
    # the second warm-up starts where the first left off, past the block table
    assert set(graphs.failed) == {1, 2}
    assert "out of bounds" in graphs.failed[2]
    assert not graphs.has(2)
    first = int(graphs._scratch_batch(2).seq_lens[0])
    # the second warm-up's first step ran where the first warm-up's last one did
    assert [lens[0] for lens in seen[: n + 1]] == [*range(first, first + n), first + n - 1]


@pytest.mark.parametrize("graphs", [False, True])
def test_an_mtp_request_joining_a_running_batch_drafts_as_it_would_alone(graphs):
    k = 2
    running, hidden_size = _mtp("tiny-qwen3-next", k, graphs)
    alone, _ = _mtp("tiny-qwen3-next", k, graphs)
    gen = torch.Generator().manual_seed(4)
    first = running.propose(
        [_req("a", [1, 2, 3], k)],
        ProposalContext(hidden_states=torch.randn(1, hidden_size, generator=gen)),
    )
    rows = torch.randn(2, hidden_size, generator=gen)
    # "b" has no MTP entry yet while "a" has some: it must still be drafted for
    both = running.propose(
        [_req("a", [1, 2, 3, *first[0], 5], k), _req("b", [4, 5, 6], k)],
        ProposalContext(hidden_states=rows),
    )
    want = alone.propose([_req("b", [4, 5, 6], k)], ProposalContext(hidden_states=rows[1:]))
    assert both[1] == want[0]


def _capture_on_cpu(proposer: Any, max_num_seqs: int, max_model_len: int) -> ChainedDraftGraphs:
    """Give an engine's proposer the graphs a CUDA worker would (eager stand-ins here)."""
    mtp = isinstance(proposer, MTPProposer)
    graphs = ChainedDraftGraphs(
        proposer._graph_step,
        proposer.backends,
        num_steps=proposer.num_speculative_tokens,
        first_step=0,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        page_size=proposer.cache.page_size,
        hidden_size=proposer.mtp.target.hidden_size if mtp else 0,
        cuda=False,
    )
    graphs.capture()
    assert graphs.failed == {}
    proposer.graphs = graphs
    return graphs


ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_tokens=64, page_size=4)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    ("model", "spec"),
    [
        ("tiny-llama", {"method": "draft_model", "model": "tiny-llama"}),
        ("tiny-nemotron-h", {"method": "draft_model", "model": "tiny-nemotron-h"}),
        ("tiny-nemotron-h", {"method": "draft_model", "model": "tiny-llama"}),
        ("tiny-deepseek-v3", {"method": "mtp"}),
    ],
)
def test_engine_tokens_with_graphed_drafting_equal_decoding_without_speculation(model, spec):
    from engine_helpers import run_requests

    from backplane.engine.engine import Engine
    from backplane.engine.sampling import SamplingParams

    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, size=n).tolist() for n in (9, 3, 14)]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=9, temperature=0.0),
        SamplingParams(max_tokens=10, temperature=0.8, seed=5),
    ]
    want = run_requests(Engine(model=model, **ENGINE), prompts, params)
    engine = Engine(model=model, speculative_config={**spec, "num_speculative_tokens": 3}, **ENGINE)
    graphs = _capture_on_cpu(engine.spec.proposer, 4, engine.max_model_len)
    replays = []
    run = graphs.run
    graphs.run = lambda *a, **kw: replays.append(len(a[0])) or run(*a, **kw)
    assert run_requests(engine, prompts, params) == want
    assert replays and engine.spec.stats.draft_tokens > 0


class _PlanningBackend:
    """A backend that prepares host-side work for every step, decode graphs included."""

    def plan(self, batch: Any) -> dict[str, int]:
        return {"longest": int(batch.host.seq_lens.max())}

    def prepare_capture(self, mode: Any, batch: Any) -> None:
        raise AssertionError("nothing is captured over a backend that plans per step")


def test_a_backend_that_plans_every_step_leaves_the_draft_steps_eager():
    graphs, seen = _graphs(2)
    graphs.backends = {"attention": _PlanningBackend()}
    graphs.capture()
    assert graphs.planned_families() == ["attention"]
    assert "attention" in graphs.unsupported
    assert graphs.failed == {} and not any(graphs.has(b) for b in graphs.buckets)
    assert not seen
    table = np.full(graphs.width, NULL_PAGE, dtype=np.int32)
    assert graphs.run([1], [5], [4], [table], [0]) is None
