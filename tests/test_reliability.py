"""Bad values are refused up front; request ids follow one rule; tiny temperatures are greedy.

Every refused value raises an :class:`InvalidFieldError` (a ``RequestError`` and
a ``ValueError``) naming the field, before anything is queued: the engine is
left exactly as it was and keeps serving. Outputs are compared with runs of
the same requests on their own.
"""

from __future__ import annotations

import array
import dataclasses
import json

import numpy as np
import pytest
import torch

from backplane.cli import main
from backplane.core.errors import InvalidFieldError, RequestError
from backplane.core.hookspecs import FAMILIES
from backplane.engine.engine import Engine
from backplane.engine.sampling import FIELD_RULES, MIN_TEMPERATURE, SamplingParams

TORCH_BACKENDS = dict.fromkeys(FAMILIES, "torch")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [5, 9, 13, 2, 77, 31]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(model: str = "tiny-llama", **kw) -> Engine:
    cfg = dict(
        model=model,
        device="cpu",
        max_num_seqs=4,
        max_num_tokens=32,
        page_size=4,
        num_kv_pages=64,
        backends=TORCH_BACKENDS,
    )
    cfg.update(kw)
    return Engine(**cfg)


def run_all(engine: Engine) -> tuple[dict[str, list[int]], dict[str, str]]:
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert not engine.has_unfinished_requests()
    return tokens, reasons


def alone(prompt, params=GREEDY) -> list[int]:
    e = make_engine()
    rid = e.add_request(prompt, params)
    return run_all(e)[0][rid]


# -- SamplingParams: exact types and ranges, field by field ---------------------------------

BAD_FIELDS = [
    ("max_tokens", True),
    ("max_tokens", 2.0),
    ("max_tokens", 2**31),
    ("max_tokens", "8"),
    ("temperature", "0.5"),
    ("temperature", None),
    ("temperature", True),
    ("temperature", float("inf")),
    ("temperature", 10**400),
    ("top_k", 2**63),
    ("top_k", 2**31),
    ("top_k", 1.5),
    ("top_k", True),
    ("top_k", -2),
    ("top_p", "1"),
    ("top_p", None),
    ("top_p", 0.0),
    ("min_p", None),
    ("min_p", 1.5),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("seed", 1.0),
    ("seed", True),
    ("seed", "7"),
    ("stop_token_ids", [1.5, "7"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", "12"),
    ("stop_token_ids", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", np.array([[1, 2]])),
    ("ignore_eos", "no"),
    ("ignore_eos", 1),
    ("ignore_eos", None),
]


@pytest.mark.parametrize(("name", "value"), BAD_FIELDS, ids=[f"{n}={v!r}" for n, v in BAD_FIELDS])
def test_sampling_params_refuse_wrong_types_and_ranges(name, value):
    with pytest.raises(InvalidFieldError) as info:
        SamplingParams(**{name: value})
    err = info.value
    assert err.field == name
    assert isinstance(err, RequestError) and isinstance(err, ValueError)
    assert f"SamplingParams.{name}=" in str(err) and "must be" in str(err)


def test_every_sampling_field_has_a_rule():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(FIELD_RULES) == names


def test_sampling_params_normalise_numpy_and_aliases():
    p = SamplingParams(
        max_tokens=np.int64(8),
        temperature=np.float32(0.5),
        top_k=-1,
        top_p=1,
        seed=np.uint64(2**64 - 1),
        stop_token_ids=np.array([3, 4], dtype=np.int32),
        ignore_eos=np.bool_(True),
    )
    assert (p.max_tokens, p.top_k, p.top_p, p.seed, p.stop_token_ids) == (
        8,
        0,
        1.0,
        2**64 - 1,
        (3, 4),
    )
    assert type(p.max_tokens) is int and type(p.temperature) is float and p.ignore_eos is True
    assert all(type(t) is int for t in p.stop_token_ids)
    assert dataclasses.replace(p, top_k=5).top_k == 5
    with pytest.raises(InvalidFieldError, match="top_k"):
        dataclasses.replace(p, top_k=2**63)


# -- temperature: any positive value gives finite probabilities -----------------------------


@pytest.mark.parametrize("t", [1e-39, 1e-40, 1e-300, MIN_TEMPERATURE / 2])
def test_tiny_temperature_decodes_greedily(t):
    p = SamplingParams(max_tokens=6, temperature=t, ignore_eos=True)
    assert p.is_greedy
    e = make_engine()
    a = e.add_request(PROMPT, p)
    b = e.add_request(PROMPT, dataclasses.replace(p, seed=3))
    tokens = run_all(e)[0]
    want = alone(PROMPT)
    assert tokens[a] == tokens[b] == want
    assert want != [0] * len(want)  # not the NaN-argmax token 0 repeated


def test_temperature_at_the_threshold_samples_finite_probabilities():
    from backplane.engine.sampling import Sampler

    logits = torch.tensor([[30.0, 29.0, -50.0, 0.0], [1e4, -1e4, 0.0, 9999.99]])
    p = SamplingParams(temperature=MIN_TEMPERATURE)
    assert not p.is_greedy
    tokens = Sampler().sample(logits, [p, p], np.array([1, 2]), np.array([0, 0]))
    assert tokens.tolist() == [0, 0]


# -- seeds: every 64-bit value is one seed ----------------------------------------------------


def test_unsigned_64_bit_seed_is_its_signed_twin_and_too_large_is_refused():
    e = make_engine()
    sample = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    a = e.add_request(PROMPT, SamplingParams(seed=2**64 - 5, **sample))
    b = e.add_request(PROMPT, SamplingParams(seed=-5, **sample))
    c = e.add_request(PROMPT, SamplingParams(seed=2**63, **sample))
    d = e.add_request(PROMPT, SamplingParams(seed=-(2**63), **sample))
    tokens = run_all(e)[0]
    assert tokens[a] == tokens[b] and tokens[c] == tokens[d]
    assert tokens[a] != tokens[c]
    with pytest.raises(InvalidFieldError, match="seed"):
        e.add_request(PROMPT, SamplingParams(seed=2**64, **sample))
    assert e.num_unfinished_requests == 0 and not e.has_unfinished_requests()


# -- limits that depend on the model ------------------------------------------------------------


def test_top_k_and_stop_ids_within_the_vocabulary():
    e = make_engine()
    vocab = e.vocab_size
    sample = dict(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
    for params, name in [
        (SamplingParams(top_k=vocab + 1, **sample), "top_k"),
        (SamplingParams(stop_token_ids=[3, vocab], **sample), "stop_token_ids"),
    ]:
        with pytest.raises(InvalidFieldError) as info:
            e.add_request(PROMPT, params)
        assert info.value.field == name and str(vocab) in str(info.value)
    assert not e.has_unfinished_requests()
    # the whole vocabulary is the same as no filter
    full = e.add_request(PROMPT, SamplingParams(top_k=vocab, **sample))
    off = e.add_request(PROMPT, SamplingParams(top_k=-1, **sample))
    tokens = run_all(e)[0]
    assert tokens[full] == tokens[off]


# -- prompts: integer ids only, no silent casts ------------------------------------------------


@pytest.mark.parametrize(
    "prompt",
    [
        [1.7, 2.2, "3"],
        [1, 2, "3"],
        [1, 2.0],
        [True, 2],
        [1, None],
        [2**70],
        np.array([1.0, 2.0]),
        np.array([True, False]),
        torch.tensor([1.5, 2.0]),
        "1 2 3",
        b"\x01\x02",
        3,
    ],
    ids=lambda p: type(p).__name__ + repr(p)[:20],
)
def test_prompts_must_be_integer_ids(prompt):
    e = make_engine()
    with pytest.raises(InvalidFieldError) as info:
        e.add_request(prompt, GREEDY)
    assert info.value.field == "prompt_token_ids"
    assert not e.has_unfinished_requests() and e.kv_manager.num_used_pages == 0


def test_integer_prompts_of_every_form_are_the_same_request():
    want = alone(PROMPT)
    e = make_engine()
    forms = [
        PROMPT,
        tuple(PROMPT),
        [np.int64(t) for t in PROMPT],
        np.array(PROMPT, dtype=np.int32),
        np.array(PROMPT, dtype=np.uint16),
        torch.tensor(PROMPT),
        array.array("i", PROMPT),
    ]
    rids = [e.add_request(p, GREEDY) for p in forms]
    tokens = run_all(e)[0]
    assert all(tokens[r] == want for r in rids)


# -- request ids -----------------------------------------------------------------------------


def test_request_ids_are_strings():
    e = make_engine()
    for bad in (123, 1.5, None.__class__, b"x", ""):
        with pytest.raises(InvalidFieldError) as info:
            e.add_request(PROMPT, GREEDY, request_id=bad)
        assert info.value.field == "request_id"
    with pytest.raises(InvalidFieldError, match=r"str\(123\)"):
        e.add_request(PROMPT, GREEDY, request_id=123)
    assert not e.has_unfinished_requests()
    rid = e.add_request(PROMPT, GREEDY, request_id="123")
    with pytest.raises(InvalidFieldError, match="request_id"):
        e.abort_request(123)
    assert e.abort_request("123")
    assert run_all(e)[1] == {rid: "abort"}


def test_an_id_is_reusable_only_after_its_final_output():
    e = make_engine()
    e.add_request(PROMPT, GREEDY, request_id="x")
    e.step()
    assert e.abort_request("x")
    assert not e.abort_request("x")  # aborted already
    # the abort is not reported yet: the id is still taken
    with pytest.raises(InvalidFieldError, match="already in use"):
        e.add_request([7, 8, 9], GREEDY, request_id="x")
    outs = e.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("x", "abort")]
    # delivered: the id is free, and the new request is a new request
    e.add_request([7, 8, 9], GREEDY, request_id="x")
    tokens, reasons = run_all(e)
    assert reasons == {"x": "length"} and tokens["x"] == alone([7, 8, 9])


def test_reused_id_is_not_reported_as_aborted_nor_unreachable():
    e = make_engine(async_scheduling=True)
    e.add_request(PROMPT, GREEDY, request_id="x")
    e.step()
    e.step()
    assert e.abort_request("x")
    try:  # at once: refused (the abort is not delivered yet), or a new request that must work
        e.add_request([7, 8, 9], GREEDY, request_id="x")
        readded = True
    except InvalidFieldError:
        readded = False
    finals = [o for o in e.step() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in finals] == [("x", "abort")]
    if not readded:
        e.add_request([7, 8, 9], GREEDY, request_id="x")
    e.step()
    assert e.get_request("x") is not None and e.abort_request("x")
    assert run_all(e)[1] == {"x": "abort"}
    assert e.kv_manager.num_used_pages == 0


def test_generated_ids_skip_the_callers_ids():
    e = make_engine()
    mine = [e.add_request(PROMPT, GREEDY, request_id=str(i)) for i in range(3)]
    generated = e.add_request(PROMPT, GREEDY)
    assert generated not in mine
    assert set(run_all(e)[1]) == {*mine, generated}


# -- the command line: one line, exit status 2 -------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--top-k", str(2**63), "--temperature", "1"], "top_k"),
        (["--top-k", "100000", "--temperature", "1"], "top_k"),
        (["--sampling-seed", str(2**64), "--temperature", "1"], "seed"),
        (["--temperature", "-1"], "temperature"),
        (["--prompt-token-ids", "1,2,99999"], "vocabulary"),
    ],
)
def test_cli_bad_values_are_one_line_errors(flags, needle, capsys):
    argv = ["generate", "--device", "cpu", "--max-new-tokens", "3", *flags]
    if "--prompt-token-ids" not in flags:
        argv += ["--prompt-token-ids", "1,2,3"]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("backplane: error: "), err
    assert needle in lines[0]


def test_cli_tiny_temperature_is_greedy(capsys):
    argv = ["generate", "--device", "cpu", "--max-new-tokens", "5", "--prompt-token-ids", "5,9,13"]
    assert main([*argv, "--temperature", "0", "--json"]) == 0
    greedy = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*argv, "--temperature", "1e-40", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy
    assert greedy != [0] * 5


def test_llm_request_id_rules():
    from backplane.api import LLM

    llm = LLM(
        "tiny-llama",
        device="cpu",
        max_num_seqs=4,
        max_num_tokens=32,
        page_size=4,
        num_kv_pages=64,
        backends=TORCH_BACKENDS,
    )
    with pytest.raises(InvalidFieldError, match="request_id"):
        llm.add_request(PROMPT, GREEDY, request_id=123)
    with pytest.raises(InvalidFieldError, match="request_id"):
        llm.abort(123)
    assert llm.num_unfinished_requests == 0
    llm.add_request(PROMPT, GREEDY, request_id="x")
    llm.step()
    assert llm.abort("x")
    with pytest.raises(InvalidFieldError, match="already in use"):
        llm.add_request([7, 8, 9], GREEDY, request_id="x")
    finals = [o for o in llm.step() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in finals] == [("x", "abort")]
    llm.add_request([7, 8, 9], GREEDY, request_id="x")
    outs = []
    while llm.num_unfinished_requests or llm.engine.has_unfinished_requests():
        outs += llm.step()
    assert [o.finish_reason for o in outs if o.finished] == ["length"]
    assert outs[-1].token_ids == alone([7, 8, 9])
