"""AsyncLLM: one engine loop serving concurrent coroutines and threads, cancellation, errors."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from backplane.core.errors import RequestError

CONFIG = dict(
    device="cpu", max_num_seqs=8, max_num_tokens=64, page_size=4, num_kv_pages=256, seed=0
)


@pytest.fixture(scope="module")
def offline():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    from backplane import LLM

    yield LLM("tiny-llama", **CONFIG)
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def engine():
    from backplane.api import AsyncLLM

    eng = AsyncLLM("tiny-llama", **CONFIG)
    yield eng
    eng.shutdown()


def greedy(n=6, **kw):
    from backplane import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


PROMPTS = [f"prompt number {i}" for i in range(20)]


def wait_idle(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = engine.snapshot()
        if snap.running == 0 and snap.waiting == 0 and snap.kv_pages_used == 0:
            return snap
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.snapshot()}")


def test_concurrent_coroutines_match_offline(engine, offline):
    expected = [o.token_ids for o in offline.generate(PROMPTS, greedy(6))]

    async def one(prompt):
        deltas, text, last = [], "", None
        async for out in engine.generate(prompt, greedy(6)):
            deltas.extend(out.new_token_ids)
            text += out.new_text
            last = out
        assert last.finished and last.token_ids == deltas and last.text == text
        return last

    async def main():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == expected
    assert [o.prompt for o in outs] == PROMPTS
    assert all(o.finish_reason == "length" for o in outs)
    wait_idle(engine)


def test_a_rejected_prompt_keeps_its_error_type_and_field(engine):
    from backplane.core.errors import InvalidFieldError

    with pytest.raises(InvalidFieldError, match=r"^prompt 1: ") as exc:
        engine.generate_sync([[1, 2], [1, 10**9]], greedy(3))
    assert exc.value.field == "prompt_token_ids"
    wait_idle(engine)
    assert engine.generate_sync(["still serving"], greedy(2))[0].finish_reason == "length"


def test_threads_share_the_engine(engine, offline):
    expected = {
        p: o.token_ids for p, o in zip(PROMPTS, offline.generate(PROMPTS, greedy(5)), strict=True)
    }
    got: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def worker(chunk):
        try:
            for p, o in zip(chunk, engine.generate_sync(chunk, greedy(5)), strict=True):
                got[p] = o.token_ids
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(PROMPTS[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and got == expected


def test_thread_stream_and_close_aborts(engine):
    with engine.submit("a long one", greedy(200)) as stream:
        first = next(stream)
        assert not first.finished
    wait_idle(engine)


def test_cancelling_the_iterating_task_frees_pages(engine):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate("runs until cancelled", greedy(200)):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 10)
        assert engine.snapshot().kv_pages_used > 0 or engine.snapshot().running > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    snap = wait_idle(engine)
    assert snap.running == 0 and snap.kv_pages_used == 0


def test_breaking_out_of_the_loop_aborts(engine):
    finished = []
    engine.add_finished_callback(lambda out: finished.append(out))

    async def main():
        stream = await engine.add_request([3, 4, 5], greedy(200), request_id="break-me")
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(main())
    wait_idle(engine)
    deadline = time.monotonic() + 5
    while not any(o.request_id == "break-me" for o in finished) and time.monotonic() < deadline:
        time.sleep(0.01)
    (out,) = [o for o in finished if o.request_id == "break-me"]
    assert out.finish_reason == "abort"


def test_bad_request_raises_at_submission_and_others_continue(engine, offline):
    vocab = offline.engine.vocab_size
    expected = offline.generate(["still fine"], greedy(4))[0].token_ids

    async def main():
        good = asyncio.create_task(collect(engine.generate("still fine", greedy(4))))
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await engine.add_request([1, vocab + 5], greedy(4))
        with pytest.raises(RequestError, match="empty"):
            await engine.add_request([], greedy(4))
        return await good

    assert asyncio.run(main())[-1].token_ids == expected
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.submit([vocab], greedy(2))
    assert engine.is_alive


async def collect(agen):
    return [o async for o in agen]


def test_waiting_cap_refuses_with_overloaded(offline):
    from backplane.api import AsyncLLM, EngineOverloadedError

    eng = AsyncLLM(llm=_fresh_llm(), max_waiting_requests=0)
    try:
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
            eng.submit("x", greedy(2))
    finally:
        eng.shutdown()


def test_shutdown_ends_streams_and_refuses_new_requests():
    from backplane.api import AsyncLLM, EngineDeadError

    eng = AsyncLLM(llm=_fresh_llm())
    stream = eng.submit("x", greedy(500))
    next(stream)
    eng.shutdown()
    assert not eng.is_alive and not eng.snapshot().alive
    with pytest.raises(EngineDeadError):
        for _ in stream:
            pass
    with pytest.raises(EngineDeadError):
        eng.submit("y", greedy(2))


def _fresh_llm():
    from backplane import LLM

    return LLM("tiny-llama", **CONFIG)


def test_a_failed_step_is_retried_and_the_request_completes(offline):
    from backplane.api import AsyncLLM

    expected = offline.generate(["survives a failure"], greedy(6))[0].token_ids
    llm = _fresh_llm()
    real_step = llm.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    llm.engine.step = flaky_step
    eng = AsyncLLM(llm=llm)
    try:
        outs = eng.generate_sync(["survives a failure"], greedy(6))
        assert outs[0].token_ids == expected and calls["n"] > 3
        assert eng.is_alive
    finally:
        eng.shutdown()
