"""Scheduler: budgets, chunked prefill, decode priority, preemption, FCFS, abort.

Steps run against a fake model: it checks that each sequence's cached context
(paged KV, and the recurrent state slot when there is one) holds exactly the
sequence's tokens, writes the new tokens, and "samples" a deterministic
function of the token history. Generated text must therefore equal what each
request produces alone, whatever batching, reuse, onboarding or preemption
happened on the way.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backplane.core.errors import ConfigError, OutOfKVMemoryError, RequestError
from backplane.engine.kv_cache import HostTier, KVCacheManager
from backplane.engine.request import FinishReason, Request, RequestStatus
from backplane.engine.sched import Scheduler, SchedulerOutput

VOCAB = 64


def next_token(history: np.ndarray) -> int:
    """The fake model's greedy choice: depends on the whole history."""
    h = history.astype(np.int64)
    return int((h[-1] * 7 + h.sum() * 3 + len(h)) % VOCAB)


def reference(prompt: list[int], max_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
    toks = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = next_token(np.asarray(toks))
        out.append(t)
        toks.append(t)
        if t in stop:
            break
    return out


class Engine:
    """Scheduler + KV manager + the content-checking fake model."""

    def __init__(
        self,
        num_pages: int = 64,
        page_size: int = 4,
        *,
        max_num_seqs: int = 8,
        max_num_tokens: int = 32,
        host_pages: int = 0,
        num_state_slots: int = 0,
        prefix: bool = True,
        device: str = "cpu",
    ) -> None:
        self.ps = page_size
        self.dev = torch.device(device)
        self.cache = torch.full((num_pages, page_size), -1, dtype=torch.int32, device=self.dev)
        host = HostTier([self.cache], host_pages) if host_pages else None
        self.kv = KVCacheManager(
            num_pages,
            page_size,
            num_state_slots=num_state_slots,
            enable_prefix_caching=prefix,
            host_tier=host,
            debug=True,
        )
        self.state = np.full(max(num_state_slots, 1), -1, dtype=np.int64)  # tokens seen
        self.sched = Scheduler(self.kv, max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens)
        self.outputs: list[SchedulerOutput] = []

    def add(self, rid: str, prompt, max_tokens: int, stop=()) -> Request:
        r = Request(
            rid,
            np.asarray(prompt, np.int32),
            SimpleNamespace(max_tokens=max_tokens, stop_token_ids=tuple(stop), ignore_eos=False),
            vocab_size=VOCAB,
        )
        self.sched.add_request(r)
        return r

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.outputs.append(out)
        assert out.num_scheduled_tokens <= self.sched.max_num_tokens
        assert out.num_scheduled_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert len(out.scheduled) <= self.sched.max_num_seqs
        kinds = [s.is_decode for s in out.scheduled]
        assert kinds == sorted(kinds), "prefill/extend first, decode last"
        assert out.num_prefill_seqs == kinds.count(False)
        assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
        sampled = {}
        for s in out.scheduled:
            r, c, n, ps = s.request, s.num_cached_tokens, s.num_new_tokens, self.ps
            toks = r.token_buffer
            assert n >= 1 and c + n <= r.num_tokens
            assert s.is_prefill_chunk_final == (c + n == r.num_tokens)
            assert len(s.page_ids) == -(-(c + n) // ps) and 0 not in s.page_ids.tolist()
            pos = np.arange(c)
            pg = torch.from_numpy(s.page_ids[pos // ps]).long().to(self.dev)
            got = self.cache[pg, torch.from_numpy(pos % ps).to(self.dev)]
            np.testing.assert_array_equal(got.cpu().numpy(), toks[:c], err_msg=f"stale KV for {r}")
            if self.kv.needs_state_slot:
                assert s.state_slot != 0
                seen = self.state[s.state_slot] if c > 0 else 0
                assert seen == c, f"state slot of {r} holds {seen} tokens, context is {c}"
                self.state[s.state_slot] = c + n
            pos = np.arange(c, c + n)
            pg = torch.from_numpy(s.page_ids[pos // ps]).long().to(self.dev)
            self.cache[pg, torch.from_numpy(pos % ps).to(self.dev)] = torch.from_numpy(
                toks[c : c + n].copy()
            ).to(self.dev)
            if s.is_prefill_chunk_final:
                sampled[r.request_id] = next_token(toks[: c + n])
        self.sched.update(out, sampled)
        self.sched.check_invariants()
        return out

    def run(self, max_steps: int = 2000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        self.sched.check_invariants()
        assert self.kv.num_used_pages == 0, "pages leaked"
        assert self.kv.slots.num_used == 0, "state slots leaked"
        return steps


def workload(seed: int, n: int = 12) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 24).tolist()
    out = []
    for _ in range(n):
        head = shared[: int(rng.integers(0, 24))]
        tail = rng.integers(0, VOCAB, int(rng.integers(1, 14))).tolist()
        out.append((head + tail, int(rng.integers(1, 10))))
    return out


CONFIGS = {
    "roomy": dict(num_pages=64),
    "tight-preempt": dict(num_pages=14, max_num_tokens=16),
    "tight-host": dict(num_pages=14, max_num_tokens=16, host_pages=16),
    "no-prefix": dict(num_pages=20, prefix=False),
    "recurrent": dict(num_pages=20, num_state_slots=5, max_num_seqs=4),
    "tight-recurrent": dict(num_pages=12, max_num_tokens=16, num_state_slots=5, max_num_seqs=4),
    "tiny-budget": dict(num_pages=40, max_num_tokens=3, max_num_seqs=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generation_matches_each_request_alone(name):
    e = Engine(**CONFIGS[name])
    reqs = [e.add(f"r{i}", p, m) for i, (p, m) in enumerate(workload(1))]
    e.run()
    for r, (p, m) in zip(reqs, workload(1), strict=True):
        assert r.output_token_ids.tolist() == reference(p, m), r
        assert r.finish_reason is FinishReason.LENGTH and r.status is RequestStatus.FINISHED
    kvs = e.kv.stats
    assert kvs.estimated_reused_tokens == kvs.realised_reused_tokens
    if name.startswith("tight"):
        assert e.sched.stats.preemptions > 0, "the tight configs are meant to preempt"
    if name == "tight-host":
        assert kvs.onboarded_pages > 0
    if name in ("no-prefix", "recurrent", "tight-recurrent"):
        assert kvs.device_hit_pages == 0


@pytest.mark.gpu
def test_generation_with_async_host_tier_on_cuda():
    """Offloads and onboarding run on a side stream; the content checks run on the
    compute stream after ``schedule()`` ordered it behind the copies."""
    e = Engine(num_pages=14, max_num_tokens=16, host_pages=16, device="cuda")
    work = workload(3, 16)
    reqs = [e.add(f"r{i}", p, m) for i, (p, m) in enumerate(work)]
    e.run()
    for r, (p, m) in zip(reqs, work, strict=True):
        assert r.output_token_ids.tolist() == reference(p, m), r
    assert e.kv.stats.onboarded_pages > 0 and e.kv.stats.offloaded_pages > 0


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_pages=st.integers(10, 40),
    max_num_tokens=st.integers(4, 24),
    max_num_seqs=st.integers(1, 4),
    host_pages=st.sampled_from([0, 6]),
)
def test_random_workloads_never_exceed_budgets(
    seed, num_pages, max_num_tokens, max_num_seqs, host_pages
):
    e = Engine(
        num_pages,
        max_num_tokens=max_num_tokens,
        max_num_seqs=max_num_seqs,
        host_pages=host_pages,
    )
    work = workload(seed, 6)
    reqs = []
    for i, (p, m) in enumerate(work):
        try:
            reqs.append((e.add(f"r{i}", p, m), p, m))
        except OutOfKVMemoryError:
            assert -(-(len(p) + m) // 4) > num_pages - 1
    e.run()
    for r, p, m in reqs:
        assert r.output_token_ids.tolist() == reference(p, m)


def test_chunked_prefill_splits_a_long_prompt():
    e = Engine(max_num_tokens=8)
    r = e.add("long", list(range(20)), 2)
    chunks = []
    while r.num_output_tokens == 0:
        (s,) = e.step().scheduled
        chunks.append((s.num_cached_tokens, s.num_new_tokens, s.is_prefill_chunk_final))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    e.run()
    assert r.output_token_ids.tolist() == reference(list(range(20)), 2)


def test_decodes_come_first_and_prefill_gets_the_rest_of_the_budget():
    e = Engine(max_num_tokens=10, max_num_seqs=8)
    a = [e.add(f"d{i}", [i + 1, 2, 3], 20) for i in range(3)]
    e.step()  # prefills of the three
    long = e.add("long", list(range(30)), 3)
    out = e.step()
    ids = [s.request.request_id for s in out.scheduled]
    assert ids == ["long", "d0", "d1", "d2"], "output order: prefill first, decode last"
    assert out.scheduled[0].num_new_tokens == 7 and out.num_scheduled_tokens == 10
    assert all(s.is_decode for s in out.scheduled[1:])
    e.run()
    assert long.output_token_ids.tolist() == reference(list(range(30)), 3)
    assert all(r.num_output_tokens == 20 for r in a)


def test_preemption_frees_pages_and_requeues_at_front_then_recomputes():
    # 6 usable pages of 4 tokens; two requests that each grow to 5 pages
    e = Engine(num_pages=7, max_num_tokens=16, max_num_seqs=2, prefix=False)
    a = e.add("a", list(range(1, 9)), 12)
    b = e.add("b", list(range(11, 19)), 12)
    c = e.add("c", [5], 1)
    preempted = []
    while e.sched.has_unfinished():
        out = e.step()
        preempted += [r.request_id for r in out.preempted]
        if out.preempted:
            assert e.sched.waiting[0] is b, "preempted request goes to the front of the queue"
            assert b.kv_state.num_pages == 0 and b.num_computed_tokens == 0
            assert b.stats.num_preemptions >= 1
    assert preempted and set(preempted) == {"b"}, "the latest admitted request is the victim"
    assert a.output_token_ids.tolist() == reference(list(range(1, 9)), 12)
    assert b.output_token_ids.tolist() == reference(list(range(11, 19)), 12)
    assert c.stats.first_scheduled_time > b.stats.first_scheduled_time


def test_fcfs_no_overtaking_when_memory_is_short():
    e = Engine(num_pages=9, max_num_tokens=64, max_num_seqs=4, prefix=False)
    first = e.add("first", list(range(20)), 10)  # 5 pages, up to 8
    big = e.add("big", list(range(20, 40)), 10)  # does not fit next to first
    small = e.add("small", [1, 2], 1)  # would fit, but must not overtake big
    out = e.step()
    assert [s.request.request_id for s in out.scheduled] == ["first"]
    assert e.sched.waiting == [big, small]
    e.run()
    assert big.stats.first_scheduled_time <= small.stats.first_scheduled_time
    assert first.num_output_tokens == 10


def test_abort_running_and_waiting_frees_everything_and_reports_once():
    e = Engine(max_num_seqs=1, num_state_slots=3)
    a = e.add("a", list(range(10)), 20)
    b = e.add("b", list(range(10)), 20)
    e.step()
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    assert e.sched.abort("a") and e.sched.abort("b")
    assert not e.sched.abort("a") and not e.sched.abort("nope")
    assert a.finish_reason is FinishReason.ABORT is b.finish_reason
    assert e.kv.num_used_pages == 0 and e.kv.slots.num_used == 0
    out = e.sched.schedule()
    assert out.is_empty and {r.request_id for r in out.finished} == {"a", "b"}
    assert e.sched.schedule().finished == [] and e.sched.pop_finished() == []
    assert not e.sched.has_unfinished()


def test_abort_between_schedule_and_update():
    e = Engine()
    a = e.add("a", [1, 2, 3], 5)
    out = e.sched.schedule()
    e.sched.abort("a")
    assert e.sched.update(out, {"a": 1}) == []
    assert a.num_output_tokens == 0 and e.kv.num_used_pages == 0


def test_stop_token_and_update_reports_finished():
    prompt = [3, 1, 4]
    ref = reference(prompt, 10)
    e = Engine()
    r = e.add("s", prompt, 10, stop=[ref[2]])
    done = []
    while e.sched.has_unfinished():
        out = e.sched.schedule()
        s = out.scheduled[0]
        tok = next_token(r.token_buffer[: s.num_cached_tokens + s.num_new_tokens])
        done += e.sched.update(out, {"s": tok} if s.is_prefill_chunk_final else {})
    assert done == [r] and r.finish_reason is FinishReason.STOP
    assert r.output_token_ids.tolist() == ref[:3]
    assert e.sched.pop_finished() == [r] and e.sched.schedule().finished == []


def test_too_large_request_is_rejected_without_disturbing_others():
    e = Engine(num_pages=9)  # 8 pages = 32 tokens
    ok = e.add("ok", [1, 2, 3], 4)
    with pytest.raises(OutOfKVMemoryError, match="lower max_tokens"):
        e.add("big", list(range(30)), 3)
    with pytest.raises(RequestError, match="already in use"):
        e.add("ok", [1], 1)
    e.run()
    assert ok.output_token_ids.tolist() == reference([1, 2, 3], 4)


def test_missing_sampled_token_is_an_error():
    e = Engine()
    e.add("a", [1, 2], 3)
    out = e.sched.schedule()
    with pytest.raises(KeyError, match="is_prefill_chunk_final"):
        e.sched.update(out, {})


def test_budget_config_is_validated():
    kv = KVCacheManager(8, 4)
    with pytest.raises(ConfigError, match="max_num_tokens"):
        Scheduler(kv, max_num_seqs=8, max_num_tokens=4)
    with pytest.raises(ConfigError):
        Scheduler(kv, max_num_seqs=0, max_num_tokens=4)


def test_full_prefix_hit_is_scheduled_as_a_one_token_decode_shaped_step():
    e = Engine()
    e.add("a", list(range(8)) + [1], 1)
    e.run()
    b = e.add("b", list(range(8)) + [1], 2)
    out = e.step()
    (s,) = out.scheduled
    assert s.num_cached_tokens == 8 and s.num_new_tokens == 1 and s.is_decode
    assert out.num_prefill_seqs == 0 and b.stats.reused_tokens == 8
    e.run()
