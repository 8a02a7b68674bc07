"""Sampling values at float32's limits, non-UTF-8 text and the model-dependent checks.

The sampler holds every real field in float32: a value that is finite in Python
but not in float32 is refused, and the largest accepted ones sample real
tokens, never NaN, checked against a float64 reference of the distribution.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backplane.core.errors import InvalidFieldError
from backplane.core.text import find_invalid_text, is_utf8_text
from backplane.engine.sampling import (
    FIELD_RULES,
    FLOAT32_MAX,
    FLOAT32_TINY,
    LogitsProcessing,
    Sampler,
    SamplingParams,
    SamplingRows,
    TokenPairs,
    apply_filters,
    apply_processing,
    check_field,
    check_for_model,
)

REAL_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


@pytest.mark.parametrize("name", REAL_FIELDS)
@pytest.mark.parametrize("value", [1e39, -1e39, 10**39, float(np.float32(3.4e38)) * 1.01])
def test_real_fields_beyond_float32_are_refused(name, value):
    # each of these is a finite Python number, and inf once it is a float32
    assert math.isfinite(value) and abs(value) > FLOAT32_MAX
    with pytest.raises(InvalidFieldError) as info:
        SamplingParams(**{name: value})
    assert info.value.field == name
    assert f"SamplingParams.{name}=" in str(info.value)


def test_temperature_at_float32_max_is_accepted_and_message_names_the_limit():
    assert SamplingParams(temperature=FLOAT32_MAX).temperature == FLOAT32_MAX
    with pytest.raises(InvalidFieldError, match="largest float32"):
        SamplingParams(temperature=1e39)


@pytest.mark.parametrize("value", [1e-39, 1e-300, 0.0, -1.0])
def test_repetition_penalty_below_float32_normal_range_is_refused(value):
    with pytest.raises(InvalidFieldError) as info:
        SamplingParams(repetition_penalty=value)
    assert info.value.field == "repetition_penalty"
    assert SamplingParams(repetition_penalty=FLOAT32_TINY).repetition_penalty == FLOAT32_TINY


def _softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    finite = np.isfinite(x)
    out = np.zeros_like(x)
    m = x[finite].max()
    out[finite] = np.exp(x[finite] - m)
    return out / out.sum()


@pytest.mark.parametrize("temperature", [1e30, FLOAT32_MAX])
def test_huge_temperature_with_min_tokens_samples_uniformly_not_nan(temperature):
    """min_tokens sets suppressed logits to -inf; dividing by a huge temperature keeps them
    out, and what is left is the float64 reference distribution (uniform to float32 precision)."""
    vocab, rows = 16, 4000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 5
    suppressed = [0, 3, 7]
    params = [SamplingParams(temperature=temperature, min_tokens=4, max_tokens=8)] * rows
    pairs = TokenPairs(
        rows=np.repeat(np.arange(rows, dtype=np.int64), len(suppressed)),
        tokens=np.tile(np.array(suppressed, dtype=np.int64), rows),
    )
    sampling_rows = SamplingRows(
        params=params,
        seeds=np.arange(rows, dtype=np.int64),
        offsets=np.zeros(rows, dtype=np.int64),
        processing=LogitsProcessing(suppress=pairs),
    )
    processed = apply_processing(logits, sampling_rows)
    filtered = apply_filters(processed, torch.full((rows,), temperature, dtype=torch.float32))
    assert not torch.isnan(filtered).any()
    # the filtered row is the float64 reference distribution of logits / temperature
    ref = _softmax64(processed[0].double().numpy() / temperature)
    got = torch.softmax(filtered[0], dim=-1).double().numpy()
    np.testing.assert_allclose(got, ref, atol=1e-6)

    tokens = Sampler().sample_rows(logits, sampling_rows).tokens
    assert tokens.dtype == torch.int64 and ((tokens >= 0) & (tokens < vocab)).all()
    assert not set(tokens.tolist()) & set(suppressed)
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    allowed = [t for t in range(vocab) if t not in suppressed]
    expected = rows / len(allowed)
    # chi-square with 12 degrees of freedom: p < 1e-4 above 40
    chi2 = sum((counts[t] - expected) ** 2 / expected for t in allowed)
    assert chi2 < 40, counts


def test_smallest_repetition_penalty_keeps_probabilities_finite():
    """A penalty of float32's smallest normal divides positive logits past float32's range."""
    logits = torch.tensor([[6.0, 5.0, -1.0, 0.5, -2.0, 1.0, 2.0, -0.5]])
    p = SamplingParams(repetition_penalty=FLOAT32_TINY, temperature=1.0, max_tokens=4)
    rows = SamplingRows(
        params=[p],
        seeds=np.array([5], dtype=np.int64),
        offsets=np.zeros(1, dtype=np.int64),
        processing=LogitsProcessing(
            penalty_rows=np.array([0], dtype=np.int64),
            output=TokenPairs(rows=np.array([0, 0]), tokens=np.array([1, 2])),
        ),
    )
    processed = apply_processing(logits, rows)
    assert torch.isfinite(processed).all()
    probs = torch.softmax(apply_filters(processed, torch.ones(1)), dim=-1)
    assert not torch.isnan(probs).any()
    # token 1 (positive, penalised by division) now dominates; token 2 (negative) is gone
    token = Sampler().sample_rows(logits, rows).tokens
    assert token.tolist() == [1]


def test_tiny_temperature_after_large_logits_stays_finite():
    x = torch.tensor([[3e38, 2e38, 0.0, float("-inf")]])
    out = apply_filters(x, torch.tensor([1e-5]))
    assert not torch.isnan(torch.softmax(out, dim=-1)).any()
    assert torch.isneginf(out[0, 3])


@pytest.mark.parametrize("stop", ["\ud800", ["ok", "a\udfffb"], ("x", "\udc00")])
def test_stop_strings_must_be_utf8(stop):
    with pytest.raises(InvalidFieldError, match="not UTF-8") as info:
        SamplingParams(stop=stop)
    assert info.value.field == "stop"


def test_check_field_is_the_table_and_normalises():
    assert check_field("top_k", np.int64(5)) == 5 and type(check_field("top_k", 5)) is int
    assert check_field("stop", "x") == ("x",)
    for name, value in [("max_tokens", "10"), ("max_tokens", True), ("temperature", "0.5")]:
        with pytest.raises(InvalidFieldError) as info:
            check_field(name, value)
        with pytest.raises(InvalidFieldError) as direct:
            SamplingParams(**{name: value})
        assert str(info.value) == str(direct.value) and info.value.field == name
    assert set(FIELD_RULES) >= {"max_tokens", "temperature", "stop"}


def test_refused_values_are_shown_short():
    huge = ["x" * 2000] * 3000 + [""]  # refused for its empty string, shown short
    with pytest.raises(InvalidFieldError) as info:
        SamplingParams(stop=huge)
    assert len(str(info.value)) < 600 and "characters" in str(info.value)


def test_check_for_model_refuses_top_k_and_stop_ids_outside_the_vocabulary():
    check_for_model(SamplingParams(top_k=100, stop_token_ids=[99]), 100, "r")
    with pytest.raises(InvalidFieldError, match="'r1'.*top_k=101.*100 tokens") as info:
        check_for_model(SamplingParams(top_k=101), 100, "r1")
    assert info.value.field == "top_k"
    with pytest.raises(InvalidFieldError, match="holds 100") as info:
        check_for_model(SamplingParams(stop_token_ids=[5, 100]), 100, "r2")
    assert info.value.field == "stop_token_ids"


def test_find_invalid_text_names_the_place():
    assert is_utf8_text("é ok") and not is_utf8_text("a\ud800")
    assert find_invalid_text({"a": [1, {"b": "\ud800"}]}, "body") == "body.a[1].b"
    assert find_invalid_text({"\udc00": 1}, "kw") == "kw.\\udc00"
    assert find_invalid_text(["fine", ("x", "y")], "p") is None
    assert find_invalid_text(list(range(1000)), "p") is None
