"""The configurations of data-parallel engine replicas: one engine per replica, each on its devices.

With ``data_parallel_size = N`` an :class:`~backplane.api.async_llm.AsyncLLM`
runs N whole engines, each with its own scheduler, KV cache and engine-loop
thread, and spreads the requests over them (:mod:`backplane.api.balancing`).
On CUDA replica ``i`` of a ``tensor_parallel_size = T`` configuration gets the
devices ``[base + i*T, base + (i+1)*T)``, where ``base`` is the index of the
configured device (``cuda:0`` for ``cuda``). On the CPU every replica runs on
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
    :raises ConfigError: the machine has fewer GPUs than the replicas need.
    """
    n = config.data_parallel_size
    if n == 1:
        return [config]
    if config.device_type != "cuda":
        threads = config.threads
        if threads is None:
            threads = max(1, available_cores() // n)
        return [config.merge(device="cpu", threads=threads, data_parallel_size=1)] * n
    tp = config.tensor_parallel_size
    _, _, index = config.device_resolved.partition(":")
    base = int(index) if index else 0
    needed = base + n * tp
    have = _cuda_device_count()
    if needed > have:
        key = "data_parallel_size"
        raise ConfigError(
            f"{config.origin(key).where(key)}: {n} replicas of {tp} GPU(s) each from "
            f"cuda:{base} need GPUs up to cuda:{needed - 1}, but this machine has {have}; "
            "lower data_parallel_size (or tensor_parallel_size), or start from a lower device"
        )
    configs = [config.merge(device=f"cuda:{base + i * tp}", data_parallel_size=1) for i in range(n)]
    logger.info(
        "%d data-parallel replicas on %s",
        n,
        ", ".join(f"cuda:{base + i * tp}..cuda:{base + (i + 1) * tp - 1}" for i in range(n))
        if tp > 1
        else ", ".join(c.device for c in configs),
    )
    return configs
