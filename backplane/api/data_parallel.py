"""The configurations of data-parallel engine replicas: one engine per replica, each on its devices.

With ``data_parallel_size = N`` an :class:`~backplane.api.async_llm.AsyncLLM`
runs N whole engines, each with its own scheduler, KV cache and engine-loop
thread, and spreads the requests over them (:mod:`backplane.api.balancing`).
On CUDA replica ``i`` gets the device ``cuda:base + i``, where ``base`` is the
index of the configured device (``cuda:0`` for ``cuda``). The replicas share
one process, so each runs one rank: ``tensor_parallel_size`` must be 1 with
more than one replica. On the CPU every replica runs on
``cpu``; a replica whose ``threads`` is left automatic gets its share of the
cores, so that the replicas do not oversubscribe them.
"""

from __future__ import annotations

import logging

from backplane.core.errors import ConfigError
from backplane.engine.config import EngineConfig
from backplane.engine.threads import available_cores

logger = logging.getLogger(__name__)

__all__ = ["replica_configs"]


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def replica_configs(config: EngineConfig) -> list[EngineConfig]:
    """Split a configuration into the configurations of its data-parallel replicas.

    :param config: the engine configuration (its ``data_parallel_size`` says how many).
    :return: one configuration per replica, each with ``data_parallel_size=1``
        and its own device; a single replica's is ``config`` itself.
    :raises ConfigError: the machine has fewer GPUs than the replicas need, or
        both ``data_parallel_size`` and ``tensor_parallel_size`` are above 1.
    """
    n = config.data_parallel_size
    if n == 1:
        return [config]
    if config.tensor_parallel_size > 1:
        # the replicas share this process, and a process has one torch.distributed
        # default group and one tensor-parallel group
        raise ConfigError(
            f"data_parallel_size={n} with tensor_parallel_size={config.tensor_parallel_size}: "
            "replicas run in one process, which can hold one tensor-parallel group only; "
            "set one of them to 1, or run one server per tensor-parallel group behind a "
            "load balancer"
        )
    if config.device_type != "cuda":
        threads = config.threads
        if threads is None:
            threads = max(1, available_cores() // n)
        return [config.merge(device="cpu", threads=threads, data_parallel_size=1)] * n
    _, _, index = config.device_resolved.partition(":")
    base = int(index) if index else 0
    have = _cuda_device_count()
    if base + n > have:
        key = "data_parallel_size"
        raise ConfigError(
            f"{config.origin(key).where(key)}: {n} replicas of one GPU each from cuda:{base} "
            f"need GPUs up to cuda:{base + n - 1}, but this machine has {have}; lower "
            "data_parallel_size, or start from a lower device"
        )
    configs = [config.merge(device=f"cuda:{base + i}", data_parallel_size=1) for i in range(n)]
    logger.info("%d data-parallel replicas on %s", n, ", ".join(c.device for c in configs))
    return configs
