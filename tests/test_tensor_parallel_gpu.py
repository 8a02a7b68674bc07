"""Tensor parallelism on GPUs (NCCL): two and four ranks with CUDA graphs (decode and piecewise,
the all-reduces captured inside them) against transformers, with NCCL's all-reduce and with the
one-shot all-reduce (the default), a rank killed while the others run, and two replicas of two
ranks each."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import test_e2e  # noqa: E402
from test_e2e import ARCHS, assert_matches, hf_greedy, make_requests  # noqa: E402

from backplane import LLM, AsyncLLM, SamplingParams  # noqa: E402
from backplane.core import parallel  # noqa: E402

pytestmark = pytest.mark.gpu

hf_model = test_e2e.hf_model


def _gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices")


#: the engine settings of every test here (small limits, float32 for a tight comparison)
SETTINGS: dict[str, Any] = dict(
    device="cuda",
    dtype="float32",
    page_size=16,
    max_num_seqs=4,
    max_num_tokens=64,
    num_kv_pages=64,
)


def _llm(path: str, graphs: str, tp: int, **kw: Any) -> LLM:
    return LLM(path, **SETTINGS, cuda_graphs=graphs, tensor_parallel_size=tp, **kw)


def _check_against_transformers(hf_model: Any, arch: str, tp: int, **engine: Any) -> bool:
    """Greedy TP output with graphs on against transformers; whether a small all-reduce was set."""
    _gpus(tp)
    model, path = hf_model(arch)
    prompts, max_tokens = make_requests(seed=len(arch))
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    llm = _llm(path, "full_and_piecewise", tp, **engine)
    try:
        graph_modes = llm.engine.executor.driver.graph_mode
        one_shot = parallel._small is not None
        outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert graph_modes.captures, "no graph was captured: the collectives were not tested inside one"
    ties = 0
    for i, (p, m, got) in enumerate(zip(prompts, max_tokens, outs, strict=True)):
        want, margins = hf_greedy(arch, model, p, m)
        ties += assert_matches(got, want, margins, f"{arch} TP={tp} on GPUs, request {i}")
    assert ties <= 1, f"{ties} requests ended in near-ties: the comparison is too weak"
    return one_shot


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_ranks_on_gpus_with_graphs_equal_transformers(hf_model, arch, tp):
    assert not _check_against_transformers(hf_model, arch, tp, custom_all_reduce=False)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_one_shot_all_reduce_with_graphs_equals_transformers(hf_model, arch):
    assert _check_against_transformers(hf_model, arch, 2), (
        "the one-shot all-reduce (the default) was not set up on two GPUs"
    )


def test_a_rank_killed_mid_decode_ends_the_engine_naming_it(hf_model):
    """Rank 1 is killed while rank 0 decodes with the one-shot all-reduce in graphs: rank 0's
    device waits in the kernel for a flag that never comes until the watchdog aborts it; the
    engine then ends with the rank's name, within seconds, and no token of the aborted step
    is delivered."""
    from backplane.engine.distributed import WorkerFailedError

    _gpus(2)
    _, path = hf_model("llama")
    llm = _llm(path, "full_and_piecewise", 2)
    engine = llm.engine
    try:
        assert parallel._small is not None, "the one-shot all-reduce is not on"
        (pid,) = engine.executor.worker_pids
        rid = engine.add_request([3, 4, 5, 6], SamplingParams(max_tokens=56, ignore_eos=True))
        delivered = 0
        while delivered < 8:
            delivered += sum(len(o.new_token_ids) for o in engine.step() if o.request_id == rid)
        # a step is in flight on the device (asynchronous scheduling) when the rank dies
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match="rank 1") as info:
            while engine.has_unfinished_requests():
                engine.step()
                assert time.monotonic() - t0 < 60, "the engine went on without its rank"
        assert time.monotonic() - t0 < 60
        assert info.value.rank == 1
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "nemotron_h"])
def test_two_replicas_of_two_gpus_each_equal_transformers(hf_model, arch):
    """DP=2 x TP=2 on four GPUs: concurrent requests spread over both replicas, graphs on."""
    _gpus(4)
    model, path = hf_model(arch)
    prompts, max_tokens = make_requests(seed=len(arch))
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    engine = AsyncLLM(
        path,
        **SETTINGS,
        cuda_graphs="full_and_piecewise",
        tensor_parallel_size=2,
        data_parallel_size=2,
    )

    async def main() -> list[list[int]]:
        async def one(prompt: list[int], p: SamplingParams) -> list[int]:
            return list([o async for o in engine.generate(prompt, p)][-1].token_ids)

        return await asyncio.gather(*(one(p, q) for p, q in zip(prompts, params, strict=True)))

    try:
        outs = asyncio.run(main())
        steps = [s.steps for s in engine.replica_snapshots()]
    finally:
        engine.shutdown()
    assert all(n > 0 for n in steps), f"steps per replica {steps}: one replica idle"
    ties = 0
    for i, (p, m, got) in enumerate(zip(prompts, max_tokens, outs, strict=True)):
        want, margins = hf_greedy(arch, model, p, m)
        ties += assert_matches(got, want, margins, f"{arch} DP=2 x TP=2, request {i}")
    assert ties <= 1, f"{ties} requests ended in near-ties: the comparison is too weak"
