"""A failed step leaves nothing half-done: faults injected in the forward, in sampling and in
the host-tier copies, on every preset (hybrid ones included), synchronous and asynchronous.

After the exception the engine is stepped on; every request must produce exactly the tokens
of an undisturbed run of the same requests, aborts must still be reported, and the pages,
state slots and host claims must all come back.
"""

from __future__ import annotations

import numpy as np
import pytest

from backplane.core.hookspecs import FAMILIES
from backplane.engine.engine import Engine
from backplane.engine.sampling import SamplingParams

PRESETS = ["tiny-llama", "tiny-nemotron-h", "tiny-deepseek-v3", "tiny-qwen3-next"]
HYBRIDS = ["tiny-nemotron-h", "tiny-qwen3-next"]
TORCH_BACKENDS = dict.fromkeys(FAMILIES, "torch")


class Fault(RuntimeError):
    """The injected error."""


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(model: str, **kw) -> Engine:
    cfg = dict(
        model=model,
        device="cpu",
        max_num_seqs=4,
        max_num_tokens=24,
        page_size=4,
        num_kv_pages=64,
        backends=TORCH_BACKENDS,
    )
    cfg.update(kw)
    return Engine(**cfg)


def workload() -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy and seeded requests of several lengths (chunked prefills, decodes, a stop id)."""
    rng = np.random.default_rng(0)
    out = []
    for i, n in enumerate([3, 30, 9, 17, 5]):
        prompt = rng.integers(3, 300, n).tolist()
        sample = i % 2 == 1
        params = SamplingParams(
            max_tokens=int(rng.integers(4, 9)),
            temperature=0.8 if sample else 0.0,
            top_k=20 if sample else 0,
            seed=100 + i if sample else None,
            ignore_eos=True,
        )
        out.append((f"r{i}", prompt, params))
    return out


def drive(engine: Engine, requests, *, fault_steps=(), arm=None, abort=None, max_steps=400):
    """Run ``requests`` to the end; before each step in ``fault_steps`` call ``arm()`` (which
    makes the next step raise once). ``abort``: (step, request id) aborted before that step.

    :return: tokens and finish reasons per request, and the number of steps that raised.
    """
    for rid, prompt, params in requests:
        engine.add_request(prompt, params, request_id=rid)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    reasons: dict[str, str] = {}
    raised = 0
    for i in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        if abort is not None and i == abort[0]:
            assert engine.abort_request(abort[1])
        if i in fault_steps:
            arm()
        try:
            outs = engine.step()
        except Fault:
            raised += 1
            engine.scheduler.check_invariants()
            continue
        for o in outs:
            assert o.request_id not in reasons, "output after the final one"
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert not engine.has_unfinished_requests()
    return tokens, reasons, raised


def assert_clean(engine: Engine) -> None:
    kv = engine.kv_manager
    engine.scheduler.check_invariants()
    assert kv.num_used_pages == 0 and kv.num_live_slots == 0
    assert (kv.pool.ref_counts == 0).all()
    if kv.host is not None:
        assert kv.host.num_claimed() == 0


class Once:
    """Wraps a callable so that, once armed, its next call raises (before or after it runs)."""

    def __init__(self, fn, *, after: bool = False) -> None:
        self.fn = fn
        self.after = after
        self.armed = False
        self.fired = 0
        self.fired_with: list[dict] = []
        self.only = None  # a predicate on the keyword arguments of the calls that may fail

    def arm(self) -> None:
        self.armed = True

    def __call__(self, *args, **kwargs):
        if self.armed and self.only is not None and not self.only(kwargs):
            return self.fn(*args, **kwargs)
        if self.armed and not self.after:
            self.armed = False
            self.fired += 1
            self.fired_with.append(kwargs)
            raise Fault("injected before the call")
        out = self.fn(*args, **kwargs)
        if self.armed:
            self.armed = False
            self.fired += 1
            raise Fault("injected after the call")
        return out


def inject(engine: Engine, where: str) -> Once:
    """Install a fault at ``where`` in ``engine``; return it (disarmed)."""
    if where == "forward":  # the whole forward ran (caches and states written), then it fails
        f = Once(engine.runner.run, after=True)
        engine.runner.run = f
    elif where == "mid_forward":  # half the layers ran
        kinds = ("DecoderLayer", "NemotronHBlock")
        layers = [m for m in engine.model.modules() if type(m).__name__ in kinds]
        assert len(layers) >= 3, [type(m).__name__ for m in engine.model.modules()]
        f = Once(lambda: None)

        def hook(module, args):
            f()

        layers[len(layers) // 2].register_forward_pre_hook(hook)
    elif where == "sampling":
        f = Once(engine.sampler.sample)
        engine.sampler.sample = f
    elif where == "host_copy":
        host = engine.kv_manager.host
        assert host is not None
        f = Once(host._copy)
        host._copy = f
    else:
        raise AssertionError(where)
    return f


_REFERENCE: dict[tuple[str, bool], tuple[dict, dict]] = {}


def reference(model: str, async_: bool):
    key = (model, async_)
    if key not in _REFERENCE:
        e = make_engine(model, async_scheduling=async_)
        tokens, reasons, _ = drive(e, workload())
        _REFERENCE[key] = (tokens, reasons)
    return _REFERENCE[key]


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["forward", "mid_forward", "sampling"])
@pytest.mark.parametrize("model", PRESETS)
def test_failed_steps_are_undone(model, where, async_):
    want_tokens, want_reasons = reference(model, async_)
    e = make_engine(model, async_scheduling=async_)
    fault = inject(e, where)
    # a fault in the first step (all prefills), one among decodes, one late
    tokens, reasons, raised = drive(e, workload(), fault_steps=(0, 4, 9), arm=fault.arm)
    assert raised == fault.fired >= 2
    assert reasons == want_reasons
    assert tokens == want_tokens
    assert_clean(e)


@pytest.mark.parametrize("model", HYBRIDS)
def test_recurrent_state_of_other_requests_survives_a_failed_sampling(model):
    """The probe's case: the forward advanced every sequence's state, then sampling failed."""
    want_tokens, _ = reference(model, False)
    e = make_engine(model)
    fault = inject(e, "sampling")
    fault.after = True
    tokens, _, raised = drive(e, workload(), fault_steps=(6,), arm=fault.arm)
    assert raised == 1
    assert tokens == want_tokens


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_abort_reports_survive_a_failed_step(async_):
    want_tokens, _ = reference("tiny-nemotron-h", async_)
    e = make_engine("tiny-nemotron-h", async_scheduling=async_)
    fault = inject(e, "sampling")
    # r1 is aborted just before a step that fails: its final output must still come
    tokens, reasons, raised = drive(e, workload(), fault_steps=(3,), arm=fault.arm, abort=(3, "r1"))
    assert raised == 1
    assert reasons["r1"] == "abort"
    assert {r: t for r, t in tokens.items() if r != "r1"} == {
        r: t for r, t in want_tokens.items() if r != "r1"
    }
    assert_clean(e)


@pytest.mark.parametrize("model", PRESETS)
def test_a_step_that_keeps_failing_finishes_its_requests_with_an_error(model):
    e = make_engine(model)
    always = Once(e.sampler.sample)
    e.sampler.sample = always
    e.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0.0), request_id="a")
    raised = 0
    outs = []
    for _ in range(20):
        if not e.has_unfinished_requests():
            break
        always.arm()
        try:
            outs += e.step()
        except Fault:
            raised += 1
    assert raised == e.scheduler.max_step_failures
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "error")]
    assert_clean(e)
    # the engine still serves, and the id is free again
    always.armed = False
    again = ("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0.0))
    tokens, reasons, _ = drive(e, [again])
    assert reasons == {"a": "length"} and len(tokens["a"]) == 4


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-next"])
def test_a_request_that_always_fails_does_not_take_the_others_with_it(model, async_):
    """Sampling raises whenever one request is in the batch: it alone ends with "error"."""
    want_tokens, want_reasons = reference(model, async_)
    e = make_engine(model, async_scheduling=async_)
    sample = e.sampler.sample
    poison = SamplingParams(max_tokens=5, temperature=1.0, seed=666, ignore_eos=True)

    def failing(logits, params, *args, **kwargs):
        if any(p is poison for p in params):
            raise Fault("this request breaks every step it is in")
        return sample(logits, params, *args, **kwargs)

    e.sampler.sample = failing
    requests = workload()
    requests.insert(2, ("bad", [9, 8, 7, 6, 5, 4], poison))
    tokens, reasons, raised = drive(e, requests)
    assert reasons.pop("bad") == "error" and tokens.pop("bad") == []
    assert raised >= e.scheduler.max_step_failures
    assert reasons == want_reasons
    assert tokens == want_tokens
    assert_clean(e)


# -- the host tier: copies out (offload) and back (onboard) ---------------------------------------


def host_tier_engine(model: str, **kw) -> Engine:
    # few device pages and a host tier: shared prefixes are evicted, offloaded and onboarded
    return make_engine(model, num_kv_pages=14, host_kv_memory=1 << 20, **kw)


def host_workload() -> list[tuple[str, list[int], SamplingParams]]:
    rng = np.random.default_rng(1)
    heads = [rng.integers(3, 300, 16).tolist() for _ in range(3)]
    out = []
    for i in range(9):
        prompt = heads[i % 3] + rng.integers(3, 300, 2).tolist()
        out.append(
            (f"h{i}", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        )
    return out


def drive_in_waves(engine: Engine, requests, fault: Once | None = None):
    """One request at a time, so that later ones find earlier prefixes in the host tier;
    with ``fault``, copies to the host fail in one wave, copies back in the next."""
    tokens = {}
    for i, r in enumerate(requests):
        steps = (0, 1) if fault is not None else ()
        if fault is not None:
            fault.only = lambda kw, out=i % 2 == 0: kw["to_host"] is out
        t, _, _ = drive(engine, [r], fault_steps=steps, arm=fault.arm if fault else None)
        if fault is not None:
            fault.armed = False
        tokens.update(t)
    return tokens


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3"])
def test_host_tier_copy_failures_cost_reuse_not_correctness(model):
    e = host_tier_engine(model)
    want = drive_in_waves(e, host_workload())
    assert e.kv_manager.stats.onboarded_pages > 0 and e.kv_manager.stats.offloaded_pages > 0

    e = host_tier_engine(model)
    fault = inject(e, "host_copy")
    tokens = drive_in_waves(e, host_workload(), fault)
    directions = {kw["to_host"] for kw in fault.fired_with}
    assert directions == {True, False}, "both an offload and an onboard failed"
    assert tokens == want
    assert_clean(e)
