"""distributed_executor_backend="ray": tensor-parallel ranks as Ray actors on a local CPU cluster.

A local Ray cluster of two CPUs is started for the module; TP=2 through Ray
must give the same greedy tokens as one rank with rank 0's CPU reserved in the
placement group's first bundle, a rank whose actor dies must end
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
        # rank 1 runs in an actor of its own; rank 0's CPU is reserved too, so Ray
        # hands neither to anything else
        (pid,) = executor.worker_pids
        assert pid != os.getpid()
        assert ray.available_resources().get("CPU", 0.0) == CLUSTER_CPUS - 2
        (group,) = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert [b for b in group["bundles"].values()] == [
            {"CPU": 1.0, f"node:{ray.util.get_node_ip_address()}": 0.001},
            {"CPU": 1.0},
        ]
        got = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
    finally:
        llm.shutdown()
    assert got == expected
    assert _free_cpus(ray, CLUSTER_CPUS) == CLUSTER_CPUS  # the actor is gone with its engine
    # and the reservation with it
    states = {g["state"] for g in ray.util.placement_group_table().values()}
    assert "CREATED" not in states


def test_rank_zero_bundle_is_pinned_to_the_driver_node():
    from backplane.engine.distributed.ray_executor import placement_bundles

    assert placement_bundles(3, "GPU", "10.0.0.7") == [
        {"GPU": 1.0, "node:10.0.0.7": 0.001},
        {"GPU": 1.0},
        {"GPU": 1.0},
    ]


@pytest.mark.parametrize(
    "ids,visible,index",
    [
        (["2"], None, 2),
        (["2"], "", 2),
        (["2"], "1,2,3", 1),
        (["GPU-ab12"], "GPU-cd34, GPU-ab12", 1),
    ],
)
def test_driver_runs_on_the_gpu_ray_reserved_for_rank_zero(ids, visible, index):
    from backplane.engine.distributed.ray_executor import driver_cuda_index

    assert driver_cuda_index(ids, visible) == index


def test_reserved_gpu_the_driver_cannot_see_is_a_clear_error():
    from backplane.engine.distributed.ray_executor import driver_cuda_index

    with pytest.raises(ConfigError, match="Ray reserved GPU 3 .* CUDA_VISIBLE_DEVICES=0,1"):
        driver_cuda_index(["3"], "0,1")
    with pytest.raises(ConfigError, match="not one"):
        driver_cuda_index(["0", "1"], None)


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

    with pytest.raises(ConfigError, match="needs 4 free CPU") as exc:
        LLM("tiny-llama", tensor_parallel_size=4, distributed_executor_backend="ray", **CONFIG)
    assert f"has {CLUSTER_CPUS:g} free" in str(exc.value)
    assert _free_cpus(ray, CLUSTER_CPUS) == CLUSTER_CPUS
