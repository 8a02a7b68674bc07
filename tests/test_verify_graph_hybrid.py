"""Verify graphs of hybrid models: chunk positions as decode rows whose recurrent states chain.

A speculative step of Nemotron-H (Mamba2) or Qwen3-Next (gated delta rule)
replays a verify graph: each chunk position is one decode row, and the
recurrent layers run row ``i`` of a chunk on the state row ``i - 1`` left in a
scratch slot. The hidden states, the logits, the state after every position
(the verification keeps the one at the last accepted token) and the final
states must equal the eager forward of the chunks, which records its
per-position states on its own path. On CPU the graphs are eager stand-ins
(the padding, the row chains and their packing are the real thing);
``tests/test_verify_graph_hybrid_gpu.py`` replays real CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import run_requests
from graph_helpers import graph_runner_for
from test_graph_runner import fill_caches_, restore_, snapshot

from backplane.core.families import SSMBackend
from backplane.core.forward_context import forward_context, plan_step
from backplane.engine.engine import Engine
from backplane.engine.sampling.params import SamplingParams
from backplane.engine.worker.graph.buckets import verify_rows
from backplane.engine.worker.graph.mode import GraphMode
from backplane.engine.worker.inputs import chain_rows

K = 3
VERIFY_LEN = K + 1
MAX_SEQS = 4
PAGE = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}
MODELS = ("tiny-nemotron-h", "tiny-qwen3-next")
STATES = ("conv_state", "ssm_state", "delta_state")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class _Req:
    token_buffer: np.ndarray


@dataclass
class _Seq:
    """A scheduled sequence verifying ``num_draft_tokens`` proposals (0: a plain chunk)."""

    request: _Req
    num_new_tokens: int
    num_cached_tokens: int
    page_ids: np.ndarray
    state_slot: int
    num_draft_tokens: int
    is_prefill_chunk_final: bool = True


def _engine(model: str, device: str, **kw: Any) -> Engine:
    return Engine(
        model=model,
        device=device,
        dtype="float32",
        max_num_seqs=verify_rows(MAX_SEQS, 64, VERIFY_LEN),  # one sequence per row
        max_num_tokens=64,
        max_model_len=64,
        page_size=PAGE,
        num_kv_pages=160,
        speculative_config=NGRAM,
        **kw,
    )


def captured_runner(engine: Engine) -> Any:
    """A graph runner of ``engine`` that captured its verify graphs (buckets 1 to 16)."""
    runner = graph_runner_for(
        engine,
        mode=GraphMode.DECODE,
        max_num_tokens=64,
        max_num_seqs=MAX_SEQS,
        verify_len=VERIFY_LEN,
        first_scratch_slot=engine.num_slots,
    )
    runner.capture()
    assert runner.verify.failed == {}
    assert sorted(runner.verify.graphs) == [1, 2, 4, 8, 16]
    return runner


@pytest.fixture(scope="module", params=MODELS)
def setup(request):
    engine = _engine(request.param, "cpu", cuda_graphs="off")
    runner = captured_runner(engine)
    yield engine, runner
    runner.release()
    engine.shutdown()


def _chunks(engine: Engine, new: list[int], cached: list[int], drafts: list[int], seed: int):
    """Sequences adding ``new[i]`` tokens to ``cached[i]`` on distinct pages, slot ``i + 1``."""
    rng = np.random.default_rng(seed)
    free = rng.permutation(np.arange(1, engine.num_pages))  # page 0 is scratch
    seqs, used = [], 0
    for i, (q, c, d) in enumerate(zip(new, cached, drafts, strict=True)):
        need = -(-(q + c) // engine.page_size)
        pages = free[used : used + need].astype(np.int32)
        used += need
        tokens = rng.integers(0, engine.vocab_size, size=q + c + 1).astype(np.int32)
        seqs.append(_Seq(_Req(tokens), q, c, pages, state_slot=i + 1, num_draft_tokens=d))
    return seqs


def _step(engine: Engine, seqs, prepare, run):
    """Prepare, mark the verification, run; return the hidden rows of each sequence in order,
    the logits of those rows and the state after each position of each verifying sequence."""
    inputs = prepare(seqs)
    engine.spec.mark_verification(inputs, seqs, engine.num_slots)
    with forward_context(inputs.metadata, plan_step(engine.backends, inputs.metadata)):
        hidden = run(inputs)
    idx = np.arange(len(seqs))
    first = inputs.first_token_rows(idx)
    rows = np.concatenate(
        [np.arange(s.num_new_tokens) + f for s, f in zip(seqs, first, strict=True)]
    )
    hidden = hidden[torch.from_numpy(rows).to(hidden.device)].clone()
    logits = inputs.logits
    logits = (
        engine.model.compute_logits(hidden)
        if logits is None
        else logits[torch.from_numpy(rows).to(logits.device)].clone()
    )
    vs = inputs.metadata.verify_states
    verifying = [i for i, s in enumerate(seqs) if s.num_draft_tokens]
    per_position: dict[tuple[str, str, int, int], torch.Tensor] = {}
    for t in range(vs.max_len):
        src, _ = vs.keep_slots(torch.full((len(verifying),), t, dtype=torch.long))
        for layer, caches in engine.caches.items():
            for name, cache in caches.items():
                if name not in STATES:
                    continue
                for v, i in enumerate(verifying):
                    if t < seqs[i].num_new_tokens:
                        per_position[layer, name, i, t] = cache[int(src[v])].clone()
    return inputs, hidden, logits, per_position


@pytest.mark.parametrize(
    ("new", "cached", "drafts"),
    [
        ([4, 1, 3, 2], [5, 9, 13, 2], [3, 0, 2, 1]),
        ([4], [30], [3]),
        ([2, 2], [1, 15], [1, 0]),  # a 2-token chunk without drafts still chains its rows
        ([3, 4, 4, 4], [4, 7, 1, 20], [2, 3, 3, 3]),
    ],
)
def test_verify_graph_rows_equal_the_eager_chunks(setup, new, cached, drafts):
    engine, runner = setup
    check_rows_equal_chunks(engine, runner, new, cached, drafts, tol=1e-4, logits_tol=1e-4)


def check_rows_equal_chunks(
    engine: Engine,
    runner: Any,
    new: list[int],
    cached: list[int],
    drafts: list[int],
    tol: float,
    logits_tol: float,
) -> None:
    """One verification step replayed in ``runner``'s verify graph equals the eager chunks:
    hidden rows, logits, the state after every position, and every cache and slot after it."""
    seqs = _chunks(engine, new, cached, drafts, seed=sum(new) * 7 + len(new))
    fill_caches_(engine, seed=5)
    before = snapshot(engine)
    inputs, got, got_logits, got_states = _step(engine, seqs, runner.prepare_inputs, runner.run)
    assert inputs.mode.is_decode_graph and inputs.mode.rows_share_pages
    assert inputs.metadata.chained_rows is not None
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    after = snapshot(engine)
    restore_(engine, before)
    eager, want, want_logits, want_states = _step(
        engine, seqs, engine.input_batch.prepare, lambda i: engine.model(i.input_ids, i.positions)
    )
    assert not eager.mode.rows_share_pages and eager.metadata.chained_rows is None
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_logits, want_logits, rtol=logits_tol, atol=logits_tol)
    # the state after every position of every verifying chunk, where the verification reads it
    assert got_states.keys() == want_states.keys() and got_states
    for key, state in want_states.items():
        torch.testing.assert_close(got_states[key], state, rtol=tol, atol=tol, msg=str(key))
    # every sequence's own slot holds its state after the whole chunk; other live slots
    # and every page but the scratch page are as the eager step left them
    scratch = engine.num_slots
    for key, t in snapshot(engine).items():
        if key[1] in STATES:
            torch.testing.assert_close(after[key][1:scratch], t[1:scratch], rtol=tol, atol=tol)
        else:
            torch.testing.assert_close(after[key][1:], t[1:], rtol=tol, atol=tol)


def test_rows_chain_through_scratch_slots_and_end_in_their_own():
    seqs = [
        _Seq(_Req(np.zeros(9, np.int32)), 3, 5, np.zeros(2, np.int32), 7, 2),
        _Seq(_Req(np.zeros(4, np.int32)), 1, 3, np.zeros(1, np.int32), 2, 0),
        _Seq(_Req(np.zeros(9, np.int32)), 2, 6, np.zeros(2, np.int32), 5, 1),
    ]
    chain = chain_rows(seqs, first_scratch_slot=20, stride=K, num_positions=VERIFY_LEN)
    assert chain.position.tolist() == [0, 1, 2, 0, 0, 1]
    # sequence j's position i (not its last) goes to 20 + 3 * j + i
    assert chain.dst_slots.tolist() == [20, 21, 7, 2, 26, 5]
    assert chain.src_slots.tolist() == [7, 20, 21, 2, 5, 26]
    with pytest.raises(ValueError, match="does not fit a chain"):
        chain_rows(seqs, first_scratch_slot=20, stride=1, num_positions=VERIFY_LEN)


class _UnchainedSSM(SSMBackend):
    """An SSM backend whose ops keep each sequence on its own slot (no chained rows)."""

    name = "unchained"

    def conv(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("never run")

    def scan(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("never run")


def test_verify_graphs_refused_over_a_backend_that_does_not_chain_rows(setup):
    engine, _ = setup
    backends = dict(engine.backends, ssm=_UnchainedSSM())
    kw = dict(mode=GraphMode.DECODE, max_num_tokens=64, max_num_seqs=MAX_SEQS)
    from backplane.engine.worker.graph.runner import GraphModelRunner

    def make(**more: Any) -> GraphModelRunner:
        return GraphModelRunner(
            engine.model,
            more.pop("backends", engine.backends),
            engine.input_batch,
            max_model_len=engine.max_model_len,
            page_size=engine.page_size,
            **kw,
            **more,
        )

    with pytest.raises(ValueError, match="ssm=unchained cannot run verify graphs"):
        make(backends=backends, verify_len=VERIFY_LEN, first_scratch_slot=engine.num_slots)
    with pytest.raises(ValueError, match="give first_scratch_slot"):
        make(verify_len=VERIFY_LEN)
    # without verify graphs the same backends are fine
    make(backends=backends).release()
    # and the worker verifies piecewise over them
    worker = engine.executor.driver
    assert worker._verify_len() == VERIFY_LEN
    chosen = worker.backends
    worker.backends = backends
    try:
        assert worker._verify_len() == 0
    finally:
        worker.backends = chosen


class _Foresight:
    """Drafts the tokens decoding without speculation produced, so that whole chunks are
    accepted and every chained position's state decides a token; every other draft ends in
    a wrong token, so that rejections in the middle of a chunk happen too.

    :param full: each request's prompt followed by its tokens without speculation.
    :param vocab: the vocabulary size (a wrong token stays inside it).
    """

    def __init__(self, full: list[list[int]], vocab: int) -> None:
        self.full = full
        self.vocab = vocab
        self.calls = 0

    def propose(self, asks, context=None) -> list[list[int]]:
        drafts = []
        for ask in asks:
            seen = ask.token_ids.tolist()
            draft: list[int] = []
            for full in self.full:
                if full[: len(seen)] == seen:
                    draft = full[len(seen) : len(seen) + min(K, ask.max_tokens)]
                    break
            self.calls += 1
            if draft and self.calls % 2:
                draft[-1] = (draft[-1] + 1) % self.vocab
            drafts.append(draft)
        return drafts

    def release(self, request_ids) -> None:
        return None


def _prompts(plain: Engine) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, min(plain.vocab_size, 96), size=n).tolist() for n in (6, 11, 9)]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0),
        SamplingParams(max_tokens=18, temperature=0.0),
        SamplingParams(max_tokens=16, temperature=0.8, seed=11),
    ]
    return prompts, params


def _spec_with_verify_graphs(model: str, **kw: Any) -> tuple[Engine, list[int], Any]:
    """An engine with ngram speculation whose runner captured verify graphs (the torch
    backends chain rows), with its verify-graph replays counted.

    :return: ``(engine, replayed buckets, runner)``.
    """
    spec = Engine(
        model=model,
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        page_size=PAGE,
        speculative_config=NGRAM,
        **kw,
    )
    # the worker sized its input batch for verify rows: the torch backends chain them
    assert spec.executor.driver.verify_len == VERIFY_LEN
    runner = graph_runner_for(
        spec,
        mode=GraphMode.DECODE,
        max_num_tokens=spec.config.max_num_tokens_resolved,
        max_num_seqs=4,
        verify_len=VERIFY_LEN,
        first_scratch_slot=spec.num_slots,
    )
    runner.capture()
    replays: list[int] = []
    replay = runner.verify.replay

    def counted(bucket: int):
        replays.append(bucket)
        return replay(bucket)

    runner.verify.replay = counted
    spec.runner = runner
    return spec, replays, runner


#: the engine-level cases: the presets and a tiny Qwen3.5 checkpoint (gated delta rule and
#: attention, saved once from transformers)
ENGINE_MODELS = (*MODELS, "qwen3_5")


@pytest.fixture(scope="module")
def model_source(tmp_path_factory):
    """``name -> what Engine(model=...) takes``: a preset, or the saved Qwen3.5 directory."""
    saved: dict[str, str] = {}

    def get(name: str) -> str:
        if name != "qwen3_5":
            return name
        if name not in saved:
            transformers = pytest.importorskip("transformers")
            import hf_tiny

            torch.manual_seed(1234)
            cfg = hf_tiny.qwen3_5()
            cfg.initializer_range = 0.15  # well-separated logits: greedy ties are rare
            path = tmp_path_factory.mktemp("qwen3_5")
            transformers.Qwen3_5ForCausalLM(cfg).eval().save_pretrained(path)
            saved[name] = str(path)
        return saved[name]

    return get


@pytest.mark.parametrize("model", ENGINE_MODELS)
def test_speculation_through_verify_graphs_equals_decoding_without(
    model: str, model_source
) -> None:
    model = model_source(model)
    plain = Engine(model=model, device="cpu", dtype="float32", max_num_seqs=4, page_size=PAGE)
    prompts, params = _prompts(plain)
    want = run_requests(plain, prompts, params, check_invariants=False)
    spec, replays, runner = _spec_with_verify_graphs(model)
    spec.spec.proposer = _Foresight(
        [p + w for p, w in zip(prompts, want, strict=True)], spec.vocab_size
    )
    got = run_requests(spec, prompts, params, check_invariants=False)
    assert got == want
    stats = spec.spec.stats
    assert len(replays) >= 5, "verification steps did not replay verify graphs"
    # whole chunks accepted and chunks rejected in the middle
    assert stats.verified_seqs > 0 and stats.draft_tokens // 2 < stats.accepted_tokens
    assert stats.accepted_tokens < stats.draft_tokens
    runner.release()


@pytest.mark.parametrize("model", ENGINE_MODELS)
def test_verify_graphs_with_prefix_caching_equal_decoding_without(model: str, model_source) -> None:
    """With prefix caching on, requests that resume from cached prefixes (and the recurrent
    states kept for them) verify their drafts in verify graphs and still produce the tokens
    of decoding without speculation."""
    model = model_source(model)
    plain = Engine(
        model=model,
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        page_size=PAGE,
        enable_prefix_caching=True,
    )
    prompts, params = _prompts(plain)
    # a second wave of the same prompts, each continued: their prefixes are cached
    again = [p + [p[0], p[-1]] for p in prompts]
    want = run_requests(plain, prompts, params, check_invariants=False)
    want_again = run_requests(plain, again, params, check_invariants=False)
    spec, replays, runner = _spec_with_verify_graphs(model, enable_prefix_caching=True)
    full = [p + w for p, w in zip(prompts + again, want + want_again, strict=True)]
    spec.spec.proposer = _Foresight(full, spec.vocab_size)
    hits: list[int] = []
    schedule = spec.scheduler.schedule

    def recorded():
        out = schedule()
        hits.extend(
            s.num_cached_tokens
            for s in out.scheduled
            if s.num_cached_tokens and len(s.request.output_token_ids) == 0
        )
        return out

    spec.scheduler.schedule = recorded
    assert run_requests(spec, prompts, params, check_invariants=False) == want
    first = len(replays)
    assert run_requests(spec, again, params, check_invariants=False) == want_again
    assert hits, "no request of the second wave resumed from a cached prefix"
    assert first >= 3 and len(replays) - first >= 3, "verification did not replay verify graphs"
    assert spec.spec.stats.accepted_tokens > 0
    runner.release()


@pytest.mark.parametrize("model", ENGINE_MODELS)
def test_verify_graphs_with_preemption_equal_decoding_without(model: str, model_source) -> None:
    """With too few pages for every request, requests are preempted and recompute their
    prompts and recurrent states; verification in verify graphs still gives the tokens of
    decoding without speculation."""
    model = model_source(model)
    pages = 16  # 64 tokens of KV for requests that grow to about 80 together
    plain = Engine(
        model=model, device="cpu", dtype="float32", max_num_seqs=4, page_size=PAGE,
        num_kv_pages=pages,
    )  # fmt: skip
    prompts, params = _prompts(plain)
    want = run_requests(plain, prompts, params, check_invariants=False)
    spec, replays, runner = _spec_with_verify_graphs(model, num_kv_pages=pages)
    spec.spec.proposer = _Foresight(
        [p + w for p, w in zip(prompts, want, strict=True)], spec.vocab_size
    )
    assert run_requests(spec, prompts, params, check_invariants=False) == want
    assert spec.scheduler.stats.preemptions > 0, "no request was preempted"
    assert len(replays) >= 3, "verification did not replay verify graphs"
    assert spec.spec.stats.accepted_tokens > 0
    runner.release()
