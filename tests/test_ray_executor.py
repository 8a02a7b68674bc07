"""distributed_executor_backend="ray": tensor-parallel ranks as Ray actors on a local CPU cluster.

A local Ray cluster of two CPUs is started for the module; TP=2 through Ray
must give the same greedy tokens as one rank, a rank whose actor dies must end
the engine with an error naming it, and no actor may outlive its engine.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from backplane.core.errors import ConfigError

CONFIG = dict(
    device="cpu", max_num_seqs=4, max_num_tokens=32, page_size=4, num_kv_pages=64, threads=1
)
PROMPTS = ["the ranks of ray", "one two three four", "hello"]
CLUSTER_CPUS = 2


def greedy(n: int = 8):
    from backplane import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_missing_ray_says_how_to_install(monkeypatch):
    from backplane.engine.distributed.ray_executor import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # makes ``import ray`` fail
    with pytest.raises(ConfigError, match=r"backplane\[ray\]") as exc:
        import_ray()
    assert "distributed_executor_backend='mp'" in str(exc.value)


def test_ray_is_a_backend_name_of_the_configuration():
    from backplane.engine.config import EngineConfig

    config = EngineConfig(distributed_executor_backend="ray", tensor_parallel_size=2)
    assert config.distributed_executor_backend == "ray"
    with pytest.raises(ConfigError, match="mp, ray"):
        EngineConfig(distributed_executor_backend="slurm")


@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'backplane[ray]')")
    ray.init(num_cpus=CLUSTER_CPUS, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _free_cpus(ray, expected: float, timeout: float = 30.0) -> float:
    """The cluster's free CPUs once they reach ``expected`` (or the last seen value)."""
    deadline = time.monotonic() + timeout
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        if free >= expected or time.monotonic() > deadline:
            return free
        time.sleep(0.2)


def test_tp2_through_ray_matches_one_rank(ray):
    from backplane import LLM
    from backplane.engine.distributed.ray_executor import RayExecutor

    expected = [o.token_ids for o in LLM("tiny-llama", **CONFIG).generate(PROMPTS, greedy())]
    llm = LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="ray", **CONFIG)
    try:
        executor = llm.engine.executor
        assert isinstance(executor, RayExecutor)
        # rank 1 runs in an actor of its own, holding one of the cluster's CPUs
        (pid,) = executor.worker_pids
        assert pid != os.getpid()
        assert ray.available_resources().get("CPU", 0.0) == CLUSTER_CPUS - 1
        got = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
    finally:
        llm.shutdown()
    assert got == expected
    assert _free_cpus(ray, CLUSTER_CPUS) == CLUSTER_CPUS  # the actor is gone with its engine


def test_a_dead_rank_ends_the_engine_naming_it(ray):
    from backplane import LLM
    from backplane.engine.distributed import WorkerFailedError

    llm = LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="ray", **CONFIG)
    try:
        (pid,) = llm.engine.executor.worker_pids
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerFailedError, match="rank 1") as exc:
            for _ in range(50):  # the death is seen at the next call into the executor
                llm.generate(["still there?"], greedy(4))
        assert exc.value.rank == 1
    finally:
        llm.shutdown()
    assert _free_cpus(ray, CLUSTER_CPUS) == CLUSTER_CPUS


def test_too_few_cluster_resources_is_a_clear_error(ray):
    from backplane import LLM

    with pytest.raises(ConfigError, match="needs 3 free CPU") as exc:
        LLM("tiny-llama", tensor_parallel_size=4, distributed_executor_backend="ray", **CONFIG)
    assert f"has {CLUSTER_CPUS:g} free" in str(exc.value)
    assert _free_cpus(ray, CLUSTER_CPUS) == CLUSTER_CPUS
