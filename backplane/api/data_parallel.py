"""The configurations of data-parallel engine replicas: one engine per replica, each on its devices.

With ``data_parallel_size = N`` an :class:`~backplane.api.async_llm.AsyncLLM`
runs N whole engines, each with its own scheduler, KV cache and engine-loop
thread, and spreads the requests over them (:mod:`backplane.api.balancing`).
On CUDA replica ``i`` gets the devices from ``cuda:base + i * tp`` on (``tp``
of them, one per tensor-parallel rank), where ``base`` is the index of the
configured device (``cuda:0`` for ``cuda``). On the CPU every replica runs on
``cpu``; a replica whose ``threads`` is left automatic gets its share of the
cores (and each of its ranks an equal part of that), so that the replicas do
not oversubscribe them.

Without tensor parallelism the replicas share the front's process. With it,
each replica needs a ``torch.distributed`` group of its own, and a process
holds one: replica 0 stays in the front's process and every other replica runs
in an engine process of its own (:func:`replica_in_own_process`,
:mod:`backplane.api.engine_process`).
"""

from __future__ import annotations

import logging

from backplane.core.errors import ConfigError
from backplane.engine.config import EngineConfig
from backplane.engine.threads import available_cores

logger = logging.getLogger(__name__)

__all__ = ["replica_configs", "replica_in_own_process"]


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def replica_configs(config: EngineConfig) -> list[EngineConfig]:
    """Split a configuration into the configurations of its data-parallel replicas.

    :param config: the engine configuration (its ``data_parallel_size`` says how many).
    :return: one configuration per replica, each with ``data_parallel_size=1``
        and its own devices; a single replica's is ``config`` itself.
    :raises ConfigError: the machine has fewer GPUs than the replicas' ranks need.
    """
    n = config.data_parallel_size
    if n == 1:
        return [config]
    tp = int(config.tensor_parallel_size)
    if config.device_type != "cuda":
        threads = config.threads
        if threads is None:
            threads = max(1, available_cores() // (n * tp))
        return [config.merge(device="cpu", threads=threads, data_parallel_size=1)] * n
    _, _, index = config.device_resolved.partition(":")
    base = int(index) if index else 0
    have = _cuda_device_count()
    if base + n * tp > have:
        key = "data_parallel_size"
        raise ConfigError(
            f"{config.origin(key).where(key)}: {n} replicas of {tp} GPU(s) each from "
            f"cuda:{base} need GPUs up to cuda:{base + n * tp - 1}, but this machine has "
            f"{have}; lower data_parallel_size or tensor_parallel_size, or start from a "
            "lower device"
        )
    configs = [config.merge(device=f"cuda:{base + i * tp}", data_parallel_size=1) for i in range(n)]
    logger.info("%d data-parallel replicas on %s", n, ", ".join(c.device for c in configs))
    return configs


def replica_in_own_process(config: EngineConfig, index: int) -> bool:
    """Whether replica ``index`` runs in an engine process of its own.

    Replica 0 always runs in the front's process; the others do when they
    split their model over tensor-parallel ranks (each needs its own
    ``torch.distributed`` group, and a process holds one).

    :param config: the replica's configuration (from :func:`replica_configs`).
    :param index: the replica's number.
    :return: ``True`` for an engine process.
    """
    return index > 0 and int(config.tensor_parallel_size) > 1
