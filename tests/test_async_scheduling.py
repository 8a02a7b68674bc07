"""Asynchronous steps: the same tokens, stops and aborts as synchronous steps.

With ``async_scheduling`` the engine schedules and launches step N+1 before
step N's tokens reach the host; the decode tokens of N+1 are read from N's
sampled tokens on the device. These tests run random workloads both ways and
require identical outputs, token for token, with stops that fire mid-stream,
length limits, preemption under a small KV cache and aborts of requests whose
tokens are still being sampled.
"""

from __future__ import annotations

import numpy as np
import pytest

from backplane.core.hookspecs import FAMILIES
from backplane.engine.engine import Engine
from backplane.engine.sampling import SamplingParams

TORCH_BACKENDS = dict.fromkeys(FAMILIES, "torch")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(model: str, async_scheduling: bool, **kw) -> Engine:
    cfg = dict(
        model=model,
        device="cpu",
        max_num_seqs=4,
        max_num_tokens=24,
        page_size=4,
        num_kv_pages=64,
        backends=TORCH_BACKENDS,
        async_scheduling=async_scheduling,
    )
    cfg.update(kw)
    return Engine(**cfg)


def run(engine: Engine, requests, abort_at: dict[str, int] | None = None):
    """Drive ``engine`` to completion; return tokens, finish reasons and output order per request.

    :param abort_at: request id -> number of ``step()`` calls after which to abort it.
    """
    ids = [engine.add_request(p, sp, request_id=rid) for rid, p, sp in requests]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str | None] = {}
    calls = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id not in reasons, f"{o.request_id} reported after it finished"
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        calls += 1
        for rid, at in (abort_at or {}).items():
            if calls == at:
                engine.abort_request(rid)
        assert calls < 2000
    assert engine.kv_manager.num_used_pages == 0
    engine.scheduler.check_invariants()
    return tokens, reasons


def random_requests(seed: int, n: int, stops_from: dict[str, list[int]] | None = None):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        rid = f"r{i}"
        prompt = rng.integers(3, 250, size=int(rng.integers(1, 30))).tolist()
        temperature = float(rng.choice([0.0, 0.8]))
        stops: tuple[int, ...] = ()
        if stops_from is not None and len(stops_from[rid]) > 3:
            # a token the request really generates mid-way: the stop fires early
            stops = (stops_from[rid][int(rng.integers(1, len(stops_from[rid]) - 1))],)
        sp = SamplingParams(
            max_tokens=int(rng.integers(1, 14)),
            temperature=temperature,
            top_k=int(rng.choice([0, 20])),
            seed=int(rng.integers(0, 2**31)) if temperature else None,
            stop_token_ids=stops,
            ignore_eos=True,
        )
        out.append((rid, prompt, sp))
    return out


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-nemotron-h"])
def test_async_steps_equal_sync_steps_with_stops_and_lengths(model):
    plain = random_requests(0, 10)
    first, _ = run(make_engine(model, False), plain)
    reqs = random_requests(0, 10, stops_from=first)
    assert any(sp.stop_token_ids for _, _, sp in reqs)
    sync_tokens, sync_reasons = run(make_engine(model, False), reqs)
    async_tokens, async_reasons = run(make_engine(model, True), reqs)
    assert async_tokens == sync_tokens
    assert async_reasons == sync_reasons
    assert "stop" in sync_reasons.values() and "length" in sync_reasons.values()
    for rid, _, sp in reqs:
        toks = sync_tokens[rid]
        assert len(toks) <= sp.max_tokens
        # nothing after a stop token reaches the user
        for stop in sp.stop_token_ids:
            if stop in toks:
                assert toks.index(stop) == len(toks) - 1


def test_async_steps_equal_sync_steps_under_preemption():
    reqs = random_requests(3, 8)
    # 12 usable pages of 4 tokens: several requests cannot run at once
    small = dict(num_kv_pages=13, enable_prefix_caching=True)
    sync_e = make_engine("tiny-llama", False, **small)
    sync_tokens, sync_reasons = run(sync_e, reqs)
    async_e = make_engine("tiny-llama", True, **small)
    async_tokens, async_reasons = run(async_e, reqs)
    assert sync_e.scheduler.stats.preemptions > 0
    assert async_e.scheduler.stats.preemptions > 0
    assert async_tokens == sync_tokens
    assert async_reasons == sync_reasons


def test_abort_while_a_token_is_being_sampled():
    reqs = [
        ("a", list(range(3, 20)), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)),
        ("b", list(range(5, 12)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    ]
    ref, _ = run(make_engine("tiny-llama", False), [reqs[1]])
    e = make_engine("tiny-llama", True)
    tokens, reasons = run(e, reqs, abort_at={"a": 5})
    assert reasons == {"a": "abort", "b": "length"}
    # the aborted request got no token after its abort, the other one is undisturbed
    assert len(tokens["a"]) <= 5
    assert tokens["b"] == ref["b"]


def test_sync_mode_reports_each_step_at_once():
    e = make_engine("tiny-llama", False)
    e.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    first = e.step()
    assert [len(o.new_token_ids) for o in first] == [1]
    second = e.step()
    assert second[0].finished and not e.has_unfinished_requests()
    # async: the first call launches, the second commits the first token
    e = make_engine("tiny-llama", True)
    e.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert e.step() == []
    assert [o.new_token_ids for o in e.step()] == [[first[0].new_token_ids[0]]]
    assert e.has_unfinished_requests()
    last = e.step()
    assert last[0].finished and last[0].new_token_ids == second[0].new_token_ids
    assert not e.has_unfinished_requests()
