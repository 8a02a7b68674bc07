"""Prompt-lookup speculation with asynchronous scheduling: steps overlap between drafts.

A draft continues a request's latest token, which the step in flight still
holds on the device. The engine commits that step first only when some
request's committed tokens already continue an earlier match; a step with
drafts then runs synchronously (its token count is known only after it ran),
and the steps between overlap as usual. These tests require the tokens of
decoding without speculation, greedy and seeded, on an attention model and a
hybrid; that drafts are verified and accepted; that steps without a lookup
overlap; that a step with drafts never runs beside one in flight; and that a
fault while committing the step in flight is undone.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import run_requests

from backplane.engine.engine import Engine
from backplane.engine.sampling import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_tokens=64, page_size=4)


class Fault(RuntimeError):
    """The injected failure."""


def _engine(model: str, *, spec: bool = True, overlap: bool = True) -> Engine:
    return Engine(
        model=model,
        async_scheduling=overlap,
        speculative_config=NGRAM if spec else None,
        **ENGINE,
    )


def _workload(engine: Engine) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts that repeat the model's own continuation (drafts accepted for a while) beside
    prompts of tokens that repeat nothing; greedy and seeded."""
    rng = np.random.default_rng(3)
    vocab = engine.vocab_size
    start = rng.integers(1, min(vocab, 96), size=6).tolist()
    cont = run_requests(engine, [start], [SamplingParams(max_tokens=10, temperature=0.0)])[0]
    prompts = [
        start + cont + start,
        rng.permutation(vocab)[:20].tolist(),
        (start + cont) * 2 + start[:2],
        rng.permutation(vocab)[:9].tolist(),
    ]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=18, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=26, temperature=0.7, seed=9, ignore_eos=True),
    ]
    return prompts, params


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-nemotron-h"])
def test_lookups_share_steps_with_asynchronous_scheduling(model: str) -> None:
    plain = _engine(model, spec=False)
    prompts, params = _workload(plain)
    want = run_requests(plain, prompts, params)
    plain.shutdown()

    e = _engine(model)
    assert e.async_scheduling  # prompt lookup keeps it on
    launch = e._launch
    overlapped = launches = 0

    def watched_launch(sched):
        nonlocal overlapped, launches
        launches += 1
        if e._inflight is not None:
            overlapped += 1
            # drafts are looked up only with nothing in flight
            assert not any(s.num_draft_tokens for s in sched.scheduled)
        return launch(sched)

    e._launch = watched_launch
    got = run_requests(e, prompts, params)
    stats = e.spec.stats
    e.shutdown()
    assert got == want
    assert stats.verified_seqs > 0 and stats.accepted_tokens > 0
    # the steps between lookups overlap
    assert overlapped >= launches // 3, (overlapped, launches)

    sync = _engine(model, overlap=False)
    assert not sync.async_scheduling
    assert run_requests(sync, prompts, params) == want
    sync.shutdown()


@pytest.mark.usefixtures("one_torch_thread")
def test_the_step_in_flight_is_committed_only_when_a_committed_suffix_matches() -> None:
    e = _engine("tiny-llama")
    vocab = e.vocab_size
    # nothing repeats: no lookup is due while the prompt's step is in flight
    e.add_request(list(range(1, 13)), SamplingParams(max_tokens=8, temperature=0.0))
    e.step()
    assert e._inflight is not None
    assert not e.spec.lookup_due(e.scheduler.running)
    # a prompt whose last tokens occurred before: its lookup is due, in flight or not
    e.add_request([vocab - 1, 5, 6, 7, vocab - 2, 5, 6, 7], SamplingParams(max_tokens=8))
    e.step()
    assert e.spec.lookup_due(e.scheduler.running)
    while e.has_unfinished_requests():
        e.step()
    e.shutdown()


def test_model_running_proposers_keep_steps_synchronous() -> None:
    e = Engine(
        model="tiny-llama",
        async_scheduling=True,
        speculative_config={
            "method": "draft_model",
            "model": "tiny-llama",
            "num_speculative_tokens": 2,
        },
        **ENGINE,
    )
    try:
        assert not e.async_scheduling
        assert not e.spec.shares_async_steps
    finally:
        e.shutdown()


class Once:
    """Wraps a callable so that, once armed, its next call raises before it runs."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.armed = False
        self.fired = 0

    def __call__(self, *args, **kwargs):
        if self.armed:
            self.armed = False
            self.fired += 1
            raise Fault("injected")
        return self.fn(*args, **kwargs)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_fault_while_committing_the_step_in_flight_is_undone() -> None:
    """The wait for the tokens in flight fails, in the commit before a lookup or in the
    ordinary one: the run goes on with the undisturbed run's tokens."""
    plain = _engine("tiny-llama", spec=False)
    prompts, params = _workload(plain)
    want = run_requests(plain, prompts, params)
    plain.shutdown()

    e = _engine("tiny-llama")
    settle = e._settle_for_lookup
    fault = e._wait = Once(e._wait)
    in_settle = 0

    def watched_settle():
        nonlocal in_settle
        if e._inflight is not None and e.spec.lookup_due(e.scheduler.running):
            in_settle += 1
            if in_settle in (2, 5):
                fault.armed = True
        return settle()

    e._settle_for_lookup = watched_settle
    ids = [e.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    got: dict[str, list[int]] = {i: [] for i in ids}
    calls = raised = 0
    while e.has_unfinished_requests():
        if calls in (7, 19):
            fault.armed = True
        try:
            outs = e.step()
        except Fault:
            raised += 1
            e.scheduler.check_invariants()
            outs = []
        for o in outs:
            got[o.request_id].extend(o.new_token_ids)
        calls += 1
        assert calls < 500
    kv = e.kv_manager
    assert kv.num_used_pages == 0
    e.shutdown()
    assert raised == fault.fired >= 3
    assert [got[i] for i in ids] == want
