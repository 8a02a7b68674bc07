"""The Ray executor: the tensor-parallel workers of ranks ``1..N-1`` as Ray actors.

``distributed_executor_backend="ray"`` places each worker rank on a Ray
cluster (the one ``ray.init`` joined, or a local one started here) as an actor
of its own, one CPU each on the CPU and one GPU each on CUDA, so that the
ranks of an engine may run on several machines. Rank 0 stays in the engine's
process, as with :class:`~.multiproc.MultiprocExecutor`, and everything after
the start is the same: the actor runs the same entry point
(:func:`~.worker_proc.worker_main`) and the driver sends it the same commands
(:mod:`.messages`) over a :mod:`multiprocessing.connection` link the actor
opens back to the driver (TCP, with a random key), and the ranks meet in one
torch.distributed group (gloo on the CPU, NCCL on CUDA) at the driver's
address.

A rank's actor that raises reports it and exits; one that dies is seen by Ray.
Either ends the engine with a :class:`~.errors.WorkerFailedError` naming the
rank, and every actor of the engine is killed, on failure and on shutdown.

Ray is an optional extra (``pip install 'backplane[ray]'``).

The ranks are placed through one placement group of ``N`` bundles (strategy
``PACK``: as few nodes as the resources allow). Bundle 0 is rank 0's: it sits
on the driver's node and holds the driver's CPU or GPU, so Ray never hands
that device to a rank's actor; ranks ``1..N-1`` take bundles ``1..N-1``. Each
actor sees only the GPU Ray gave it, as ``cuda:0``; on CUDA a small actor
holds bundle 0's GPU for the life of the engine and tells the driver which
one it is, and the driver runs on that GPU (:func:`driver_cuda_index`).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING, Any

from backplane.core.errors import ConfigError
from backplane.engine.distributed.errors import WorkerFailedError
from backplane.engine.distributed.group import rank_config
from backplane.engine.distributed.multiproc import (
    START_TIMEOUT,
    MultiprocExecutor,
    RankProcess,
)
from backplane.engine.distributed.worker_proc import worker_main

if TYPE_CHECKING:
    from backplane.core.registry import BackendRegistry
    from backplane.engine.config import EngineConfig

logger = logging.getLogger(__name__)

__all__ = ["RankActor", "RayExecutor", "driver_cuda_index", "placement_bundles"]

#: Seconds Ray may take to place and start the ranks' actors.
ACTOR_START_TIMEOUT = 300.0


def import_ray() -> Any:
    """Import Ray, or say how to install it.

    :return: the ``ray`` module.
    :raises ConfigError: Ray is not installed.
    """
    try:
        import ray
    except ModuleNotFoundError:
        raise ConfigError(
            "distributed_executor_backend='ray' needs Ray, which is not installed; "
            "install the extra (pip install 'backplane[ray]') or use "
            "distributed_executor_backend='mp'"
        ) from None
    return ray


class RankActor:
    """What a Ray actor of one worker rank runs (made a Ray actor class by the executor).

    Its :meth:`run` blocks for the life of the rank: the actor takes no other
    call meanwhile, so :meth:`pid` is asked first.
    """

    def pid(self) -> int:
        """The actor's process id.

        :return: the id.
        """
        import os

        return os.getpid()

    def run(
        self,
        rank: int,
        size: int,
        config: EngineConfig,
        init_method: str,
        address: tuple[str, int],
        authkey: bytes,
    ) -> None:
        """Connect to the driver and serve its commands until it shuts the rank down.

        :param rank: this actor's rank (1..size-1).
        :param size: the number of ranks.
        :param config: this rank's configuration.
        :param init_method: the process group's rendezvous address.
        :param address: where the driver listens for its ranks' command links.
        :param authkey: the key of that listener.
        """
        conn = Client(address, authkey=authkey)
        conn.send(rank)  # the driver takes the links in any order and sorts them by rank
        worker_main(rank, size, config, init_method, conn)


class DeviceHolder:
    """What the actor holding rank 0's bundle runs: it only says which GPUs Ray gave it."""

    def gpu_ids(self) -> list[str]:
        """The ids of the GPUs Ray assigned to this actor (as ``CUDA_VISIBLE_DEVICES`` names them).

        :return: the ids, as strings.
        """
        import ray

        return [str(i) for i in ray.get_gpu_ids()]


def placement_bundles(size: int, device_key: str, node_ip: str) -> list[dict[str, float]]:
    """The placement group's bundles of a ``size``-rank engine: rank 0's first, on the driver's node.

    :param size: the number of ranks.
    :param device_key: the resource each rank takes one of (``"GPU"`` or ``"CPU"``).
    :param node_ip: the driver's node address (bundle 0 is pinned there through
        Ray's ``node:<ip>`` resource).
    :return: ``size`` bundles, bundle ``r`` for rank ``r``.
    """
    bundles: list[dict[str, float]] = [{device_key: 1.0, f"node:{node_ip}": 0.001}]
    bundles += [{device_key: 1.0} for _ in range(size - 1)]
    return bundles


def driver_cuda_index(ray_gpu_ids: list[str], visible: str | None) -> int:
    """The driver's CUDA device index for the GPU Ray reserved for rank 0.

    Ray names GPUs as the node sees them (``CUDA_VISIBLE_DEVICES`` of the Ray
    node); the driver's process may see a subset of them, renumbered from 0.

    :param ray_gpu_ids: the ids :meth:`DeviceHolder.gpu_ids` reported (one).
    :param visible: the driver's ``CUDA_VISIBLE_DEVICES`` (``None``: every GPU, in order).
    :return: the index of that GPU in the driver's process.
    :raises ConfigError: the GPU is not visible to the driver.
    """
    if len(ray_gpu_ids) != 1:
        raise ConfigError(
            f"Ray gave rank 0's bundle {len(ray_gpu_ids)} GPUs ({ray_gpu_ids}), not one; "
            "check the cluster's GPU resources (ray status)"
        )
    gpu = ray_gpu_ids[0].strip()
    if visible is None or not visible.strip():
        return int(gpu)
    names = [v.strip() for v in visible.split(",")]
    if gpu not in names:
        raise ConfigError(
            f"Ray reserved GPU {gpu} of this node for rank 0, but this process sees only "
            f"CUDA_VISIBLE_DEVICES={visible}; start the engine with that GPU visible, or start "
            "Ray with the same CUDA_VISIBLE_DEVICES as the engine's process"
        )
    return names.index(gpu)


class _ActorProcess:
    """A rank's actor seen as the process the multi-process executor watches.

    :param ray: the ``ray`` module.
    :param actor: the actor's handle.
    :param pid: the actor's process id.
    :param done: the reference :meth:`RankActor.run` returns when the rank ends.
    """

    def __init__(self, ray: Any, actor: Any, pid: int, done: Any) -> None:
        self._ray = ray
        self.actor = actor
        self.pid = pid
        self.done = done
        self._exitcode: int | None = None

    def is_alive(self) -> bool:
        """Whether the rank still runs (its :meth:`RankActor.run` has not ended)."""
        ready, _ = self._ray.wait([self.done], timeout=0)
        return not ready

    @property
    def exitcode(self) -> int | None:
        """0 when the rank ended on its own, 1 when it failed or its actor died; ``None`` alive."""
        if self._exitcode is None and not self.is_alive():
            try:
                self._ray.get(self.done)
                self._exitcode = 0
            except Exception:
                self._exitcode = 1
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the rank to end.

        :param timeout: seconds (``None``: as long as it takes).
        """
        self._ray.wait([self.done], timeout=timeout)

    def kill(self) -> None:
        """Kill the actor (and with it the rank's process)."""
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # Ray itself is shutting down: the actor goes with it
            logger.debug("killing a rank's actor failed", exc_info=True)


def _node_address() -> str:
    """The IP address of this node as the Ray cluster sees it."""
    ray = import_ray()
    return str(ray.util.get_node_ip_address())


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RayExecutor(MultiprocExecutor):
    """An :class:`~backplane.engine.executor.Executor` whose ranks ``1..N-1`` are Ray actors.

    The steps, the shutdown and the fault handling are those of
    :class:`~.multiproc.MultiprocExecutor`; only where the ranks run differs.

    :param config: the engine configuration (``tensor_parallel_size > 1``).
    :param registry: the plugin registry rank 0 chooses backends from.
    :raises ConfigError: Ray is not installed, or the cluster lacks the resources.
    :raises WorkerFailedError: a rank failed during start-up.
    """

    def __init__(self, config: EngineConfig, registry: BackendRegistry | None = None) -> None:
        ray = import_ray()
        if not ray.is_initialized():
            logger.info("joining a Ray cluster (RAY_ADDRESS, or a local one)")
            ray.init()
        self._ray = ray
        self._init_state(config)
        self._actors: list[Any] = []  # every actor started, connected or not
        self._holder: Any = None
        self._placement: Any = None
        driver_config = rank_config(config, 0)
        self._on_cuda = driver_config.device_type == "cuda"
        host = _node_address()
        self._host = host
        init_method = f"tcp://{host}:{_free_port(host)}"
        authkey = secrets.token_bytes(32)
        self._listener = Listener((host, 0), authkey=authkey)
        try:
            self._actors = actors = self._start_actors()
            if self._on_cuda:
                driver_config = self._driver_on_reserved_gpu(driver_config)
            pids = self._actor_pids(actors)
            dones = [
                a.run.remote(
                    rank,
                    self.size,
                    self._actor_config(config, rank),
                    init_method,
                    self._listener.address,
                    authkey,
                )
                for rank, a in enumerate(actors, start=1)
            ]
            processes = [
                _ActorProcess(ray, a, pid, done)
                for a, pid, done in zip(actors, pids, dones, strict=True)
            ]
            conns = self._accept(processes)
            # the multi-process executor's steps, shutdown and fault handling take it from here
            self._procs = [
                RankProcess(rank, p, conns[rank])  # type: ignore[arg-type]
                for rank, p in enumerate(processes, start=1)
            ]
            self._start_driver(init_method, driver_config, registry)
        except BaseException:
            self.shutdown()
            raise
        self._watch_and_exit_hooks()
        logger.info(
            "tensor parallel on Ray: %d ranks (%s)", self.size, "nccl" if self._on_cuda else "gloo"
        )

    def _start_actors(self) -> list[Any]:
        """Reserve a bundle per rank (rank 0's on this node) and start ranks 1..N-1's actors."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        if self._on_cuda:
            resources: dict[str, float] = {"num_gpus": 1, "num_cpus": 0}
        else:
            resources = {"num_cpus": 1}
        key = "GPU" if self._on_cuda else "CPU"
        have = ray.available_resources()
        if have.get(key, 0.0) < self.size:
            raise ConfigError(
                f"tensor_parallel_size={self.size} on Ray needs {self.size} free {key}(s), one "
                f"per rank (rank 0's on this node), but the cluster has {have.get(key, 0.0):g} "
                "free; add nodes, free resources, or lower tensor_parallel_size"
            )
        self._placement = pg = placement_group(
            placement_bundles(self.size, key, self._host), strategy="PACK"
        )
        try:
            ray.get(pg.ready(), timeout=ACTOR_START_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                f"Ray could not reserve {self.size} {key}(s), one on this node ({self._host}), "
                f"in {ACTOR_START_TIMEOUT:.0f} s; check the nodes' free resources (ray status)"
            ) from None

        def placed(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index
            )

        if self._on_cuda:
            # holds rank 0's GPU inside its bundle, so no rank's actor is given it
            self._holder = (
                ray.remote(DeviceHolder)
                .options(max_restarts=0, scheduling_strategy=placed(0), **resources)
                .remote()
            )
        cls = ray.remote(RankActor)
        return [
            cls.options(  # type: ignore[arg-type]
                name=None, max_restarts=0, scheduling_strategy=placed(rank), **resources
            ).remote()
            for rank in range(1, self.size)
        ]

    def _driver_on_reserved_gpu(self, config: EngineConfig) -> EngineConfig:
        """Rank 0's configuration on the GPU its bundle holds (logged when it moves)."""
        ids = self._ray.get(self._holder.gpu_ids.remote(), timeout=ACTOR_START_TIMEOUT)
        index = driver_cuda_index(ids, os.environ.get("CUDA_VISIBLE_DEVICES"))
        device = f"cuda:{index}"
        if device != config.device_resolved:
            logger.info(
                "rank 0 runs on %s: the GPU Ray reserved for it (configured: %s)",
                device,
                config.device_resolved,
            )
        return config.merge(device=device)

    def _actor_pids(self, actors: list[Any]) -> list[int]:
        """Wait for the actors to start; their process ids."""
        ray = self._ray
        try:
            return [
                int(p)
                for p in ray.get([a.pid.remote() for a in actors], timeout=ACTOR_START_TIMEOUT)
            ]
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                f"Ray did not start the actors of ranks 1..{len(actors)} in "
                f"{ACTOR_START_TIMEOUT:.0f} s; check that the cluster's nodes are up and "
                "have the CPUs / GPUs free (ray status)"
            ) from None

    def _actor_config(self, config: EngineConfig, rank: int) -> EngineConfig:
        """A rank's configuration inside its actor: on CUDA the one GPU Ray gave it."""
        if self._on_cuda:
            return config.merge(device="cuda:0")
        return rank_config(config, rank)

    def _accept(self, processes: list[_ActorProcess]) -> dict[int, Connection]:
        """Take the command link of every rank, watching the actors meanwhile.

        :param processes: the ranks' actors, rank 1 first.
        :return: each rank's link.
        """
        count = len(processes)
        conns: dict[int, Connection] = {}
        error: list[BaseException] = []
        done = threading.Event()

        def accept() -> None:
            try:
                while len(conns) < count:
                    conn = self._listener.accept()
                    conns[int(conn.recv())] = conn
            except BaseException as exc:
                error.append(exc)
            finally:
                done.set()

        threading.Thread(target=accept, name="backplane-ray-accept", daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT
        while not done.wait(0.1):
            for rank, p in enumerate(processes, start=1):
                if not p.is_alive():
                    self._fail(WorkerFailedError(rank, "ended before it connected to the driver"))
            if time.monotonic() > deadline:
                self._fail(
                    WorkerFailedError(
                        min(set(range(1, count + 1)) - set(conns)),
                        f"did not connect in {START_TIMEOUT:.0f} s",
                    )
                )
        if error:
            raise error[0]
        return conns

    def shutdown(self) -> None:
        """Shut every rank down, then kill its actor (freeing its resources); idempotent."""
        super().shutdown()
        for actor in self._actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # Ray itself is shutting down: the actor goes with it
                logger.debug("killing a rank's actor failed", exc_info=True)
        self._actors = []
        if self._holder is not None:
            try:
                self._ray.kill(self._holder, no_restart=True)
            except Exception:
                logger.debug("killing rank 0's device holder failed", exc_info=True)
            self._holder = None
        if self._placement is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._placement)
            except Exception:  # Ray itself is shutting down: the group goes with it
                logger.debug("removing the placement group failed", exc_info=True)
            self._placement = None
        try:
            self._listener.close()
        except OSError:
            pass
