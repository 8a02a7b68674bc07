"""RequestOutput in vLLM's shape, get_tokenizer, the progress bar, and LLM's one-thread guard."""

from __future__ import annotations

import threading

import pytest
import torch


@pytest.fixture(scope="module")
def llm():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    from backplane import LLM

    yield LLM(
        "tiny-llama", device="cpu", max_num_seqs=4, max_num_tokens=32, page_size=4, num_kv_pages=128
    )
    torch.set_num_threads(prev)


def greedy(max_tokens=5, **kw):
    from backplane import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_request_output_has_vllm_fields(llm):
    from backplane.api import CompletionOutput

    text_out, ids_out = llm.generate(["hello there", [5, 6, 7]], greedy(4))
    assert text_out.prompt == "hello there" and ids_out.prompt is None
    assert ids_out.prompt_token_ids == [5, 6, 7]
    (c,) = text_out.outputs
    assert isinstance(c, CompletionOutput) and c.index == 0 and c.finished()
    assert len(c.token_ids) == 4 and c.finish_reason == "length" and c.stop_reason is None
    assert c.text == llm.decode(c.token_ids) and c.logprobs is None
    # the earlier single-sequence fields read the first completion
    assert text_out.text == c.text and text_out.token_ids == c.token_ids
    assert text_out.finish_reason == "length" and text_out.finished
    assert text_out.to_dict()["outputs"][0]["token_ids"] == c.token_ids


def test_stop_reason_is_the_stop_token(llm):
    first = llm.generate([9, 9, 9], greedy(6))[0].token_ids
    stop = first[2]
    out = llm.generate([9, 9, 9], greedy(6, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == first[: first.index(stop) + 1]


def test_get_tokenizer_round_trips(llm):
    tok = llm.get_tokenizer()
    assert tok.decode(tok.encode("abc").ids) == "abc"


def test_use_tqdm_is_quiet_off_a_terminal(llm, capsys):
    outs = llm.generate(["a", "b", "c"], greedy(2), use_tqdm=True)
    assert len(outs) == 3
    assert "generating" not in capsys.readouterr().err  # stderr is not a terminal here
    assert len(llm.generate(["a", "b"], greedy(2), use_tqdm=False)) == 2


def test_progress_bar_counts_finished_prompts(llm, monkeypatch):
    import backplane.api.llm as api

    updates = []

    class Bar:
        def update(self, n):
            updates.append(n)

        def close(self):
            updates.append("closed")

    monkeypatch.setattr(api, "_progress_bar", lambda total: Bar())
    llm.generate(["a", "b", "c"], [greedy(1), greedy(3), greedy(5)])
    assert sum(u for u in updates if u != "closed") == 3 and updates[-1] == "closed"


def test_second_thread_gets_a_clear_error_and_the_engine_stays_sound(llm):
    from backplane.api import ConcurrentUseError

    expected = llm.generate(["steady"], greedy(8))[0].token_ids
    inside = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []
    results: list[list[int]] = []

    def hold_the_engine():
        # a stream that pauses between steps: its step() calls hold the guard only while stepping,
        # so hold the guard explicitly to model a long generate() on this thread
        with llm._guard("generate"):
            inside.set()
            release.wait(10)
            results.append(llm.generate(["steady"], greedy(8))[0].token_ids)

    t = threading.Thread(target=hold_the_engine)
    t.start()
    assert inside.wait(10)
    for call in (
        lambda: llm.generate(["other"], greedy(2)),
        lambda: llm.step(),
        lambda: llm.add_request("x", greedy(2)),
        lambda: llm.chat([{"role": "user", "content": "hi"}]),
    ):
        with pytest.raises(ConcurrentUseError, match="another thread is using this LLM") as exc:
            call()
        errors.append(exc.value)
    release.set()
    t.join(10)
    assert len(errors) == 4 and results == [expected]
    assert llm.num_unfinished_requests == 0 and not llm._tracked and not llm._ready
    # after the other thread is done, this one may use it
    assert llm.generate(["steady"], greedy(8))[0].token_ids == expected


def test_threads_taking_turns_are_fine(llm):
    expected = llm.generate(["turns"], greedy(3))[0].token_ids
    lock = threading.Lock()
    got: list[list[int]] = []

    def worker():
        for _ in range(3):
            with lock:
                got.append(llm.generate(["turns"], greedy(3))[0].token_ids)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == [expected] * 9


# -- stop strings and n --------------------------------------------------------------------------


def _pages_used(llm) -> int:
    return llm.engine.kv_manager.num_used_pages


def _a_stop_string(text: str) -> str:
    """Two printable characters from the middle of ``text`` (the random model writes mostly
    bytes that are not text)."""
    for i in range(3, len(text) - 1):
        if text[i : i + 2].isprintable() and text[i : i + 2].isascii():
            return text[i : i + 2]
    raise AssertionError(f"no printable pair in {text!r}")


def test_stop_string_trims_the_text_and_frees_the_request(llm):
    prompt = "xyz 123"
    full = llm.generate([prompt], greedy(24))[0].text
    stop = _a_stop_string(full)
    at = full.find(stop)
    out = llm.generate([prompt], greedy(24, stop=stop))[0]
    assert out.text == full[:at] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate([prompt], greedy(24, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == full[: at + len(stop)]
    assert llm.num_unfinished_requests == 0 and _pages_used(llm) == 0


def test_stop_string_streaming_holds_back_partial_matches(llm):
    full = llm.generate(["xyz 123"], greedy(24))[0].text
    stop = _a_stop_string(full)
    expected = full[: full.find(stop)]
    pieces, last = [], None
    for delta in llm.stream(["xyz 123"], greedy(24, stop=[stop, "\x00never"])):
        pieces.append(delta.new_text)
        last = delta
        # nothing handed out may ever go past the stop string's start
        assert expected.startswith("".join(pieces))
    assert "".join(pieces) == expected == last.text and last.stop_reason == stop


def test_min_tokens_holds_back_stop_strings(llm):
    """As in vLLM, a stop string does not end the request (nor trim its text) before
    min_tokens tokens were generated: the search covers the text after the first min_tokens
    tokens (a match may begin inside it)."""
    prompt = "xyz 123"
    plain = llm.generate([prompt], greedy(24))[0]
    full, ids = plain.text, plain.token_ids
    stop = _a_stop_string(full)
    at = full.find(stop)
    # the fewest tokens whose text holds the first match whole: it must not count
    k = next(
        i for i in range(1, len(ids) + 1) if len(llm.decode(ids[:i]).rstrip("\ufffd")) >= at + 2
    )
    floor = len(llm.decode(ids[:k]).rstrip("\ufffd"))
    later = full.find(stop, floor - len(stop) + 1)  # the first match ending after them
    expected = full if later == -1 else full[:later]
    out = llm.generate([prompt], greedy(24, stop=[stop], min_tokens=k))[0]
    assert out.text == expected != full[:at]
    assert out.finish_reason == ("length" if later == -1 else "stop")
    assert len(out.token_ids) >= k
    streamed = "".join(
        d.new_text for d in llm.stream([prompt], greedy(24, stop=[stop], min_tokens=k))
    )
    assert streamed == expected
    # min_tokens below the match's tokens changes nothing
    early = llm.generate([prompt], greedy(24, stop=[stop], min_tokens=1))[0]
    assert early.text == full[:at] or k == 1
    assert llm.num_unfinished_requests == 0 and _pages_used(llm) == 0


def test_stop_string_that_never_matches_changes_nothing(llm):
    plain = llm.generate(["no match"], greedy(10))[0]
    out = llm.generate(["no match"], greedy(10, stop=["\x00\x01 nowhere"]))[0]
    assert out.text == plain.text and out.token_ids == plain.token_ids
    assert out.finish_reason == "length" and out.stop_reason is None


def test_n_samples_share_one_output(llm):
    from backplane import SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True)
    (out,) = llm.generate(["many"], sp, request_ids=["three"])
    assert out.request_id == "three" and [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different samples
    again = llm.generate(["many"], sp)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    # sample j is the seed + j request
    one = llm.generate(["many"], SamplingParams(max_tokens=6, seed=8, ignore_eos=True))[0]
    assert one.token_ids == out.outputs[1].token_ids
    greedy_n = llm.generate(["many"], greedy(4, n=2))[0]
    assert greedy_n.outputs[0].token_ids == greedy_n.outputs[1].token_ids


def test_n_samples_stream_under_the_request_id_and_abort_together(llm):
    seen = {}
    for delta in llm.stream(["pair"], greedy(4, n=2), request_ids=["pair"]):
        assert delta.request_id == "pair"
        c = delta.outputs[0]
        seen.setdefault(c.index, []).extend(delta.new_token_ids)
    assert sorted(seen) == [0, 1] and all(len(v) == 4 for v in seen.values())
    stream = llm.stream(["pair"], greedy(50, n=2), request_ids=["gone"])
    next(stream)
    assert llm.abort("gone")
    reasons = [d.outputs[0].finish_reason for d in stream if d.finished]
    assert reasons == ["abort", "abort"]
    assert llm.num_unfinished_requests == 0 and _pages_used(llm) == 0


def test_n_is_refused_by_add_request(llm):
    from backplane.core.errors import RequestError

    with pytest.raises(RequestError, match="n > 1"):
        llm.add_request("x", greedy(2, n=2))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("n", 0),
        ("n", 129),
        ("n", 2.0),
        ("n", True),
        ("stop", ""),
        ("stop", [""]),
        ("stop", [1]),
        ("stop", {"a"}),
        ("include_stop_str_in_output", 1),
        ("include_stop_str_in_output", "yes"),
    ],
)
def test_new_sampling_fields_are_validated(name, value):
    from backplane import SamplingParams
    from backplane.core.errors import InvalidFieldError

    with pytest.raises(InvalidFieldError) as info:
        SamplingParams(**{name: value})
    assert info.value.field == name and "must be" in str(info.value)


def test_new_sampling_fields_normalise():
    from backplane import SamplingParams

    assert SamplingParams(stop="a").stop == ("a",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == () and SamplingParams().n == 1
