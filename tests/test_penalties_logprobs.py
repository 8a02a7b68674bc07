"""Penalties, ``min_tokens`` and logprobs: the vectorised sampler against naive references,
and the engine end to end (sync and async scheduling give the same tokens and logprobs)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from backplane import LLM
from backplane.core.errors import InvalidFieldError
from backplane.engine.sampling import (
    LogitsProcessing,
    Sampler,
    SamplingParams,
    SamplingRows,
    TokenPairs,
    apply_processing,
    compute_logprobs,
    logprob_dicts,
)

TORCH_BACKENDS = {"attention": "torch"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_tokens": -1},
        {"min_tokens": 1.0},
        {"min_tokens": 17},  # more than max_tokens=16
        {"presence_penalty": 2.5},
        {"presence_penalty": "1"},
        {"frequency_penalty": -2.1},
        {"frequency_penalty": float("nan")},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("inf")},
        {"repetition_penalty": True},
        {"logprobs": -1},
        {"logprobs": 21},
        {"logprobs": 1.5},
        {"logprobs": True},
    ],
)
def test_new_fields_are_validated(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(InvalidFieldError, match=name) as exc:
        SamplingParams(**kwargs)
    assert exc.value.field == name


def test_new_fields_accept_their_ranges():
    p = SamplingParams(
        min_tokens=16,
        presence_penalty=-2,
        frequency_penalty=np.float32(2.0),
        repetition_penalty=np.int64(3),
        logprobs=np.int32(20),
    )
    assert (p.min_tokens, p.presence_penalty, p.frequency_penalty) == (16, -2.0, 2.0)
    assert (p.repetition_penalty, p.logprobs) == (3.0, 20)
    assert type(p.logprobs) is int and type(p.presence_penalty) is float
    assert p.has_penalties and not SamplingParams().has_penalties


def _naive_penalties(logits, params, outputs, prompts, suppress):
    """Per row and per token, as HF / vLLM / OpenAI describe the penalties."""
    x = logits.double().clone()
    for i, p in enumerate(params):
        counts: dict[int, int] = {}
        for t in outputs[i]:
            counts[t] = counts.get(t, 0) + 1
        seen = set(counts) | set(prompts[i])
        for t in range(x.shape[1]):
            v = float(x[i, t])
            if t in seen:
                v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            c = counts.get(t, 0)
            v -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
            if t in suppress[i]:
                v = -math.inf
            x[i, t] = v
    return x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_match_naive_reference(seed):
    g = torch.Generator().manual_seed(seed)
    n, vocab = 6, 40
    logits = torch.randn(n, vocab, generator=g) * 3
    rng = np.random.default_rng(seed)
    g0 = {"temperature": 0}
    params = [
        SamplingParams(**g0),  # no penalty: untouched
        SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4, **g0),
        SamplingParams(repetition_penalty=1.8, **g0),
        SamplingParams(repetition_penalty=0.6, frequency_penalty=1.1, presence_penalty=-1.5, **g0),
        SamplingParams(frequency_penalty=2.0, min_tokens=3, **g0),
        SamplingParams(min_tokens=5, **g0),
    ]
    outputs = [rng.integers(0, vocab, rng.integers(0, 12)).tolist() for _ in range(n)]
    prompts = [rng.integers(0, vocab, rng.integers(1, 9)).tolist() for _ in range(n)]
    suppress = [set(), set(), set(), set(), {3, 7}, {0, 39}]
    pen = np.array([i for i, p in enumerate(params) if p.has_penalties])
    # the last output token of penalty row 1 (its second) is still on the device
    out_lists = [np.array(outputs[i][:-1] if k == 1 else outputs[i]) for k, i in enumerate(pen)]
    rep = [k for k, i in enumerate(pen) if params[i].repetition_penalty != 1.0]
    assert outputs[pen[1]], "the test needs an output token on the device"
    proc = LogitsProcessing(
        penalty_rows=pen,
        output=TokenPairs(
            np.repeat(np.arange(len(pen)), [len(o) for o in out_lists]),
            np.concatenate(out_lists).astype(np.int64),
        ),
        pending=(torch.tensor([1]), torch.tensor([outputs[pen[1]][-1]])),
        prompt=TokenPairs(
            np.repeat(np.array(rep), [len(prompts[pen[k]]) for k in rep]),
            np.concatenate([prompts[pen[k]] for k in rep]).astype(np.int64),
        ),
        suppress=TokenPairs(np.array([4, 4, 5, 5]), np.array([3, 7, 0, 39])),
    )
    rows = SamplingRows(params, np.zeros(n, np.int64), np.zeros(n, np.int64), processing=proc)
    got = apply_processing(logits, rows)
    want = _naive_penalties(logits, params, outputs, prompts, suppress)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
    # greedy sampling picks the argmax of the processed logits
    out = Sampler().sample_rows(logits, rows)
    assert out.tokens.tolist() == want.argmax(dim=1).tolist()
    assert out.logprobs is None


def test_logprobs_match_float64_log_softmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 60, generator=g) * 4
    tokens = torch.tensor([0, 17, 59, 3, 3])
    lp = compute_logprobs(logits, tokens, 4)
    ref = torch.log_softmax(logits.double(), dim=-1)
    ks = [4, 0, None, 2, 4]
    dicts = logprob_dicts(lp.token_ids.numpy(), lp.logprobs.numpy(), lp.ranks.numpy(), ks)
    for i, (k, d) in enumerate(zip(ks, dicts, strict=True)):
        if k is None:
            assert d is None
            continue
        order = ref[i].argsort(descending=True).tolist()
        t = int(tokens[i])
        want = {t: (float(ref[i, t]), order.index(t) + 1)}
        for r, tok in enumerate(order[:k]):
            want.setdefault(tok, (float(ref[i, tok]), r + 1))
        assert set(d) == set(want)
        for tok, (v, rank) in want.items():
            assert d[tok].logprob == pytest.approx(v, abs=1e-5)
            assert d[tok].rank == rank


@pytest.fixture(scope="module")
def llm():
    with LLM(
        "tiny-llama",
        device="cpu",
        max_num_seqs=4,
        max_num_tokens=32,
        page_size=4,
        num_kv_pages=128,
        backends=TORCH_BACKENDS,
    ) as m:
        yield m


def _generate(llm, prompts, params, async_scheduling):
    llm.engine.async_scheduling = async_scheduling
    try:
        return llm.generate(prompts, params)
    finally:
        llm.engine.async_scheduling = True


def _penalty(p: SamplingParams, counts: dict[int, int], t: int) -> float:
    n = counts.get(t, 0)
    return p.frequency_penalty * n + p.presence_penalty * (n > 0)


PROMPTS = [[5, 9, 5, 9, 5, 9, 11], [3, 4, 5], [100, 101, 102, 103, 104]]


def test_engine_presence_frequency_penalties_and_logprobs(llm):
    """Greedy with presence / frequency penalties picks, at every step, the token that beats
    every returned top-20 token once their logprobs are penalised by the counts so far; sync and
    async scheduling agree on tokens and logprobs."""
    params = [
        SamplingParams(max_tokens=12, temperature=0, presence_penalty=1.5, logprobs=20),
        SamplingParams(max_tokens=12, temperature=0, frequency_penalty=0.9, logprobs=20),
        SamplingParams(max_tokens=12, temperature=0, logprobs=20),
    ]
    outs = _generate(llm, PROMPTS, params, True)
    again = _generate(llm, PROMPTS, params, False)
    for o, a, p in zip(outs, again, params, strict=True):
        c = o.outputs[0]
        assert c.token_ids == a.outputs[0].token_ids
        assert len(c.logprobs) == len(c.token_ids) == 12
        counts: dict[int, int] = {}
        for tok, d, d2 in zip(c.token_ids, c.logprobs, a.outputs[0].logprobs, strict=True):
            assert d.keys() == d2.keys()
            assert all(d[t].logprob == pytest.approx(d2[t].logprob, abs=1e-5) for t in d)
            assert tok in d and 20 <= len(d) <= 21
            assert sorted(v.rank for t, v in d.items() if t != tok or len(d) == 20)[:20] == list(
                range(1, 21)
            )
            best = d[tok].logprob - _penalty(p, counts, tok)
            for t, v in d.items():
                assert best >= v.logprob - _penalty(p, counts, t) - 1e-4, (t, tok)
            counts[tok] = counts.get(tok, 0) + 1
        if not p.has_penalties:
            assert all(d[t].rank == 1 for t, d in zip(c.token_ids, c.logprobs, strict=True))
    # to_dict stays JSON-ready with logprobs
    back = json.loads(json.dumps(outs[0].to_dict()))["outputs"][0]["logprobs"]
    first = outs[0].outputs[0].logprobs
    assert [{int(t): v["logprob"] for t, v in pos.items()} for pos in back] == [
        {t: v.logprob for t, v in pos.items()} for pos in first
    ]


def test_engine_repetition_penalty_sync_equals_async(llm):
    params = SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.7)
    plain = _generate(llm, PROMPTS, SamplingParams(max_tokens=10, temperature=0), True)
    a = _generate(llm, PROMPTS, params, True)
    b = _generate(llm, PROMPTS, params, False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in plain]
    assert all(o.outputs[0].logprobs is None for o in a)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_min_tokens_suppresses_stop_ids(llm, async_scheduling):
    first = _generate(llm, PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0), True)
    stop = first[0].token_ids[0]
    params = SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop])
    stopped = _generate(llm, PROMPTS[:1], params, async_scheduling)[0]
    assert stopped.token_ids == [stop] and stopped.finish_reason == "stop"
    held = SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop], min_tokens=3)
    out = _generate(llm, PROMPTS[:1], held, async_scheduling)[0]
    assert len(out.token_ids) >= 3
    assert stop not in out.token_ids[:3]


class _Head:
    """A sampling head whose captured graphs exist for every bucket; records replays."""

    def __init__(self) -> None:
        self.replays = 0

    def has(self, bucket: int) -> bool:
        return True

    def sample(self, bucket: int, rows: SamplingRows) -> torch.Tensor:
        self.replays += 1
        return torch.zeros(len(rows), dtype=torch.int64)


@pytest.mark.parametrize(
    ("extra", "replayed"),
    [
        ({}, True),
        ({"logprobs": 0}, False),
        ({"min_tokens": 2}, False),
        ({"presence_penalty": 0.5}, False),
        ({"repetition_penalty": 1.2}, False),
    ],
)
def test_decode_graph_steps_that_need_more_sample_eagerly(extra, replayed):
    """Rows asking for penalties, min_tokens or logprobs skip the captured sampling graph and
    sample eagerly from the decode graph's logits."""
    from types import SimpleNamespace

    from backplane.core.metadata import StepMode
    from backplane.engine.worker.graph.runner import GraphModelRunner

    runner = GraphModelRunner.__new__(GraphModelRunner)
    runner.head = _Head()
    runner.sampler = Sampler()
    runner.model = None  # the graph's logits are reused: no LM head runs
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=g)
    inputs = SimpleNamespace(
        mode=StepMode.decode_graph(4),
        sample_seqs=np.arange(3),
        logits_indices=torch.arange(3),
        logits=logits,
    )
    params = [SamplingParams(temperature=0, **extra)] * 3
    n = len(params)
    proc = None
    if params[0].has_penalties or params[0].min_tokens:
        proc = LogitsProcessing(suppress=TokenPairs(np.array([0]), np.array([5])))
    rows = SamplingRows(
        params,
        np.zeros(n, np.int64),
        np.zeros(n, np.int64),
        processing=proc,
        num_logprobs=-1 if params[0].logprobs is None else params[0].logprobs,
    )
    out = runner.sample(torch.empty(4, 8), inputs, rows)
    assert runner.head.replays == int(replayed)
    if not replayed:
        want = apply_processing(logits[:3], rows).argmax(dim=1)
        assert out.tokens.tolist() == want.tolist()
    assert (out.logprobs is not None) == ("logprobs" in extra)
