"""What LLM refuses before anything is queued: parameters that are not SamplingParams, and
request ids given twice or still in use."""

from __future__ import annotations

import pytest
import torch

from backplane.core.errors import InvalidFieldError


@pytest.fixture(scope="module")
def llm():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    from backplane import LLM

    yield LLM(
        "tiny-llama", device="cpu", max_num_seqs=4, max_num_tokens=32, page_size=4, num_kv_pages=128
    )
    torch.set_num_threads(prev)


def greedy(max_tokens=3, **kw):
    from backplane import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _idle(llm) -> bool:
    return (
        llm.num_unfinished_requests == 0
        and not llm.engine.has_unfinished_requests()
        and not llm._tracked
        and not llm._ready
    )


@pytest.mark.parametrize("bad", [5, {"temperature": 0}, "greedy", [1, 2]])
def test_sampling_params_of_another_type_name_the_field(llm, bad):
    with pytest.raises(InvalidFieldError, match="sampling_params must be a SamplingParams") as exc:
        llm.add_request([1, 2], bad)
    assert exc.value.field == "sampling_params" and type(bad).__name__ in str(exc.value)
    assert _idle(llm)


def test_a_dict_of_fields_gets_a_hint(llm):
    with pytest.raises(InvalidFieldError, match=r"SamplingParams\(\*\*fields\)") as exc:
        llm.generate([[1, 2]], {"temperature": 0})
    assert exc.value.field == "sampling_params"
    with pytest.raises(InvalidFieldError, match="got str") as exc:
        llm.generate([[1, 2], [3]], [greedy(), "greedy"])
    assert exc.value.field == "sampling_params"
    with pytest.raises(InvalidFieldError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate([[1, 2], [3]], [greedy()])
    assert _idle(llm)


def test_duplicate_ids_in_one_call_queue_nothing(llm):
    with pytest.raises(InvalidFieldError, match="'x' is given twice") as exc:
        llm.generate([[1, 2], [3, 4]], greedy(), request_ids=["x", "x"])
    assert exc.value.field == "request_id" and "prompt 1" in str(exc.value)
    assert _idle(llm) and llm.engine.get_request("x") is None
    # the id is free: the same call with it runs
    (out,) = llm.generate([[1, 2]], greedy(), request_ids=["x"])
    assert out.request_id == "x" and len(out.token_ids) == 3


def test_samples_of_n_requests_and_their_ids_are_checked_before_queueing(llm):
    # sample 0 of request "s" is "s/0": the same id given for a second prompt
    with pytest.raises(InvalidFieldError, match="'s/0' is given twice"):
        llm.generate([[1, 2], [3, 4]], [greedy(n=2), greedy()], request_ids=["s", "s/0"])
    assert _idle(llm)


def test_an_id_still_in_use_refuses_the_whole_call(llm):
    live = llm.add_request([5, 6], greedy(4), request_id="live")
    with pytest.raises(InvalidFieldError, match="'live' is already in use"):
        llm.generate([[1, 2], [3, 4]], greedy(), request_ids=["fresh", "live"])
    assert llm.engine.get_request("fresh") is None and set(llm._tracked) == {live}
    while llm.engine.has_unfinished_requests():
        llm.step()
    assert _idle(llm)
    assert len(llm.generate([[1, 2]], greedy(), request_ids=["fresh"])[0].token_ids) == 3
