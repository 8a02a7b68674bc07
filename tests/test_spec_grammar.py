"""Speculative decoding of requests with a grammar (structured output).

Drafts are cut at the first token the grammar refuses, every verified position
is masked with the grammar's state after the drafts before it, and the matcher
advances by exactly the tokens committed. The references are the same requests
decoded without speculation (greedy, and seeded sampling: n-gram verification
draws with the sampler's own noise, so both give the same tokens) and fresh
xgrammar matchers fed the tokens one by one.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

xgr = pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install -e '.[dev]')")

from backplane import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from backplane.engine.sampling import GrammarBitmask  # noqa: E402
from backplane.engine.sampling.rejection import rejection_sample  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_tokens=64, page_size=4)

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
REGEX = r"(abc ){4}[0-9]{2}"
CHOICES = ["the quick brown fox", "a lazy dog"]

#: kind -> (constraint, a prompt that repeats text the constraint allows, so n-gram drafts hit)
CASES = {
    "json": ({"json": SCHEMA}, '{"color": "red", "ok": true} ' * 3),
    "regex": ({"regex": REGEX}, "abc abc abc abc 12 " * 3),
    "choice": ({"choice": CHOICES}, "the quick brown fox, a lazy dog. " * 3),
}


@pytest.fixture(scope="module")
def llms():
    torch.set_num_threads(1)
    plain = LLM("tiny-llama", **ENGINE)
    spec = LLM("tiny-llama", speculative_config=NGRAM, **ENGINE)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def _fresh_matcher(llm: LLM, so: dict) -> object:
    compiled = llm.engine.structured_output.compile(StructuredOutputsParams(**so))
    return xgr.GrammarMatcher(compiled)


def _grammar_takes_all(llm: LLM, so: dict, token_ids: list[int]) -> bool:
    """A fresh matcher takes every token in order (the output is a prefix of a sentence)."""
    m = _fresh_matcher(llm, so)
    return all(m.accept_token(int(t)) for t in token_ids)


def _check_text(kind: str, text: str) -> None:
    if kind == "json":
        value = json.loads(text)
        assert set(value) == {"color", "ok"} and value["color"] in ("red", "green", "blue")
        assert isinstance(value["ok"], bool)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


# -- the engine ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(CASES))
def test_greedy_grammar_rows_speculate_with_the_tokens_of_plain_decoding(llms, kind):
    plain, spec = llms
    so, prompt = CASES[kind]
    params = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=so)
    want = plain.generate(prompt, params)[0]
    got = spec.generate(prompt, params)[0]
    out = got.outputs[0]
    assert out.token_ids == want.outputs[0].token_ids
    assert _grammar_takes_all(spec, so, out.token_ids)
    if out.finish_reason == "stop":
        _check_text(kind, out.text)
    elif kind != "json":  # greedy JSON of a random model may spend its tokens on whitespace
        pytest.fail(f"{kind}: the constrained output did not finish: {out.text!r}")
    m = got.metrics
    assert m.spec_verify_steps > 0 and m.spec_draft_tokens >= m.spec_accepted_tokens > 0
    assert want.metrics.spec_verify_steps == 0
    assert len(spec.engine.structured_output) == 0  # the finished request's matcher let go


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind", sorted(CASES))
def test_sampled_grammar_rows_with_speculation_follow_the_grammar(llms, kind, seed):
    plain, spec = llms
    so, prompt = CASES[kind]
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured_outputs=so)
    want = plain.generate(prompt, params)[0].outputs[0]
    got = spec.generate(prompt, params)[0]
    out = got.outputs[0]
    assert out.token_ids == want.token_ids
    assert _grammar_takes_all(spec, so, out.token_ids)
    if out.finish_reason == "stop":
        _check_text(kind, out.text)
    assert got.metrics.spec_verify_steps > 0


def test_mixed_batch_and_a_grammar_completed_inside_drafts_with_ignore_eos(llms):
    """Constrained and free rows share verification steps; a grammar that completes
    ends its request even when the drafts ran past it (the prompt repeats the choice)."""
    plain, spec = llms
    so, prompt = CASES["choice"]
    params = [
        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, structured_outputs=so),
        SamplingParams(max_tokens=30, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=CASES["regex"][0]),
    ]
    prompts = [prompt, prompt, CASES["regex"][1]]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    first = got[0].outputs[0]
    assert first.text in CHOICES and first.finish_reason == "stop"
    assert first.token_ids[-1] in spec.engine.eos_token_ids
    assert re.fullmatch(REGEX, got[2].outputs[0].text)
    assert all(o.metrics.spec_accepted_tokens > 0 for o in got)


# -- the manager's drafts and masks --------------------------------------------------------------


def test_draft_length_and_per_position_masks_match_fresh_matchers(llms):
    _, spec = llms
    grammars = spec.engine.structured_output
    so = {"regex": REGEX}
    tok = spec.engine.tokenizer
    valid = list(tok.encode("abc abc abc abc 42", add_special_tokens=False).ids)
    refused = list(tok.encode(" abc", add_special_tokens=False).ids)
    eos = spec.engine.eos_token_ids[0]
    draft = [*valid[:-1], valid[-1], eos, *refused]

    # the reference: how far a fresh matcher goes, and its mask after each prefix
    ref = _fresh_matcher(spec, so)
    n_ref = 0
    for t in draft:
        if ref.is_terminated() or not ref.accept_token(t):
            break
        n_ref += 1
    assert n_ref == len(valid) + 1  # the text, then the end of sequence it allows

    rid = "draft-check"
    grammars.add(rid, StructuredOutputsParams(**so))
    try:
        assert grammars.valid_draft_length(rid, draft) == n_ref
        width = n_ref + 2
        masks = grammars.draft_bitmask(rid, draft[:n_ref], width)
        vocab = spec.engine.vocab_size
        for i in range(n_ref + 1):
            m = _fresh_matcher(spec, so)
            for t in draft[:i]:
                assert m.accept_token(t)
            want = xgr.allocate_token_bitmask(1, vocab)
            if m.is_terminated():  # the manager allows only the end of sequence there
                only_eos = np.zeros((1, vocab), dtype=bool)
                only_eos[0, list(spec.engine.eos_token_ids)] = True
                want = _mask_rows(only_eos)
            else:
                m.fill_next_token_bitmask(want, 0)
            assert torch.equal(masks[i], want[0]), i
        assert torch.all(masks[n_ref + 1] == -1)  # past the drafts: not read, nothing masked
        # the matcher was rolled back: the step's mask is the grammar's first one again
        first = _fresh_matcher(spec, so)
        want = xgr.allocate_token_bitmask(1, vocab)
        first.fill_next_token_bitmask(want, 0)

        class _Req:
            request_id = rid

        assert torch.equal(grammars.bitmask([_Req()]).bitmask[0], want[0])
        with pytest.raises(ValueError, match="not allowed by its grammar"):
            grammars.draft_bitmask(rid, refused, len(refused) + 1)
        # ... and a refused draft leaves it where it was too
        assert torch.equal(grammars.bitmask([_Req()]).bitmask[0], want[0])
    finally:
        grammars.discard(rid)


def test_committed_drafts_advance_the_matcher_token_by_token(llms):
    _, spec = llms
    grammars = spec.engine.structured_output
    tok = spec.engine.tokenizer
    text = list(tok.encode("abc abc abc abc 42", add_special_tokens=False).ids)
    eos = spec.engine.eos_token_ids[0]
    rid = "accept-check"
    grammars.add(rid, StructuredOutputsParams(regex=REGEX))
    try:
        assert grammars.accept({rid: text[:3]}) == []
        assert grammars.accept({rid: text[3]}) == []
        assert grammars.valid_draft_length(rid, text[4:]) == len(text) - 4
        assert grammars.valid_draft_length(rid, text[3:]) == 0  # already taken
        assert grammars.accept({rid: [*text[4:], eos]}) == [rid]
    finally:
        grammars.discard(rid)


# -- rejection sampling under masks --------------------------------------------------------------


def _mask_rows(allowed: np.ndarray) -> torch.Tensor:
    """``[m, vocab]`` booleans as xgrammar's int32 words (bit t % 32 of word t // 32)."""
    m, vocab = allowed.shape
    words = np.zeros((m, (vocab + 31) // 32), dtype=np.uint32)
    for r, t in zip(*np.nonzero(allowed), strict=True):
        words[r, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


def test_greedy_verification_rejects_a_draft_the_mask_refuses():
    g = np.random.default_rng(3)
    n, k, vocab = 2, 3, 70
    logits = torch.from_numpy(g.normal(size=(n, k + 1, vocab)).astype(np.float32))
    allowed = g.random((n * (k + 1), vocab)) < 0.4
    raw = logits.reshape(-1, vocab).numpy()
    # the reference: the argmax among the allowed tokens, in plain numpy
    masked_argmax = np.where(allowed, raw, -np.inf).argmax(-1).reshape(n, k + 1)
    raw_argmax = raw.argmax(-1).reshape(n, k + 1)
    for r in range(n * (k + 1)):  # the raw favourite is refused everywhere
        allowed[r, raw_argmax.reshape(-1)[r]] = False
        masked_argmax.reshape(-1)[r] = np.where(allowed[r], raw[r], -np.inf).argmax()
    # row 0: two drafts the masked target agrees with, then its raw favourite
    # row 1: the raw favourite first
    drafts = np.array(
        [
            [masked_argmax[0, 0], masked_argmax[0, 1], raw_argmax[0, 2]],
            [raw_argmax[1, 0], masked_argmax[1, 1], masked_argmax[1, 2]],
        ]
    )
    grammar = GrammarBitmask(np.arange(n * (k + 1), dtype=np.int64), _mask_rows(allowed))
    args = (
        logits,
        torch.from_numpy(drafts),
        np.array([3, 3]),
        [SamplingParams(temperature=0.0)] * n,
        np.zeros(n, np.int64),
        np.zeros(n, np.int64),
    )
    out = rejection_sample(*args, grammar=grammar)
    assert out.num_accepted.tolist() == [2, 0]
    assert out.tokens.tolist() == [
        [drafts[0, 0], drafts[0, 1], masked_argmax[0, 2], -1],
        [masked_argmax[1, 0], -1, -1, -1],
    ]
    # without the masks the refused raw favourite is accepted, and row 0 takes its own
    plain = rejection_sample(*args)
    assert plain.num_accepted[1] >= 1 and plain.tokens[1, 0] == raw_argmax[1, 0]
    assert plain.num_accepted[0] == 0 and plain.tokens[0, 0] == raw_argmax[0, 0]
