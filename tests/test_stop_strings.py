"""Stop strings: the matcher against a plain search, the limits, and the pace of other streams."""

from __future__ import annotations

import random
import re
import statistics
import time

import pytest
import torch

from backplane.core.errors import InvalidFieldError

CONFIG = dict(device="cpu", max_num_seqs=8, max_num_tokens=64, page_size=4, num_kv_pages=256)


def greedy(max_tokens=5, **kw):
    from backplane import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    from backplane import LLM

    yield LLM("tiny-llama", **CONFIG, max_stop_strings=3, max_stop_string_length=5)
    torch.set_num_threads(prev)


# -- the matcher ---------------------------------------------------------------------------------


def _first_match(text: str, stops: tuple[str, ...], floor: int) -> tuple[int, str] | None:
    """The match that completes first after ``floor`` (the longest of those ending together),
    by trying every stop string at every position."""
    best = None
    for end in range(floor + 1, len(text) + 1):
        for s in sorted(stops, key=len, reverse=True):
            if text.endswith(s, 0, end):
                best = (end - len(s), s)
                break
        if best is not None:
            return best
    return None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """The longest end of ``text`` that is a proper beginning of some stop string."""
    return max(
        (k for s in stops for k in range(1, len(s)) if k <= len(text) and text.endswith(s[:k])),
        default=0,
    )


def test_matcher_agrees_with_a_plain_search():
    from backplane.api.stop import StopMatcher

    rng = random.Random(7)
    for _ in range(2000):
        stops = tuple(
            "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
            for _ in range(rng.randint(1, 5))
        )
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        floor = rng.randint(0, len(text))
        m = StopMatcher(stops)
        cuts = sorted(rng.sample(range(len(text) + 1), min(5, len(text) + 1))) + [len(text)]
        floor_at = rng.choice(cuts)  # the floor becomes known after some text was read
        for cut in cuts:
            m.consume(text[:cut])
            if not m.searching:
                if not any(s in text[:cut] for s in stops):
                    assert m.partial() == _held_back(text[:cut], stops), (text[:cut], stops)
                if cut >= floor_at:
                    floor = min(floor, cut)
                    m.set_floor(floor)
        if not m.searching:
            m.set_floor(floor)
        assert m.match() == _first_match(text, stops, floor), (text, stops, floor)


def test_matcher_reads_text_that_changed_again():
    from backplane.api.stop import StopMatcher

    rng = random.Random(3)
    for _ in range(500):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(3))
        old = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        m = StopMatcher(stops)
        m.set_floor(0)
        m.consume(old)
        if m.match() is not None:
            continue
        common = rng.randint(0, len(old))
        new = old[:common] + "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        m.rewind(common)
        m.consume(new)
        assert m.match() == _first_match(new, stops, 0), (old, new, stops)


def test_automaton_is_shared_by_equal_stop_lists():
    from backplane.api.stop import StopMatcher

    stops = ("abc", "bcd")
    assert StopMatcher(stops)._ac is StopMatcher(tuple(stops))._ac


# -- limits --------------------------------------------------------------------------------------


def test_default_limits_are_in_the_config():
    from backplane.engine.config import EngineConfig

    cfg = EngineConfig()
    assert (cfg.max_stop_strings, cfg.max_stop_string_length) == (64, 1024)
    assert EngineConfig.from_dict({"max_stop_strings": "8"}).max_stop_strings == 8


@pytest.mark.parametrize(
    "stop, says",
    [
        (["a", "b", "c", "d"], "4 stop strings given, at most 3"),
        (["abcdef"], "stop[0] has 6 characters, at most 5"),
        (["ok", "abcdefgh"], "stop[1] has 8 characters"),
    ],
)
def test_stop_strings_beyond_the_limits_are_refused(llm, stop, says):
    for call in (
        lambda: llm.generate(["a", "b"], greedy(3, stop=stop)),
        lambda: llm.generate(["a"], greedy(3, stop=stop, n=2)),
        lambda: llm.add_request("a", greedy(3, stop=stop)),
    ):
        with pytest.raises(InvalidFieldError, match=re.escape(says)) as exc:
            call()
        assert exc.value.field == "stop"
        assert llm.num_unfinished_requests == 0 and not llm._tracked
        assert not llm.engine.has_unfinished_requests()
    # at the limits, it runs
    out = llm.generate(["a"], greedy(3, stop=["zzzzz", "yyyyy", "xxxxx"]))[0]
    assert len(out.token_ids) == 3


def test_a_configured_length_above_the_default_is_honoured():
    from backplane import LLM, SamplingParams

    long_stop = "q" * 3000
    with LLM("tiny-llama", **CONFIG, max_stop_string_length=4096) as big:
        out = big.generate(["a"], greedy(3, stop=[long_stop]))[0]
        assert len(out.token_ids) == 3
    # the parameters themselves bound neither count nor length: the engine's settings do
    assert SamplingParams(stop=[long_stop] * 100).stop == (long_stop,) * 100


def test_async_requests_bring_their_automaton_built_off_the_engine_loop(monkeypatch):
    import threading

    from backplane import LLM, SamplingParams
    from backplane.api import AsyncLLM, stop

    built_on: list[str] = []
    real = stop.stop_automaton.__wrapped__

    def spy(stops):
        built_on.append(threading.current_thread().name)
        return real(stops)

    monkeypatch.setattr(stop, "stop_automaton", spy)
    import backplane.api.async_llm as async_module

    monkeypatch.setattr(async_module, "stop_automaton", spy)
    engine = AsyncLLM(llm=LLM("tiny-llama", **CONFIG))
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, stop=["unlikely stop"])
        stream = engine.submit("hello", params)
        assert len(list(stream)[-1].outputs[0].token_ids) == 3
        with pytest.raises(InvalidFieldError, match="at most 64"):
            engine.submit("hello", SamplingParams(max_tokens=3, stop=["s"] * 65))
    finally:
        engine.shutdown()
    assert built_on == [threading.current_thread().name], built_on


def test_server_answers_400_naming_stop():
    for module in ("fastapi", "httpx"):
        pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[dev]')")
    from fastapi.testclient import TestClient

    from backplane import LLM
    from backplane.api import AsyncLLM
    from backplane.server.app import build_app

    engine = AsyncLLM(llm=LLM("tiny-llama", **CONFIG, max_stop_strings=2))
    try:
        with TestClient(build_app(engine, model_name="tiny")) as client:
            body = {"prompt": "hi", "max_tokens": 2, "stop": ["a", "b", "c"]}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "stop" and "at most 2" in err["message"]
            body["stop"] = ["a", "b"]
            assert client.post("/v1/completions", json=body).status_code == 200
    finally:
        engine.shutdown()


# -- pace ----------------------------------------------------------------------------------------


class _WideTokenizer:
    """The model's tokenizer with every token spelled as sixteen letters, so that some
    seventy steps make the long text the heaviest stop strings are searched in."""

    def __init__(self, inner):
        self._inner = inner
        letters = "abcdefghij"
        self._spell = [
            "".join(letters[(i * 7 + k * 3 + i // 10) % 10] for k in range(16)) for i in range(4096)
        ]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self._spell[i] for i in ids)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _step_time(llm, stop: list[str], tag: str) -> float:
    """The median processor time of an engine step while a normal request decodes beside an
    n = 4 one. Processor time rather than wall time: other processes on a busy machine
    stretch the wall time of some steps, while stop-string work is paid in this process's
    processor time on every step (torch uses one thread here)."""
    from backplane import SamplingParams
    from backplane.api.llm import split_samples

    heavy = SamplingParams(max_tokens=110, temperature=1.0, seed=1, ignore_eos=True, n=4, stop=stop)
    for j, sp in enumerate(split_samples(heavy)):
        llm.add_request([7, 8, 9], sp, request_id=f"{tag}-heavy-{j}")
    for _ in range(70):  # the heavy request's text grows past the longest stop string
        llm.step()
    llm.add_request([5, 6], greedy(30), request_id=f"{tag}-normal")
    times = []
    for _ in range(30):
        t0 = time.process_time()
        llm.step()
        times.append(time.process_time() - t0)
    while llm.engine.has_unfinished_requests():
        llm.step()
    return statistics.median(times)


def test_other_streams_keep_their_pace():
    """A request with n = 4 and the most and longest stop strings allowed (64 of 1024
    characters) slows the steps of a normal request beside it at most 3x (it was about 10x)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    from backplane import LLM

    llm = LLM("tiny-llama", **CONFIG)
    try:
        cfg = llm.engine.config
        llm._outputs.tokenizer = _WideTokenizer(llm.tokenizer)
        rng = random.Random(0)
        # letters the text is made of, so that partial matches keep the search busy; never whole
        stop = [
            "".join(rng.choice("abcdefghij") for _ in range(cfg.max_stop_string_length - 1)) + "\0"
            for _ in range(cfg.max_stop_strings)
        ]
        llm.generate([[1, 2]], greedy(4))  # first-step work out of the measurement
        base = _step_time(llm, [], "base")
        heavy = _step_time(llm, stop, "heavy")
        assert heavy < 3 * base, f"{heavy * 1e3:.1f} ms per step against {base * 1e3:.1f} ms"
    finally:
        llm.shutdown()
        torch.set_num_threads(prev)
