"""Asynchronous scheduling with structured output: grammar rows keep the steps overlapping.

A step with a grammar row launches its forward with the previous step's tokens
still on the device, commits that previous step (the grammar's mask needs its
token on the host), and only then samples. These tests require the tokens,
finish reasons and aborts of a synchronous run, token for token, with JSON
schema, regex and choice grammars mixed with free requests, greedy and seeded;
and they watch the step loop to see that forwards start while the step before
is still uncommitted.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install -e '.[dev]')")

from backplane.core.hookspecs import FAMILIES  # noqa: E402
from backplane.engine.engine import Engine  # noqa: E402
from backplane.engine.sampling import SamplingParams  # noqa: E402

TORCH_BACKENDS = dict.fromkeys(FAMILIES, "torch")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
REGEX = r"[ab]{2,5}-\d{2}"
CHOICES = ["yes", "no", "maybe"]


class Fault(RuntimeError):
    """The injected error."""


def make_engine(async_scheduling: bool, **kw) -> Engine:
    cfg = dict(
        model="tiny-llama",
        device="cpu",
        max_num_seqs=6,
        max_num_tokens=48,
        page_size=4,
        num_kv_pages=128,
        backends=TORCH_BACKENDS,
        async_scheduling=async_scheduling,
    )
    cfg.update(kw)
    return Engine(**cfg)


def mixed_requests(temperature: float) -> list[tuple[str, list[int], SamplingParams]]:
    """Grammar requests (JSON schema, regex, choice) between free ones of several lengths."""
    seeded = temperature > 0

    def params(i: int, **kw) -> SamplingParams:
        return SamplingParams(temperature=temperature, seed=100 + i if seeded else None, **kw)

    return [
        ("free0", [5, 9, 13, 2], params(0, max_tokens=30, ignore_eos=True)),
        ("json", [7, 8], params(1, max_tokens=120, structured_outputs={"json": SCHEMA})),
        ("free1", list(range(20, 47)), params(2, max_tokens=9, ignore_eos=True)),
        ("regex", [3, 4, 5], params(3, max_tokens=40, structured_outputs={"regex": REGEX})),
        ("choice", [11], params(4, max_tokens=20, structured_outputs={"choice": CHOICES})),
        ("free2", [30, 31], params(5, max_tokens=22, ignore_eos=True)),
    ]


def drive(engine: Engine, requests, *, abort_at=None, fault_steps=(), arm=None):
    """Run ``requests`` to the end: tokens and finish reasons per request, steps that raised.

    :param abort_at: request id -> number of ``step()`` calls after which it is aborted.
    :param fault_steps: calls before which ``arm()`` makes the next step raise once.
    """
    for rid, prompt, params in requests:
        engine.add_request(prompt, params, request_id=rid)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    reasons: dict[str, str | None] = {}
    calls = raised = 0
    while engine.has_unfinished_requests():
        if calls in fault_steps:
            arm()
        try:
            outs = engine.step()
        except Fault:
            raised += 1
            engine.scheduler.check_invariants()
            outs = []
        for o in outs:
            assert o.request_id not in reasons, f"{o.request_id} reported after it finished"
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        calls += 1
        for rid, at in (abort_at or {}).items():
            if calls == at:
                engine.abort_request(rid)
        assert calls < 1000
    kv = engine.kv_manager
    engine.scheduler.check_invariants()
    assert kv.num_used_pages == 0 and kv.num_live_slots == 0
    assert len(engine.structured_output) == 0  # every matcher let go
    return tokens, reasons, raised


def text(engine: Engine, tokens: list[int]) -> str:
    """The text of a request's tokens, without the end of sequence it stopped on."""
    if tokens and tokens[-1] in engine.eos_token_ids:
        tokens = tokens[:-1]
    return engine.executor.driver.tokenizer.decode(tokens)


def check_grammars(engine: Engine, tokens: dict[str, list[int]], reasons: dict) -> None:
    """The constrained requests' texts are sentences of their grammars (when they stopped)."""
    assert text(engine, tokens["choice"]) in CHOICES
    assert re.fullmatch(REGEX, text(engine, tokens["regex"]))
    if reasons["json"] == "stop":
        value = json.loads(text(engine, tokens["json"]))
        assert set(value) == {"ok", "n"} and value["n"] in (1, 2, 3)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_grammar_rows_give_the_sync_output_with_overlapping_steps(temperature):
    reqs = mixed_requests(temperature)
    sync_e = make_engine(False)
    want_tokens, want_reasons, _ = drive(sync_e, reqs)
    check_grammars(sync_e, want_tokens, want_reasons)
    assert want_reasons["choice"] == want_reasons["regex"] == "stop"

    e = make_engine(True)
    tokens, reasons, _ = drive(e, reqs)
    assert tokens == want_tokens
    assert reasons == want_reasons


def test_forwards_start_before_the_step_in_flight_is_committed():
    """With grammars live, step N+1's forward runs before step N is committed, and its
    sampling after: every grammar row then has its previous token on the host."""
    e = make_engine(True)
    events: list[str] = []
    execute, commit, sample = e.executor.execute_model, e.scheduler.commit, e.sample
    overlapped = grammar_forwards = 0

    def watched_execute(inputs):
        nonlocal overlapped, grammar_forwards
        if len(e.structured_output):
            grammar_forwards += 1
            overlapped += e._inflight is not None
        events.append("forward")
        return execute(inputs)

    def watched_commit(*args, **kwargs):
        events.append("commit")
        return commit(*args, **kwargs)

    def watched_sample(hidden, inputs, reqs, *args, **kwargs):
        constrained = [r for r in reqs if r.request_id in e.structured_output]
        # a grammar row's mask is filled from its committed tokens only
        assert not any(r.has_pending_token for r in constrained)
        events.append("sample")
        return sample(hidden, inputs, reqs, *args, **kwargs)

    e.executor.execute_model = watched_execute
    e.scheduler.commit = watched_commit
    e.sample = watched_sample
    reqs = mixed_requests(0.0)
    tokens, _, _ = drive(e, reqs)

    want, _, _ = drive(make_engine(False), reqs)
    assert tokens == want
    # every forward but the very first found the step before it still uncommitted
    assert grammar_forwards > 10
    assert overlapped == grammar_forwards - 1
    # and a grammar step's pattern: forward (N+1), commit (N), then sample (N+1)
    assert "forward,commit,sample" in ",".join(events)


def test_abort_of_a_grammar_request_while_its_token_is_in_flight():
    reqs = mixed_requests(0.9)
    want, _, _ = drive(make_engine(False), [r for r in reqs if r[0] != "json"])
    e = make_engine(True)
    tokens, reasons, _ = drive(e, reqs, abort_at={"json": 4})
    assert reasons["json"] == "abort"
    assert len(tokens["json"]) <= 4
    for rid in want:
        assert tokens[rid] == want[rid], rid


def test_a_grammar_that_completes_mid_batch_ends_its_request_alone():
    """Choice grammars finish long before the free requests beside them; with ignore_eos the
    engine ends them when the grammar completes, in the middle of overlapping steps."""
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reqs = [
        ("free0", [5, 6, 7], free),
        (
            "short",
            [9],
            SamplingParams(
                max_tokens=30,
                temperature=0.9,
                seed=3,
                ignore_eos=True,
                structured_outputs={"choice": ["red", "green"]},
            ),
        ),
        ("free1", [40, 41, 42, 43], free),
        (
            "stop",
            [8, 8],
            SamplingParams(max_tokens=30, temperature=0.0, structured_outputs={"choice": CHOICES}),
        ),
    ]
    alone, _, _ = drive(make_engine(False), [r for r in reqs if r[0].startswith("free")])
    want, want_reasons, _ = drive(make_engine(False), reqs)
    e = make_engine(True)
    tokens, reasons, _ = drive(e, reqs)
    assert tokens == want and reasons == want_reasons
    assert reasons == {"free0": "length", "short": "stop", "free1": "length", "stop": "stop"}
    assert text(e, tokens["short"]) in ("red", "green")
    assert tokens["short"][-1] in e.eos_token_ids
    assert text(e, tokens["stop"]) in CHOICES
    for rid in alone:
        assert tokens[rid] == alone[rid]


def test_nothing_is_in_flight_once_a_grammar_request_got_its_final_output():
    """The step launched beside the commit that finished the last grammar request is
    dropped unsampled: when its final output is returned the engine is idle."""
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_outputs={"choice": CHOICES})
    want, want_reasons, _ = drive(make_engine(False), [("c", [8, 8], params)])
    assert want_reasons == {"c": "stop"}
    e = make_engine(True)
    e.add_request([8, 8], params, request_id="c")
    tokens: list[int] = []
    for _ in range(100):
        outs = e.step()
        tokens += [t for o in outs for t in o.new_token_ids]
        if any(o.finished for o in outs):
            break
    assert tokens == want["c"]
    assert e._inflight is None
    assert not e.has_unfinished_requests()


def test_n_samples_with_a_grammar_give_the_sync_output():
    from backplane import LLM

    params = [
        SamplingParams(
            n=3, max_tokens=20, temperature=1.0, seed=7, structured_outputs={"regex": r"[0-9]{4}"}
        ),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    ]
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(
            "tiny-llama",
            device="cpu",
            max_num_seqs=6,
            max_num_tokens=48,
            page_size=4,
            num_kv_pages=128,
            async_scheduling=async_scheduling,
        )
        outs = llm.generate(["n", "free"], params)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
        samples = [c.text for c in outs[0].outputs]
        assert len(samples) == 3 and all(re.fullmatch(r"[0-9]{4}", t) for t in samples)
        assert len(llm.engine.structured_output) == 0
        llm.shutdown()
    assert runs[0] == runs[1]


class Once:
    """Wraps a callable so that, once armed, its next call raises (before or after it runs)."""

    def __init__(self, fn, *, after: bool = False) -> None:
        self.fn = fn
        self.after = after
        self.armed = False
        self.fired = 0

    def arm(self) -> None:
        self.armed = True

    def __call__(self, *args, **kwargs):
        if self.armed and not self.after:
            self.armed = False
            self.fired += 1
            raise Fault("injected before the call")
        out = self.fn(*args, **kwargs)
        if self.armed:
            self.armed = False
            self.fired += 1
            raise Fault("injected after the call")
        return out


@pytest.mark.parametrize("where", ["forward", "sampling"])
def test_a_failed_step_with_grammar_rows_is_undone(where):
    """A fault in sampling comes after the launch committed the step before it; one in the
    forward comes before. Either way the run goes on with the undisturbed run's tokens."""
    reqs = mixed_requests(0.9)
    want, want_reasons, _ = drive(make_engine(False), reqs)
    e = make_engine(True)
    if where == "forward":
        fault = e.runner.run = Once(e.runner.run, after=True)
    else:
        fault = e.sampler.sample = Once(e.sampler.sample)
    tokens, reasons, raised = drive(e, reqs, fault_steps=(0, 4, 9, 15), arm=fault.arm)
    assert raised == fault.fired >= 3
    assert tokens == want
    assert reasons == want_reasons
