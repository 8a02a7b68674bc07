"""A stream whose reader falls behind hands out what piled up as one output.

The outputs a reader takes must add up to the same tokens and text as one output
per step, and each must show, new tokens and text aside, what the latest of the
outputs it stands for shows. The reference is the output :meth:`OutputProcessor.update`
builds at every step.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from backplane.api.output_processor import (
    OutputProcessor,
    PendingOutput,
    TrackedRequest,
    coalesced,
)
from backplane.engine.outputs import EngineStepOutput
from backplane.engine.request import Request
from backplane.engine.sampling import Logprob, SamplingParams

PROMPT = [5, 6, 7]
# multi-byte characters (held back until whole) and a stop string ("zq") near the end
TEXT = "héllo wörld ✓ then ✓✓ more words and zq tail"


def _fields(out) -> dict:
    """Everything an output shows but its new tokens and text and its timings."""
    c = out.outputs[0]
    return {
        "request_id": out.request_id,
        "prompt": out.prompt,
        "prompt_token_ids": list(out.prompt_token_ids),
        "finished": out.finished,
        "text": c.text,
        "token_ids": list(c.token_ids),
        "logprobs": None
        if c.logprobs is None
        else [{t: (lp.logprob, lp.decoded_token) for t, lp in d.items()} for d in c.logprobs],
        "prompt_logprobs": out.prompt_logprobs is not None,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "gaps": len(out.metrics.inter_token_latencies),
    }


def _steps(seed: int) -> list[EngineStepOutput]:
    """The engine's outputs for one request: TEXT's bytes, zero to two per step."""
    rng = np.random.default_rng(seed)
    ids = list(TEXT.encode())
    steps, i = [], 0
    while i < len(ids):
        k = int(rng.choice([0, 1, 1, 1, 2]))
        new = ids[i : i + k]
        i += k
        lps = [{t: Logprob(-0.25, 1), t + 1: Logprob(-2.0, 2)} for t in new]
        prompt_lps = None
        if i == len(new) and new:  # with the first token
            prompt_lps = [None, {6: Logprob(-1.0, 1)}, {7: Logprob(-1.5, 1)}]
        steps.append(EngineStepOutput("r", new, new_logprobs=lps, prompt_logprobs=prompt_lps))
    steps.append(EngineStepOutput("r", [], finished=True, finish_reason="length"))
    return steps


def _run(seed: int) -> tuple[list, list]:
    """One request through both paths: the output :meth:`update` builds at each step (the
    reference), and what :meth:`update_streamed` hands a stream at the same steps."""
    from backplane.models.presets import byte_tokenizer
    from backplane.models.tokenizer import TextTokenizer

    op = OutputProcessor(TextTokenizer(byte_tokenizer()), frozenset(), lambda rid: True)
    params = SamplingParams(max_tokens=100, stop=["zq"], logprobs=1, prompt_logprobs=1)
    req = Request("r", PROMPT, params)
    ref_t = TrackedRequest(req, PROMPT, "the prompt")
    got_t = TrackedRequest(req, PROMPT, "the prompt")
    reference, streamed = [], []
    now = 10.0
    for so in _steps(seed):
        for tok in so.new_token_ids:
            now += 0.01
            req.append_token(tok, now=now)
        reference.append(op.update(ref_t, so))
        streamed.append(op.update_streamed(got_t, so))
        if reference[-1].finished:  # by the stop string
            break
    return reference, streamed


def _groups(n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    cuts = sorted({int(c) for c in rng.integers(1, n, size=int(rng.integers(0, n)))})
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _built(out):
    return out.build() if type(out) is PendingOutput else out


def _run_async(coro):
    """Run ``coro``; a reader that is never woken fails the test instead of hanging it."""

    async def bounded():
        async with asyncio.timeout(60):
            return await coro

    return asyncio.run(bounded())


@pytest.mark.parametrize("seed", range(8))
def test_coalesced_outputs_add_up_to_the_outputs_of_every_step(seed):
    reference, streamed = _run(seed)
    assert reference[-1].finished and reference[-1].finish_reason == "stop"
    assert sum(type(o) is PendingOutput for o in streamed) == len(streamed) - 1
    rng = np.random.default_rng(100 + seed)
    for source in (streamed, reference):  # unbuilt outputs, and built ones (another process)
        for _ in range(5):
            tokens, text = [], ""
            for a, b in _groups(len(source), rng):
                out = _built(coalesced(source[a:b]))
                want = reference[b - 1]
                assert _fields(out) == _fields(want)
                assert out.new_token_ids == [t for o in reference[a:b] for t in o.new_token_ids]
                assert out.new_text == "".join(o.new_text for o in reference[a:b])
                tokens += out.new_token_ids
                text += out.new_text
            assert tokens == reference[-1].token_ids
            assert text == reference[-1].text == TEXT[: TEXT.index("zq")]


def test_coalescing_leaves_the_finished_output_it_was_given_unchanged():
    reference, streamed = _run(0)
    final = streamed[-1]
    before = (list(final.new_token_ids), final.new_text)
    out = coalesced(streamed[-3:])
    assert out is not final
    assert (list(final.new_token_ids), final.new_text) == before
    assert len(out.new_token_ids) > len(final.new_token_ids)


class _Front:
    """What a stream calls back on: records aborts."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_an_async_reader_that_is_behind_takes_what_piled_up_as_one_output():
    from backplane.api.async_llm import AsyncRequestStream, EngineDeadError, _AsyncSink, _put_all

    reference, streamed = _run(1)

    async def main() -> tuple[list, list, list]:
        loop = asyncio.get_running_loop()
        # a reader that waits gets each output as it comes
        sink = _AsyncSink(loop)
        stream = AsyncRequestStream(_Front(), "r", sink)
        one_by_one = []
        for out in streamed:
            loop.call_soon(_put_all, [(sink, out)])
            one_by_one.append(await stream.__anext__())
        # one that comes back after several steps gets them as one output
        sink = _AsyncSink(loop)
        stream = AsyncRequestStream(_Front(), "r", sink)
        _put_all([(sink, out) for out in streamed[:4]])
        behind = [await stream.__anext__()]
        _put_all([(sink, out) for out in streamed[4:]])
        behind += [o async for o in stream]
        # outputs queued ahead of an error are handed out before it
        sink = _AsyncSink(loop)
        stream = AsyncRequestStream(_Front(), "r", sink)
        _put_all([(sink, out) for out in streamed[:3]])
        sink.put(EngineDeadError("stopped"))
        got = [await stream.__anext__()]
        with pytest.raises(EngineDeadError):
            await stream.__anext__()
        return one_by_one, behind, got

    one_by_one, behind, before_error = _run_async(main())
    assert [_fields(o) for o in one_by_one] == [_fields(o) for o in reference]
    assert [o.new_text for o in one_by_one] == [o.new_text for o in reference]
    assert len(behind) == 2
    assert [_fields(o) for o in behind] == [_fields(reference[3]), _fields(reference[-1])]
    assert [t for o in behind for t in o.new_token_ids] == reference[-1].token_ids
    assert "".join(o.new_text for o in behind) == reference[-1].text
    assert len(before_error) == 1 and _fields(before_error[0]) == _fields(reference[2])
    assert before_error[0].new_token_ids == reference[2].token_ids


def test_a_cancelled_read_aborts_and_leaves_no_waiter_behind():
    from backplane.api.async_llm import AsyncRequestStream, _AsyncSink

    _, streamed = _run(2)
    front = _Front()

    async def main() -> None:
        sink = _AsyncSink(asyncio.get_running_loop())
        stream = AsyncRequestStream(front, "r", sink)
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        assert sink.waiter is not None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sink.waiter is None
        sink.put(streamed[0])  # a late output wakes nobody
        assert stream.finished

    _run_async(main())
    assert front.aborted == ["r"]


def test_a_thread_reader_that_is_behind_takes_what_piled_up_as_one_output():
    from backplane.api.async_llm import EngineDeadError, RequestStream, _ThreadSink

    reference, streamed = _run(3)
    sink = _ThreadSink()
    stream = RequestStream(_Front(), "r", sink)
    for out in streamed[:5]:
        sink.queue.put(out)
    first = next(stream)
    for out in streamed[5:]:
        sink.queue.put(out)
    rest = list(stream)
    assert len(rest) == 1
    assert _fields(first) == _fields(reference[4]) and _fields(rest[0]) == _fields(reference[-1])
    assert first.new_token_ids + rest[0].new_token_ids == reference[-1].token_ids
    assert first.new_text + rest[0].new_text == reference[-1].text

    sink = _ThreadSink()
    stream = RequestStream(_Front(), "r", sink)
    for out in streamed[:2]:
        sink.queue.put(out)
    sink.queue.put(EngineDeadError("stopped"))
    assert _fields(next(stream)) == _fields(reference[1])
    with pytest.raises(EngineDeadError):
        next(stream)


# -- through the engine ---------------------------------------------------------------------

CONFIG = dict(
    device="cpu", max_num_seqs=8, max_num_tokens=64, page_size=4, num_kv_pages=256, seed=0
)


@pytest.fixture(scope="module")
def engine():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    from backplane.api import AsyncLLM

    eng = AsyncLLM("tiny-llama", **CONFIG)
    yield eng
    eng.shutdown()
    torch.set_num_threads(prev)


def _params(n: int, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _idle(engine) -> bool:
    snap = engine.snapshot()
    return snap.running == 0 and snap.waiting == 0


async def _until_idle(engine) -> None:
    deadline = time.monotonic() + 30
    while not _idle(engine):
        assert time.monotonic() < deadline, engine.snapshot()
        await asyncio.sleep(0.005)
    await asyncio.sleep(0)  # the last delivery runs on this loop


def test_a_slow_async_reader_gets_every_token_in_order(engine):
    params = _params(20, logprobs=1)
    reference = engine.generate_sync(["slow reader"], params)[0]

    async def main() -> list:
        stream = await engine.add_request("slow reader", params)
        outs = [await stream.__anext__()]
        await _until_idle(engine)  # every other output is queued by now
        return outs + [o async for o in stream]

    outs = _run_async(main())
    assert len(outs) == 2 and outs[-1].finished and not outs[0].finished
    assert [t for o in outs for t in o.new_token_ids] == reference.token_ids
    assert "".join(o.new_text for o in outs) == reference.text
    assert outs[-1].token_ids == reference.token_ids and outs[-1].finish_reason == "length"
    assert len(outs[-1].outputs[0].logprobs) == 20
    assert len(outs[-1].metrics.inter_token_latencies) == 19


def test_closing_a_stream_that_is_behind_ends_it_and_frees_the_request(engine):
    params = _params(200)

    async def main() -> list:
        stream = await engine.add_request("closed while behind", params)
        outs = [await stream.__anext__()]
        await asyncio.sleep(0.05)  # outputs pile up meanwhile
        await stream.aclose()
        await _until_idle(engine)
        return outs + [o async for o in stream]

    outs = _run_async(main())
    assert len(outs) == 1 and not outs[0].finished
    assert engine.snapshot().kv_pages_used == 0


def test_a_slow_thread_reader_gets_every_token_in_order(engine):
    params = _params(16)
    reference = engine.generate_sync(["thread reader"], params)[0]
    with engine.submit("thread reader", params) as stream:
        outs = [next(stream)]
        deadline = time.monotonic() + 30
        while not _idle(engine):  # every other output is queued by now
            assert time.monotonic() < deadline, engine.snapshot()
            time.sleep(0.005)
        outs += list(stream)
    assert len(outs) == 2 and outs[-1].finished
    assert [t for o in outs for t in o.new_token_ids] == reference.token_ids
    assert "".join(o.new_text for o in outs) == reference.text
