"""The LLM API: prompt forms, outputs and metrics, streaming, abort, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backplane.core.errors import ConfigError, InvalidFieldError, RequestError


@pytest.fixture(scope="module")
def llm():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    from backplane import LLM

    yield LLM(
        "tiny-llama", device="cpu", max_num_seqs=4, max_num_tokens=32, page_size=4, num_kv_pages=128
    )
    torch.set_num_threads(prev)


def greedy(n=5, **kw):
    from backplane import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_public_imports():
    import backplane
    from backplane import LLM, SamplingParams
    from backplane.api import LLM as ApiLLM

    assert LLM is ApiLLM and SamplingParams().max_tokens >= 1
    assert "LLM" in backplane.__all__


def test_prompt_forms_agree(llm):
    ids = llm.encode("hello world")
    assert ids and all(isinstance(i, int) for i in ids)
    outs = llm.generate(["hello world", ids, np.asarray(ids, dtype=np.int32)], greedy())
    assert [o.prompt_token_ids for o in outs] == [ids] * 3
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    # a single token-id list (not a list of prompts) is one prompt
    single = llm.generate(ids, greedy())
    assert len(single) == 1 and single[0].token_ids == outs[0].token_ids


def test_outputs_and_metrics(llm):
    outs = llm.generate(["a" * 30, "b" * 7], [greedy(6), greedy(3)])
    assert [len(o.token_ids) for o in outs] == [6, 3]
    for o in outs:
        assert o.finished and o.finish_reason == "length"
        assert o.text == llm.decode(o.token_ids)
        m = o.metrics
        assert m.time_to_first_token is not None and m.time_to_first_token > 0
        assert len(m.inter_token_latencies) == len(o.token_ids) - 1
        assert all(x >= 0 for x in m.inter_token_latencies)
    # the same prompt again: its full pages come from the prefix cache
    again = llm.generate("a" * 30, greedy(2))[0]
    assert again.metrics.prompt_tokens_reused == (30 - 1) // 4 * 4
    assert again.token_ids == outs[0].token_ids[:2]


def test_stream_matches_generate(llm):
    prompts = ["stream one", "two", "and a third, longer prompt"]
    want = llm.generate(prompts, greedy(5))
    got_ids = {}
    got_text = {}
    finished = []
    for delta in llm.stream(prompts, greedy(5), request_ids=["s0", "s1", "s2"]):
        got_ids.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        got_text[delta.request_id] = got_text.get(delta.request_id, "") + delta.new_text
        assert delta.token_ids[-len(delta.new_token_ids) :] == delta.new_token_ids
        if delta.finished:
            finished.append(delta.request_id)
    assert sorted(finished) == ["s0", "s1", "s2"]
    for i, w in enumerate(want):
        assert got_ids[f"s{i}"] == w.token_ids
        assert got_text[f"s{i}"] == w.text


def test_stop_token(llm):
    base = llm.generate("stop here", greedy(6))[0].token_ids
    stop = base[2]
    first = base.index(stop)
    out = llm.generate("stop here", greedy(6, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base[: first + 1]


def test_abort_while_streaming(llm):
    it = llm.stream(["abort me please", "keep me"], greedy(8), request_ids=["x", "y"])
    first = next(it)
    assert first.request_id in ("x", "y")
    assert llm.abort("x")
    seen = {}
    for d in it:
        seen.setdefault(d.request_id, []).append(d)
    assert seen["x"][-1].finished and seen["x"][-1].finish_reason == "abort"
    assert seen["y"][-1].finish_reason == "length" and len(seen["y"][-1].token_ids) == 8
    assert llm.num_unfinished_requests == 0
    assert llm.engine.kv_manager.num_used_pages == 0


def test_closing_a_stream_aborts_its_requests(llm):
    it = llm.stream(["left behind"] * 2, greedy(20))
    next(it)
    it.close()
    assert llm.num_unfinished_requests == 0
    assert llm.engine.kv_manager.num_used_pages == 0


def test_bad_prompt_rejects_the_whole_call(llm):
    with pytest.raises(RequestError, match="prompt 1"):
        llm.generate(["fine", []], greedy())
    # the error keeps its type and the field it names
    with pytest.raises(InvalidFieldError, match=r"^prompt 1: ") as exc:
        llm.generate([[1, 2], [1, 10**9]], greedy())
    assert exc.value.field == "prompt_token_ids"
    with pytest.raises(RequestError, match="one per prompt"):
        llm.generate(["a", "b"], [greedy()])
    with pytest.raises(RequestError):
        llm.generate(3.5, greedy())
    assert llm.num_unfinished_requests == 0
    # the engine still serves
    assert len(llm.generate("still alive", greedy(2))[0].token_ids) == 2


def test_bad_config_is_a_config_error():
    from backplane import LLM

    with pytest.raises(ConfigError, match="max_num_seq"):
        LLM("tiny-llama", max_num_seq=3)
    with pytest.raises(ConfigError):
        LLM("no-such-model-or-directory", device="cpu")


def test_stream_text_with_multibyte_characters(llm, monkeypatch):
    """Byte-level tokens split characters; streamed text never shows half a character."""
    import backplane.api.output_processor as op

    monkeypatch.setattr(op, "_metrics", lambda request: None)
    text = "naïve café – 東京"
    ids = llm.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    t = op.TrackedRequest(type("R", (), {"request_id": "m"})(), [])
    pieces = []
    for i, tok in enumerate(ids):
        t.token_ids.append(tok)
        t.finished = i == len(ids) - 1
        new = llm._outputs.output(t, incremental=True).new_text
        assert "\ufffd" not in new
        pieces.append(new)
    assert "".join(pieces) == text
    assert len([p for p in pieces if p]) > 5  # text arrives as it forms, not only at the end


def test_manual_stepping(llm):
    a = llm.add_request("manual", greedy(3), request_id="m1")
    b = llm.add_request([5, 6, 7], greedy(2))
    got: dict[str, list[int]] = {}
    done = {}
    while llm.num_unfinished_requests:
        for out in llm.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = out
    assert a == "m1" and set(done) == {a, b}
    assert done[a].token_ids == got[a] and len(got[a]) == 3 and len(got[b]) == 2
    assert not llm._ready and not llm._tracked  # nothing is kept once finished
