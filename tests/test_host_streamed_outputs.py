"""Streams build their outputs on the reader's side: the engine loop hands a running
request's output over unbuilt (a :class:`PendingOutput`), and what the reader builds
from it, however late, is the output of that step.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

CONFIG = dict(
    device="cpu", max_num_seqs=8, max_num_tokens=64, page_size=4, num_kv_pages=256, seed=0
)
PROMPTS = [f"streamed prompt {i}" for i in range(6)]


@pytest.fixture(scope="module")
def llm():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    from backplane import LLM

    yield LLM("tiny-llama", **CONFIG)
    torch.set_num_threads(prev)


def sampled(i: int, **kw):
    from backplane import SamplingParams

    return SamplingParams(max_tokens=12 + i, temperature=1.0, seed=100 + i, ignore_eos=True, **kw)


def _fields(out) -> dict:
    """Everything an output shows but its timings."""
    c = out.outputs[0]
    return {
        "request_id": out.request_id,
        "prompt": out.prompt,
        "prompt_token_ids": list(out.prompt_token_ids),
        "finished": out.finished,
        "new_token_ids": list(out.new_token_ids),
        "new_text": out.new_text,
        "text": c.text,
        "token_ids": list(c.token_ids),
        "logprobs": None
        if c.logprobs is None
        else [
            {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in d.items()} for d in c.logprobs
        ],
        "prompt_logprobs": None
        if out.prompt_logprobs is None
        else [
            None if d is None else {t: (lp.logprob, lp.rank) for t, lp in d.items()}
            for d in out.prompt_logprobs
        ],
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def _run(llm, streamed: bool):
    """Add the prompts, step to the end; return per step the outputs and each request's
    commit times as of that step (``streamed``: the outputs are built only at the end)."""
    kw = dict(logprobs=2, prompt_logprobs=1, stop=["e t", "zq"])
    rids = [llm.add_request(p, sampled(i, **kw), request_id=f"s{i}") for i, p in enumerate(PROMPTS)]
    steps = []
    while llm.num_unfinished_requests:
        outs = llm.step_streamed() if streamed else llm.step()
        if not streamed:  # read at once: the reference
            outs = [(_fields(o), o.metrics) for o in outs]
        times = {
            rid: llm._tracked[rid].request.output_token_times.copy()
            for rid in rids
            if rid in llm._tracked
        }
        steps.append((outs, times))
    return steps


def test_outputs_built_after_the_request_ended_equal_those_built_at_their_step(llm):
    from backplane.api.output_processor import PendingOutput

    reference = _run(llm, streamed=False)
    streamed = _run(llm, streamed=True)
    assert len(streamed) == len(reference)
    pending = 0
    for (outs, times), (ref_outs, _) in zip(streamed, reference, strict=True):
        built = []
        for o in outs:
            if isinstance(o, PendingOutput):
                pending += 1
                assert not o.finished
                o = o.build()
                # the gaps as of that step, not as of now
                want = np.diff(times[o.request_id]).tolist()
                assert o.metrics.inter_token_latencies == pytest.approx(want)
            built.append(_fields(o))
        assert built == [f for f, _ in ref_outs]
    assert pending > len(PROMPTS)  # running requests did come unbuilt


def test_engine_loop_builds_no_output_of_a_running_request(llm, monkeypatch):
    from backplane import SamplingParams
    from backplane.api import AsyncLLM
    from backplane.api.outputs import RequestOutput

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    on_loop: list[bool] = []  # finished flag of each output built on the engine loop
    original = RequestOutput.__init__

    def counted(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if threading.current_thread().name.startswith("backplane-engine"):
            on_loop.append(self.finished)

    monkeypatch.setattr(RequestOutput, "__init__", counted)
    engine = AsyncLLM("tiny-llama", **CONFIG)
    try:

        async def one(p: str):
            outs = [o async for o in engine.generate(p, params)]
            return outs

        results = asyncio.run(_gather(one, PROMPTS))
    finally:
        engine.shutdown()
    for outs, want in zip(results, expected, strict=True):
        assert [t for o in outs for t in o.new_token_ids] == want
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == want
        assert "".join(o.new_text for o in outs) == outs[-1].outputs[0].text
        # every running output shows the tokens so far
        for k, o in enumerate(outs[:-1]):
            assert o.outputs[0].token_ids == want[: len(o.outputs[0].token_ids)]
            assert not o.finished and k < len(want)
    assert len(on_loop) == len(PROMPTS) and all(on_loop)


async def _gather(one, prompts):
    return await asyncio.gather(*(one(p) for p in prompts))


def test_a_streamed_output_equals_the_one_the_constructor_builds():
    from backplane.api.outputs import (
        RequestOutput,
        defer_metrics,
        streamed_completion,
        streamed_output,
    )

    tokens, gaps = [4, 5, 6, 7], [0.5, 0.25, 0.125]
    snapshot = ((1.0, 0.5, 2, 0, None, 0, 0, 0), gaps, 2)
    args = dict(
        request_id="q",
        prompt="a prompt",
        prompt_token_ids=[1, 2],
        prompt_logprobs=None,
        new_token_ids=tokens[2:3],
        new_text="c",
    )

    def completion():
        return streamed_completion(0, "abc", tokens, None, None, None, num_tokens=3)

    got = streamed_output(
        args["request_id"],
        args["prompt"],
        args["prompt_token_ids"],
        completion(),
        args["prompt_logprobs"],
        args["new_token_ids"],
        args["new_text"],
        snapshot,
    )
    want = defer_metrics(RequestOutput(outputs=[completion()], finished=False, **args), snapshot)
    tokens.append(8)  # the request's lists grow after the output was made
    gaps.append(1.0)
    assert got == want
    assert got.metrics.inter_token_latencies == [0.5, 0.25]
    assert got.outputs[0].token_ids == [4, 5, 6] and not got.finished
