"""A seeded randomised lifecycle: adds, aborts in every state, preemption, prefix and host-tier
reuse, on tiny-llama and a hybrid preset, synchronous and asynchronous.

Every step the scheduler's and KV manager's bookkeeping is checked; every output stream is
checked (one final output, nothing after it); at the end nothing is left held, and every
request's tokens equal the tokens it gets run alone (an aborted request's are a prefix of
them).
"""

from __future__ import annotations

import numpy as np
import pytest
from leaks import assert_idle

from backplane.core.hookspecs import FAMILIES
from backplane.engine.engine import Engine
from backplane.engine.request import RequestStatus
from backplane.engine.sampling import SamplingParams

TORCH_BACKENDS = dict.fromkeys(FAMILIES, "torch")
STATES = ("waiting", "prefill", "decode", "preempted", "pending", "aborted", "unknown")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(model: str, **kw) -> Engine:
    cfg = dict(
        model=model,
        device="cpu",
        max_num_seqs=4,
        max_num_tokens=16,
        page_size=4,
        backends=TORCH_BACKENDS,
    )
    cfg.update(kw)
    return Engine(**cfg)


def state_of(engine: Engine, rid: str) -> str:
    req = engine.get_request(rid)
    if req is None:
        return "unknown"
    if req.is_finished:
        return "aborted"
    if req.has_pending_token and req.num_output_tokens == 1:
        return "pending"  # its first token is still on the device (asynchronous steps)
    if req.status is RequestStatus.WAITING:
        return "waiting"
    if req.status is RequestStatus.PREEMPTED:
        return "preempted"
    return "prefill" if req.num_output_tokens == 0 else "decode"


def check_step(engine: Engine) -> None:
    """Bookkeeping invariants between steps."""
    sched = engine.scheduler
    sched.check_invariants()
    kv = engine.kv_manager
    running = sched.running
    assert kv.num_live_slots == (len(running) if kv.needs_state_slot else 0)
    assert kv._reserved_pages == 0 and kv._reserved_slots == 0
    if kv.host is not None:
        assert kv.host.num_claimed() == 0
    live = {r.request_id for r in running} | {r.request_id for r in sched.waiting}
    assert live <= set(engine._requests), "a queued request the engine does not know"
    for rid in set(engine._requests) - live:
        assert engine._requests[rid].is_finished


class Workload:
    """Random requests over a few shared prefixes (so pages are reused and offloaded)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.heads = [self.rng.integers(3, 300, n).tolist() for n in (8, 12, 17)]
        self.n = 0

    def request(self) -> tuple[str, list[int], SamplingParams]:
        rng = self.rng
        head = self.heads[int(rng.integers(len(self.heads)))] if rng.random() < 0.7 else []
        prompt = head + rng.integers(3, 300, int(rng.integers(1, 7))).tolist()
        sample = rng.random() < 0.5
        params = SamplingParams(
            max_tokens=int(rng.integers(1, 10)),
            temperature=float(rng.choice([0.7, 1.0])) if sample else 0.0,
            top_k=int(rng.choice([0, 5, 50])) if sample else 0,
            top_p=float(rng.choice([1.0, 0.9])) if sample else 1.0,
            seed=int(rng.integers(0, 2**64, dtype=np.uint64)) if sample else None,
            stop_token_ids=[int(rng.integers(3, 300))] if rng.random() < 0.3 else [],
            ignore_eos=bool(rng.random() < 0.8),
        )
        self.n += 1
        return f"q{self.n}", prompt, params


def run_random(engine: Engine, seed: int, num_steps: int):
    """Drive ``engine`` with random adds and aborts; return what the caller saw."""
    work = Workload(seed)
    rng = np.random.default_rng(seed + 1)
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    aborted_in: dict[str, int] = dict.fromkeys(STATES, 0)
    for step in range(num_steps + 400):
        adding = step < num_steps
        if adding:
            for _ in range(int(rng.poisson(0.7))):
                rid, prompt, params = work.request()
                assert engine.add_request(prompt, params, request_id=rid) == rid
                requests[rid] = (prompt, params)
                tokens[rid] = []
            by_state: dict[str, list[str]] = {s: [] for s in STATES}
            for rid in requests:
                if rid not in reasons:
                    by_state[state_of(engine, rid)].append(rid)
            by_state["unknown"].append("never-added")
            # the least covered state that has a candidate; one not covered yet at once
            state = min(
                (s for s in STATES if by_state[s]), key=lambda s: (aborted_in[s], rng.random())
            )
            if aborted_in[state] == 0 or rng.random() < 0.25:
                rid = by_state[state][int(rng.integers(len(by_state[state])))]
                live = state not in ("aborted", "unknown")
                assert engine.abort_request(rid) is live, (rid, state)
                aborted_in[state] += 1
                if live and rng.random() < 0.5:
                    # again, before the abort is reported: no longer live, id still in use
                    assert state_of(engine, rid) == "aborted"
                    assert not engine.abort_request(rid)
                    aborted_in["aborted"] += 1
        elif not engine.has_unfinished_requests():
            break
        for o in engine.step():
            assert o.request_id not in reasons, f"output after the final one: {o}"
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        check_step(engine)
    assert not engine.has_unfinished_requests()
    assert set(reasons) == set(requests), "a request never got its final output"
    return requests, tokens, reasons, aborted_in


_SOLO: dict[tuple, list[int]] = {}


def solo(model: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """The request's tokens when it runs alone on a roomy engine without prefix reuse."""
    key = (model, tuple(prompt), params)
    if key not in _SOLO:
        e = make_engine(model, num_kv_pages=64, enable_prefix_caching=False)
        e.add_request(prompt, params)
        out: list[int] = []
        while e.has_unfinished_requests():
            for o in e.step():
                out.extend(o.new_token_ids)
        _SOLO[key] = out
    return _SOLO[key]


CASES = {
    # small KV + host tier: preemption, device prefix hits and host-tier onboarding
    "llama-sync": (
        "tiny-llama",
        dict(num_kv_pages=16, host_kv_memory=1 << 20, async_scheduling=False),
        0,
    ),
    "llama-async": (
        "tiny-llama",
        dict(num_kv_pages=16, host_kv_memory=1 << 20, async_scheduling=True),
        1,
    ),
    # a hybrid: attention pages plus one recurrent-state slot per sequence
    "nemotron-h-sync": ("tiny-nemotron-h", dict(num_kv_pages=14, async_scheduling=False), 2),
    "nemotron-h-async": ("tiny-nemotron-h", dict(num_kv_pages=14, async_scheduling=True), 3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_random_lifecycle(case):
    model, kw, seed = CASES[case]
    engine = make_engine(model, **kw)
    requests, tokens, reasons, aborted_in = run_random(engine, seed, num_steps=90)
    assert_idle(engine.scheduler, engine)

    # the run went through what it is meant to exercise
    must = {s for s in STATES if s != "pending" or engine.async_scheduling}
    assert {s for s, n in aborted_in.items() if n} >= must, aborted_in
    assert engine.scheduler.stats.preemptions > 0
    kv_stats = engine.kv_manager.stats
    if engine.kv_manager.prefix_caching:
        assert kv_stats.device_hit_pages > 0, kv_stats
        assert engine.kv_manager.host is None or kv_stats.host_hit_pages > 0, kv_stats
    assert sum(r != "abort" for r in reasons.values()) >= 20

    for rid, (prompt, params) in requests.items():
        want = solo(model, prompt, params)
        got = tokens[rid]
        if reasons[rid] == "abort":
            assert got == want[: len(got)], rid
        else:
            assert got == want, rid
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops |= set(engine.eos_token_ids)
            assert reasons[rid] == ("stop" if want[-1] in stops else "length"), rid
