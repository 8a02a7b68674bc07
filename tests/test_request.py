"""Request: token storage, validation, appending and finish detection."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from backplane.core.errors import RequestError
from backplane.engine.request import FinishReason, Request, RequestStatus


def params(max_tokens: int = 4, stop=(), ignore_eos: bool = False) -> SimpleNamespace:
    return SimpleNamespace(max_tokens=max_tokens, stop_token_ids=tuple(stop), ignore_eos=ignore_eos)


def test_int32_array_is_copied_into_one_buffer_exactly():
    prompt = np.arange(100, dtype=np.int32) * 3
    r = Request("a", prompt, params(5))
    assert r.prompt_token_ids.dtype == np.int32
    np.testing.assert_array_equal(r.prompt_token_ids, prompt)
    assert r.capacity == 105
    assert r.token_buffer.flags.c_contiguous
    # the request owns its tokens: changing the caller's array changes nothing
    prompt[0] = 77
    assert r.prompt_token_ids[0] == 0
    # views, not copies
    assert np.shares_memory(r.prompt_token_ids, r.token_buffer)
    assert np.shares_memory(r.all_token_ids, r.token_buffer)


@pytest.mark.parametrize(
    "prompt",
    [[5, 1, 2], (5, 1, 2), np.array([5, 1, 2], np.int64), np.array([5, 1, 2], np.uint16)],
)
def test_other_prompt_forms_convert_once_to_int32(prompt):
    r = Request("a", prompt, params())
    assert r.prompt_token_ids.dtype == np.int32
    assert r.prompt_token_ids.tolist() == [5, 1, 2]


def test_views_are_read_only():
    r = Request("a", [1, 2, 3], params())
    with pytest.raises(ValueError):
        r.prompt_token_ids[0] = 9
    with pytest.raises(ValueError):
        r.all_token_ids[0] = 9


@pytest.mark.parametrize(
    ("prompt", "kw", "match"),
    [
        ([], {}, "empty"),
        (np.zeros(0, np.int32), {}, "empty"),
        ([1, 2, 50], {"vocab_size": 50}, "50 at position 2"),
        ([1, -3, 2], {"vocab_size": 50}, "-3 at position 1"),
        (np.array([1, 2**40], np.int64), {}, "int32"),
        ([1, 2**40], {}, "integers"),
        (np.zeros((2, 2), np.int32), {}, "1-D"),
        (np.zeros(3, np.float32), {}, "integers"),
        ("hello", {}, "tokenize"),
        (list(range(10)), {"max_model_len": 12}, "at most 2"),
    ],
)
def test_validation_errors_say_what_to_do(prompt, kw, match):
    with pytest.raises(RequestError, match=match):
        Request("bad", prompt, params(3), **kw)


def test_exact_model_length_is_accepted():
    r = Request("a", list(range(9)), params(3), max_model_len=12, vocab_size=10)
    assert r.capacity == 12


def test_append_and_finish_reasons():
    now = 100.0
    r = Request("a", [1, 2], params(max_tokens=3, stop=[7]), eos_token_ids=[9])
    assert r.append_token(4, now) is None
    assert r.last_token_id == 4
    assert r.append_token(5, now + 1) is None
    assert r.append_token(6, now + 2) is FinishReason.LENGTH
    assert r.output_token_ids.tolist() == [4, 5, 6]
    assert r.all_token_ids.tolist() == [1, 2, 4, 5, 6]
    np.testing.assert_array_equal(r.output_token_times, [now, now + 1, now + 2])
    assert r.stats.first_token_time == now and r.stats.last_token_time == now + 2
    with pytest.raises(RuntimeError):
        r.append_token(1)

    r = Request("b", [1], params(10, stop=[7]), eos_token_ids=[9])
    assert r.append_token(7) is FinishReason.STOP
    r = Request("c", [1], params(10), eos_token_ids=[9])
    assert r.append_token(9) is FinishReason.STOP
    r = Request("d", [1], params(10, ignore_eos=True), eos_token_ids=[9])
    assert r.append_token(9) is None
    r = Request("e", [1, 2], params(2), max_model_len=4)
    assert r.append_token(3) is None
    assert r.append_token(3) is FinishReason.LENGTH


def test_initial_state():
    r = Request("a", [3, 4, 5], params())
    assert r.status is RequestStatus.WAITING and not r.is_finished
    assert r.num_tokens == 3 and r.num_output_tokens == 0 and r.num_uncomputed_tokens == 3
    assert "prompt=3" in repr(r)
