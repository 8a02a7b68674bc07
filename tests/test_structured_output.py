"""Structured output: the grammar bitmask in the sampler, and constrained generation end to end.

The tiny model is random, so whatever it produces that fits a grammar fits it
because the mask made it; sampling at temperature 1 with several seeds shows
the mask holds for every draw, not only for the most likely token.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install -e '.[dev]')")

from backplane import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from backplane.core.errors import InvalidFieldError  # noqa: E402
from backplane.engine.sampling import (  # noqa: E402
    GrammarBitmask,
    Sampler,
    SamplingRows,
    apply_token_bitmask,
)
from backplane.engine.structured_output import GrammarCompiler  # noqa: E402

CONFIG = dict(device="cpu", max_num_seqs=4, max_num_tokens=64, page_size=4, num_kv_pages=256)

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "color"],
    "additionalProperties": False,
}


def _valid(value: object) -> bool:
    """SCHEMA checked by hand (jsonschema is not a dependency)."""
    return (
        isinstance(value, dict)
        and set(value) == {"ok", "color"}
        and isinstance(value["ok"], bool)
        and value["color"] in ("red", "green", "blue")
    )


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", **CONFIG)


# -- the mask in the sampler ---------------------------------------------------------------------


def _allowed_by_hand(words: np.ndarray, vocab: int) -> np.ndarray:
    """Which tokens a bitmask row allows, bit by bit in Python ints."""
    out = np.zeros(vocab, dtype=bool)
    for t in range(min(vocab, 32 * len(words))):
        word = int(words[t // 32]) & 0xFFFFFFFF
        out[t] = bool((word >> (t % 32)) & 1)
    return out


def _poisoned_case(seed: int, n: int, vocab: int, words: int):
    g = np.random.default_rng(seed)
    rows = np.array([0, 2, 3, 5], dtype=np.int64)[: n - 2]
    bits = g.integers(-(2**31), 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    bits[0, :] = 0
    bits[0, 1] = np.int32(-(2**31))  # only token 63: bit 31, the sign bit
    allowed = np.stack([_allowed_by_hand(b, vocab) for b in bits])
    logits = torch.from_numpy(g.normal(size=(n, vocab)).astype(np.float32))
    # poison: every token a grammar refuses outranks every token it allows
    for j, r in enumerate(rows):
        logits[r, torch.from_numpy(~allowed[j])] = 1e30
    return rows, torch.from_numpy(bits), allowed, logits


@pytest.mark.parametrize("vocab,words", [(100, 4), (130, 4), (64, 2)])
def test_the_mask_sets_exactly_the_refused_tokens_to_minus_inf(vocab, words):
    rows, bits, allowed, logits = _poisoned_case(0, 6, vocab, words)
    before = logits.clone()
    out = apply_token_bitmask(logits, GrammarBitmask(rows, bits))
    assert torch.equal(logits, before)  # the input is left as it was
    for r in range(logits.shape[0]):
        if r in rows:
            ok = torch.from_numpy(allowed[list(rows).index(r)])
            assert torch.all(out[r][~ok] == float("-inf"))
            assert torch.equal(out[r][ok], before[r][ok])
        else:
            assert torch.equal(out[r], before[r])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.5, top_k=50, top_p=0.9, min_p=0.01),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=1.0),
    ],
)
def test_sampled_tokens_are_always_allowed_even_when_refused_ones_are_far_likelier(params):
    n, vocab, words = 6, 100, 4
    sampler = Sampler()
    proc = None
    if params.has_penalties:
        from backplane.engine.step_rows import _processing  # the engine's own inputs

        class _Req:
            stop_token_ids = frozenset()
            has_pending_token = False
            num_output_tokens = 0
            output_token_ids = np.zeros(0, np.int64)
            prompt_token_ids = np.arange(5, dtype=np.int64)
            sampling_params = params

        proc = _processing([_Req()] * n, [params] * n, np.zeros(n, np.int64), None)
    for seed in range(8):
        rows, bits, allowed, logits = _poisoned_case(seed, n, vocab, words)
        offsets = np.arange(n, dtype=np.int64)
        seeds = np.arange(n, dtype=np.int64) + seed
        base = SamplingRows([params] * n, seeds, offsets, processing=proc)
        plain = sampler.sample_rows(logits, base).tokens
        grammar = GrammarBitmask(rows, bits)
        sr = SamplingRows([params] * n, seeds, offsets, processing=proc, grammar=grammar)
        tokens = sampler.sample_rows(logits, sr).tokens.tolist()
        for j, r in enumerate(rows):
            assert allowed[j][tokens[r]], (seed, r, tokens[r])
        assert tokens[rows[0]] == 63  # the one token its mask allows
        for r in set(range(n)) - set(rows.tolist()):
            assert tokens[r] == int(plain[r])  # rows without a grammar sample as before
        # without the mask the poison wins: the test can tell a skipped mask
        assert any(not allowed[j][int(plain[r])] for j, r in enumerate(rows))


def test_rows_with_a_grammar_take_the_eager_sampling_path():
    rows = SamplingRows([SamplingParams()], np.zeros(1, np.int64), np.zeros(1, np.int64))
    assert not rows.needs_eager
    masked = SamplingRows(
        rows.params,
        rows.seeds,
        rows.offsets,
        grammar=GrammarBitmask(np.zeros(1, np.int64), torch.zeros(1, 4, dtype=torch.int32)),
    )
    assert masked.needs_eager


# -- end to end on the tiny model ----------------------------------------------------------------


def _texts(llm, prompts, params):
    return [c for o in llm.generate(prompts, params) for c in o.outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_output_matches_whole(llm, temperature):
    pattern = r"[ab]{2,4}-\d{3}(x|yz)"
    for seed in range(3):
        params = SamplingParams(
            max_tokens=40, temperature=temperature, seed=seed, structured_outputs={"regex": pattern}
        )
        for out in _texts(llm, ["hello", "zzz", "a b c"], params):
            assert re.fullmatch(pattern, out.text), out.text
            assert out.finish_reason == "stop"
            assert llm.engine.eos_token_ids[0] not in out.token_ids[:-1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choice_output_is_one_of_the_list(llm, temperature):
    choices = ["yes", "no", 'maybe "so"', "é\n"]
    seen = set()
    for seed in range(6):
        params = SamplingParams(
            max_tokens=20,
            temperature=temperature,
            seed=seed,
            structured_outputs={"choice": choices},
        )
        for out in _texts(llm, ["q1", "q2"], params):
            assert out.text in choices
            seen.add(out.text)
    if temperature:
        assert len(seen) > 1  # sampling, not one forced answer


def test_grammar_output_is_a_sentence_of_it(llm):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(4):
        params = SamplingParams(
            max_tokens=60, temperature=1.0, seed=seed, structured_outputs={"grammar": grammar}
        )
        for out in _texts(llm, ["calc"], params):
            assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", out.text), out.text


def test_json_schema_output_parses_and_validates(llm):
    done = 0
    for seed in range(6):
        params = SamplingParams(
            max_tokens=200, temperature=1.0, seed=seed, structured_outputs={"json": SCHEMA}
        )
        for out in _texts(llm, ["{"], params):
            if out.finish_reason == "length":
                # whitespace between JSON tokens is free: a random model may run out of tokens
                continue
            assert _valid(json.loads(out.text)), out.text
            done += 1
    assert done >= 3


def test_json_object_output_is_an_object(llm):
    done = 0
    for seed in range(6):
        params = SamplingParams(
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            structured_outputs=StructuredOutputsParams(json_object=True),
        )
        for out in _texts(llm, ["x"], params):
            if out.finish_reason == "length":
                continue
            assert isinstance(json.loads(out.text), dict), out.text
            done += 1
    assert done >= 2


def test_n_samples_each_follow_the_grammar(llm):
    params = SamplingParams(
        n=3, max_tokens=20, temperature=1.0, seed=7, structured_outputs={"regex": r"[0-9]{4}"}
    )
    (out,) = llm.generate(["n"], params)
    assert len(out.outputs) == 3
    texts = [c.text for c in out.outputs]
    assert all(re.fullmatch(r"[0-9]{4}", t) for t in texts), texts
    assert len(set(texts)) > 1


def test_constrained_and_free_requests_share_batches(llm):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = _texts(llm, ["free one", "free two"], free)
    mixed = llm.generate(
        ["free one", "c", "free two"],
        [free, SamplingParams(max_tokens=30, structured_outputs={"regex": "[xy]{5}"}), free],
    )
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2])] == [a.token_ids for a in alone]
    assert re.fullmatch("[xy]{5}", mixed[1].outputs[0].text)


def test_async_scheduling_gives_the_sync_run_output():
    prompts = ["alpha", "beta", "gamma", "delta", "eps"]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, structured_outputs={"regex": r"[a-f]{3,9}"}),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=30, temperature=0.0, structured_outputs={"choice": ["on", "off"]}
        ),
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=40, temperature=1.0, seed=3, structured_outputs={"regex": r"\d+"}
        ),
    ]
    results = []
    for async_scheduling in (False, True):
        run = LLM("tiny-llama", async_scheduling=async_scheduling, **CONFIG)
        assert run.engine.async_scheduling is async_scheduling
        results.append([o.outputs[0].token_ids for o in run.generate(prompts, params)])
        assert len(run.engine.structured_output) == 0  # every matcher let go
        run.shutdown()
    assert results[0] == results[1]


def test_bad_constraints_are_refused_with_the_field_and_nothing_queued(llm):
    bad = [
        {"json": {"type": "foo"}},
        {"json": {"$ref": "#/$defs/missing"}},
        {"regex": "(unclosed"},
        {"grammar": 'rule ::= "no root"'},
    ]
    for so in bad:
        with pytest.raises(InvalidFieldError) as err:
            llm.generate(["p"], SamplingParams(max_tokens=4, structured_outputs=so))
        assert err.value.field == "structured_outputs"
        assert "does not compile" in str(err.value)
        assert "[" not in str(err.value).split(":", 2)[-1][:3]  # no source-line prefix
    assert llm.engine.num_unfinished_requests == 0
    assert len(llm.engine.structured_output) == 0


def test_compiled_grammars_are_cached_and_evicted_least_recently_used(llm):
    compiler = GrammarCompiler(llm.engine.structured_output.compiler.info, 2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is first
    assert (compiler.hits, compiler.misses) == (1, 1)
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recently used
    compiler.compile(c)  # evicts b
    assert len(compiler) == 2
    assert compiler.compile(a) is first
    misses = compiler.misses
    compiler.compile(b)
    assert compiler.misses == misses + 1


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(llm):
    params = SamplingParams(
        max_tokens=50,
        temperature=1.0,
        seed=5,
        ignore_eos=True,
        structured_outputs={"choice": ["red", "green"]},
    )
    for out in _texts(llm, ["a", "b", "c"], params):
        assert out.text in ("red", "green")
        assert out.finish_reason == "stop"
        # the text's tokens, then the end of sequence the grammar ends with
        assert len(out.token_ids) <= len(out.text) + 1
        assert out.token_ids[-1] in llm.engine.eos_token_ids
