"""Data parallel with tensor parallel on the CPU: two replicas of two gloo ranks each.

Replica 0 runs in this process, replica 1 in an engine process of its own
(each replica needs its own torch.distributed group); four processes in all.
Concurrent greedy requests spread over both replicas must give the tokens of
one single-rank engine, and every process must be gone after shutdown; a
replica whose engine process dies ends its requests with an error naming it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from process_helpers import alive as _alive

from backplane import LLM, AsyncLLM, SamplingParams
from backplane.api.data_parallel import replica_configs, replica_in_own_process
from backplane.api.engine_process import ProcessLLM
from backplane.engine.config import EngineConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = dict(
    device="cpu", max_num_seqs=4, max_num_tokens=32, page_size=4, num_kv_pages=64, threads=1
)
PROMPTS = [[3 + i, 17, 42 + 2 * i, 9, 11 + i] for i in range(6)]


def _children(pid: int) -> list[int]:
    """The ids of the processes whose parent is ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().split(")")[-1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_only_replicas_after_the_first_with_ranks_get_a_process():
    configs = replica_configs(EngineConfig(**CONFIG, data_parallel_size=3, tensor_parallel_size=2))
    assert [replica_in_own_process(c, i) for i, c in enumerate(configs)] == [
        False,
        True,
        True,
    ]
    one_rank = replica_configs(EngineConfig(**CONFIG, data_parallel_size=2))
    assert not any(replica_in_own_process(c, i) for i, c in enumerate(one_rank))


def test_two_replicas_of_two_ranks_match_one_engine():
    expected = [o.token_ids for o in LLM("tiny-llama", **CONFIG).generate(PROMPTS, _greedy())]
    engine = AsyncLLM("tiny-llama", data_parallel_size=2, tensor_parallel_size=2, **CONFIG)
    front, remote = (r.llm for r in engine._replicas)
    try:
        assert isinstance(remote, ProcessLLM) and remote.pid != os.getpid()
        assert not isinstance(front, ProcessLLM)
        # the engine process runs its own rank 1: engine process + its worker, 4 ranks in all
        (remote_worker,) = _children(remote.pid)
        local_workers = front.engine.executor.worker_pids
        assert len(local_workers) == 1

        async def main():
            async def one(prompt):
                return [o async for o in engine.generate(prompt, _greedy())][-1]

            return await asyncio.gather(*(one(p) for p in PROMPTS))

        outs = asyncio.run(main())
        assert [o.token_ids for o in outs] == expected
        steps = [s.steps for s in engine.replica_snapshots()]
        assert all(s > 0 for s in steps), steps
        # a second batch from a thread, after the first finished
        again = engine.generate_sync(PROMPTS[:2], _greedy(4))
        assert [o.token_ids for o in again] == [e[:4] for e in expected[:2]]
    finally:
        engine.shutdown()
    pids = [remote.pid, remote_worker, *local_workers]
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]


def test_a_dead_engine_process_ends_its_replica_naming_it():
    from backplane.core.errors import EngineFailedError

    replica = ProcessLLM(
        EngineConfig(**CONFIG, model="tiny-llama", tensor_parallel_size=2), index=1
    )
    try:
        replica.wait_ready()
        replica._add_tokens([1, 2, 3], _greedy(50), "r0", None)
        replica.step()
        (worker,) = _children(replica.pid)
        os.kill(replica.pid, signal.SIGKILL)
        with pytest.raises(EngineFailedError, match=r"replica 1's engine process died"):
            for _ in range(60):
                replica.step()
    finally:
        replica.shutdown()
    assert not _alive(replica.pid)
    # its tensor-parallel worker does not outlive it
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)
