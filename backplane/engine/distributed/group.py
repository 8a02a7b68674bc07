"""The torch.distributed group of a tensor-parallel engine: address, devices, set-up.

Rank 0 (the driver, in the engine's process) and every worker process join one
process group over a free localhost TCP port: NCCL when the devices are CUDA,
gloo on the CPU. Each process then makes the group its
:func:`~backplane.core.parallel.tensor_parallel` group, before its model is
built, so that the model's layers shard themselves over it.
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from backplane.core.parallel import (
    TensorParallel,
    abort_small_all_reduce,
    set_small_all_reduce,
    set_tensor_parallel,
)
from backplane.engine.threads import available_cores

if TYPE_CHECKING:
    from backplane.engine.config import EngineConfig

logger = logging.getLogger(__name__)

__all__ = ["abort_group", "free_tcp_address", "join_group", "leave_group", "rank_config"]

#: How long a collective may wait for a peer before it fails (a dead peer ends it sooner).
GROUP_TIMEOUT = timedelta(minutes=10)


def free_tcp_address() -> str:
    """A ``tcp://127.0.0.1:PORT`` address on a port free now, for the group's rendezvous.

    :return: the init method string for :func:`torch.distributed.init_process_group`.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The configuration the worker of ``rank`` runs with.

    On CUDA rank ``r`` takes the ``r``-th device after the configured one
    (``cuda`` or ``cuda:0`` -> ``cuda:r``). Every rank gets an even share of
    the cores unless ``threads`` is set, so the ranks' intra-op threads do not
    fight over the same cores (on a GPU the host work of each rank's step is
    what they would slow).

    :param config: the engine's configuration.
    :param rank: the worker's rank.
    :return: the configuration with that rank's ``device`` (and ``threads``).
    :raises ConfigError: fewer CUDA devices than ranks.
    """
    from backplane.core.errors import ConfigError

    size = int(config.tensor_parallel_size)
    device = config.device_resolved
    if device.startswith("cuda"):
        base = int(device.split(":", 1)[1]) if ":" in device else 0
        count = torch.cuda.device_count()
        if base + size > count:
            raise ConfigError(
                f"tensor_parallel_size={size} on {device} needs CUDA devices {base}.."
                f"{base + size - 1} but {count} are visible; lower tensor_parallel_size or "
                "make more devices visible (CUDA_VISIBLE_DEVICES)"
            )
        device = f"cuda:{base + rank}"
    overrides: dict[str, object] = {"device": device}
    if config.threads is None:
        overrides["threads"] = max(1, available_cores() // size)
    return config.merge(**overrides)


def join_group(
    rank: int, size: int, init_method: str, device: torch.device, *, one_shot: bool = False
) -> TensorParallel:
    """Join the engine's process group and make it this process's tensor-parallel group.

    :param rank: this process's rank (0 is the driver).
    :param size: the number of ranks.
    :param init_method: the rendezvous address (:func:`free_tcp_address`).
    :param device: this rank's device (CUDA: NCCL, and the current device is set).
    :param one_shot: on CUDA, set up the one-shot all-reduce for small messages
        (:func:`~backplane.engine.distributed.one_shot.setup_one_shot`; every
        rank must pass the same).
    :return: the group, also set with :func:`~backplane.core.parallel.set_tensor_parallel`.
    """
    backend = "gloo"
    kwargs: dict[str, object] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
        kwargs["device_id"] = device
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=GROUP_TIMEOUT,
        **kwargs,  # type: ignore[arg-type]
    )
    tp = TensorParallel(rank=rank, size=size, group=dist.group.WORLD)
    set_tensor_parallel(tp)
    if one_shot and device.type == "cuda" and size > 1:
        from backplane.engine.distributed.one_shot import setup_one_shot

        setup_one_shot(tp.group, rank, size, device)
    logger.debug("rank %d of %d joined the %s group at %s", rank, size, backend, init_method)
    return tp


def leave_group() -> None:
    """Leave the process group (if joined) and return to one rank."""
    set_tensor_parallel(TensorParallel())
    small = set_small_all_reduce(None)
    if small is not None:
        try:
            small.close()
        except Exception:  # leaving anyway: a buffer not freed goes with the process
            logger.warning("freeing the one-shot all-reduce's buffers failed", exc_info=True)
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peers died cannot always be torn down cleanly
            logger.debug("destroying the process group failed", exc_info=True)


def abort_group() -> None:
    """Make the collectives this process is blocked in return with an error, from any thread.

    A NCCL collective whose peer died waits for it forever (until the group
    timeout); aborting the communicators ends the wait, so the caller can say
    which rank was lost. gloo notices a dead peer by itself (its sockets
    close), so there is nothing to abort. The one-shot all-reduce's kernel
    waits for its peers' flags on the device, out of NCCL's reach: it is
    aborted first (its word in host memory), so that the device gets past the
    wait and the driver's next synchronisation returns.
    """
    abort_small_all_reduce()
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() != "nccl":
        return
    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    except Exception:  # an older torch, or a group already torn down
        logger.warning("aborting the NCCL communicators failed", exc_info=True)
