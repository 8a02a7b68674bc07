"""Host work per step in the api: one decode per request, output objects only where needed,
snapshots that count instead of copying.

``LLM.generate`` hands out only final outputs, so its running requests get no
output object; streams detokenise once per request per step. The texts and
tokens stay those of the full decode and of the streaming path.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def llm():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    from backplane import LLM

    yield LLM(
        "tiny-llama", device="cpu", max_num_seqs=4, max_num_tokens=64, page_size=4, num_kv_pages=256
    )
    torch.set_num_threads(prev)


def sampled(max_tokens: int, seed: int, **kw):
    from backplane import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True, **kw)


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    calls = [0]
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_generate_builds_outputs_only_for_finished_requests(llm, monkeypatch):
    prompts = ["abc", [7, 8, 9, 10], "hello"]
    params = [sampled(9, seed=i) for i in range(3)]
    # the reference: the same seeded requests streamed, every step's output built
    streamed: dict[int, list] = {i: [] for i in range(3)}
    ids = [f"s{i}" for i in range(3)]
    for out in llm.stream(prompts, params, request_ids=ids):
        streamed[ids.index(out.request_id)].append(out)
    assert all(len(v) > 2 for v in streamed.values())
    built = _count_calls(monkeypatch, llm._outputs, "output")
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert built[0] == len(prompts)
    for i, out in enumerate(outs):
        last = streamed[i][-1]
        assert out.finished and out.token_ids == last.token_ids and len(out.token_ids) == 9
        assert out.text == last.text == llm.decode(out.token_ids)
        assert out.new_token_ids == out.token_ids and out.new_text == out.text
        assert len(out.metrics.inter_token_latencies) == 8
    assert not llm._final_only and not llm._finished


def test_generate_with_stop_strings_matches_the_stream(llm):
    base = llm.generate([[40, 41, 42]], sampled(24, seed=5), use_tqdm=False)[0]
    text = base.text
    # a stop string taken from the middle of the text the request produces
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert len(stop) == 2 and "\ufffd" not in stop, "pick another seed: no piece to stop on"
    params = sampled(24, seed=5, stop=[stop])
    got = llm.generate([[40, 41, 42]], params, use_tqdm=False)[0]
    pieces = list(llm.stream([[40, 41, 42]], params))
    ref = pieces[-1]
    assert got.finish_reason == ref.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == ref.text == text[: text.index(stop)]
    assert "".join(p.new_text for p in pieces) == ref.text
    assert got.token_ids == ref.token_ids


def test_streaming_detokenises_once_per_step():
    from backplane.api.output_processor import OutputProcessor, TrackedRequest
    from backplane.engine.outputs import EngineStepOutput
    from backplane.engine.sampling.params import SamplingParams
    from backplane.models.presets import byte_tokenizer

    tok = byte_tokenizer()
    text = "héllo wörld, ça va? € 1 2 3 " * 4
    ids = list(tok.encode(text).ids)
    proc = OutputProcessor(tok, frozenset(), lambda rid: True)
    calls = _count_calls(pytest.MonkeyPatch(), proc, "decode")
    from backplane.engine.request import Request

    req = Request("r", [1, 2], SamplingParams(max_tokens=len(ids)))
    t = TrackedRequest(req, [1, 2])
    streamed = ""
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        so = EngineStepOutput(
            request_id="r",
            new_token_ids=[tid],
            finished=last,
            finish_reason="length" if last else None,
        )
        out = proc.update(t, so)
        streamed += out.new_text
        # what was handed out is always the beginning of the whole text, never past it
        assert text.startswith(streamed)
    assert streamed == text
    # one decode per step, a second one each time the window's start moves up (every 16
    # tokens), and the final text decoded whole; two per step before
    assert calls[0] <= len(ids) + len(ids) // 8 + 2 < 2 * len(ids)


def test_engine_snapshots_count_without_copying(monkeypatch):
    import asyncio

    from backplane.api import AsyncLLM
    from backplane.engine.sched.scheduler import Scheduler

    copies = [0]
    for name in ("running", "waiting"):
        prop = getattr(Scheduler, name)

        def copied(self, _get=prop.fget):
            copies[0] += 1
            return _get(self)

        monkeypatch.setattr(Scheduler, name, property(copied))
    engine = AsyncLLM(
        "tiny-llama", device="cpu", max_num_seqs=2, max_num_tokens=32, page_size=4, num_kv_pages=64
    )
    seen: list[tuple[int, int]] = []
    try:
        sched = engine._replicas[0].llm.engine.scheduler

        async def one(i: int) -> None:
            async for _ in engine.generate([3 + i, 4, 5], sampled(4, seed=i), request_id=f"q{i}"):
                snap = engine.snapshot()
                seen.append((snap.running, snap.waiting))

        async def main() -> None:
            await asyncio.gather(*(one(i) for i in range(4)))

        asyncio.run(main())
        # the counters agree with the lists they count (read here, outside the loop)
        assert sched.num_running == len(sched._running) == 0
        assert sched.num_waiting == len(sched._waiting) == 0
    finally:
        engine.shutdown()
    assert copies[0] == 0
    # four requests, two at a time: some snapshot saw two running and others waiting
    assert all(r <= 2 for r, _ in seen) and any(r == 2 for r, _ in seen)
    assert any(w > 0 for _, w in seen)


def test_stream_outputs_copy_growing_lists_only_when_read(llm):
    """A running request's outputs keep no copies of its token, logprob and gap lists
    until they are read, and then show them as of their own step."""
    import pickle

    params = sampled(12, seed=3, logprobs=2)
    outs = list(llm.stream([[5, 6, 7]], params))
    final = outs[-1]
    assert final.finished and len(final.token_ids) == 12 and len(outs) > 3
    running = outs[:-1]
    # nothing copied while streaming (the old outputs copied every list every step)
    for o in running:
        assert "token_ids" not in vars(o.outputs[0]) and "logprobs" not in vars(o.outputs[0])
        assert "metrics" not in vars(o)
    # the request's lists kept growing since: each output still shows its own step
    tokens, logprobs = final.token_ids, final.outputs[0].logprobs
    gaps = final.metrics.inter_token_latencies
    assert len(logprobs) == 12 and len(gaps) == 11
    n = 0
    for o in running:
        n += len(o.new_token_ids)
        # pickled before the first read: the copy carries the same values
        back = pickle.loads(pickle.dumps(o))
        for out in (back, o):
            c = out.outputs[0]
            assert c.token_ids == tokens[:n] and c.logprobs == logprobs[:n]
            assert out.metrics.inter_token_latencies == gaps[: max(n - 1, 0)]
            assert out.metrics.arrival_time == final.metrics.arrival_time
            assert out.metrics.finished_time is None and not out.finished
        assert o.to_dict() == back.to_dict()
        assert o.to_dict()["outputs"][0]["token_ids"] == tokens[:n]
    assert n + len(final.new_token_ids) == 12
    # a copy read out is the output's own: growing the request's list later leaves it
    assert running[0].token_ids is not tokens
