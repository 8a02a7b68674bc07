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

Under Ray each actor sees only the GPU Ray gave it, as ``cuda:0``. Rank 0
uses the engine's configured device, which Ray does not know about: on a
machine where the driver's GPU is also one of Ray's, start Ray with that GPU
left out (``CUDA_VISIBLE_DEVICES`` or ``--num-gpus``).
"""

from __future__ import annotations

import logging
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
    _Proc,
)
from backplane.engine.distributed.worker_proc import worker_main
from backplane.engine.worker.device_worker import DeviceWorker

if TYPE_CHECKING:
    from backplane.core.registry import BackendRegistry
    from backplane.engine.config import EngineConfig

logger = logging.getLogger(__name__)

__all__ = ["RayExecutor", "RankActor"]

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
        self.size = int(config.tensor_parallel_size)
        self._procs: list[_Proc] = []
        self._failure: WorkerFailedError | None = None
        self._closed = False
        self._joined = False
        self._actors: list[Any] = []  # every actor started, connected or not
        driver_config = rank_config(config, 0)
        self._on_cuda = driver_config.device_type == "cuda"
        host = _node_address()
        init_method = f"tcp://{host}:{_free_port(host)}"
        authkey = secrets.token_bytes(32)
        self._listener = Listener((host, 0), authkey=authkey)
        try:
            self._actors = actors = self._start_actors()
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
                _Proc(rank, p, conns[rank])  # type: ignore[arg-type]
                for rank, p in enumerate(processes, start=1)
            ]
            self._join(init_method, driver_config.torch_device)
            self.driver = DeviceWorker(driver_config, registry)
            self._start_up()
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "tensor parallel on Ray: %d ranks (%s)", self.size, "nccl" if self._on_cuda else "gloo"
        )

    def _start_actors(self) -> list[Any]:
        """One actor per rank 1..N-1, with the resources of one rank."""
        ray = self._ray
        if self._on_cuda:
            resources: dict[str, float] = {"num_gpus": 1, "num_cpus": 0}
        else:
            resources = {"num_cpus": 1}
        cls = ray.remote(RankActor)
        need = self.size - 1
        have = ray.available_resources()
        key = "GPU" if self._on_cuda else "CPU"
        if have.get(key, 0.0) < need:
            raise ConfigError(
                f"tensor_parallel_size={self.size} on Ray needs {need} free {key}(s) for ranks "
                f"1..{need}, but the cluster has {have.get(key, 0.0):g} free; add nodes, free "
                "resources, or lower tensor_parallel_size"
            )
        return [
            cls.options(name=None, max_restarts=0, **resources).remote()  # type: ignore[arg-type]
            for _ in range(need)
        ]

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

    def _start_up(self) -> None:
        """The worker start-up sequence on every rank in lock-step (as the multi-process one)."""
        from backplane.engine.distributed import messages as msg

        self._send_all(msg.LOAD)
        self._guard(self.driver.load_model)
        pages = [self._guard(self.driver.determine_num_kv_pages)]
        pages += self._answers()
        self.num_pages = min(int(p) for p in pages)
        if len(set(pages)) > 1:
            logger.info("KV pages per rank %s: every rank uses %d", pages, self.num_pages)
        self._send_all(msg.START, self.num_pages)
        self._guard(self.driver.initialize_cache, self.num_pages)
        self._guard(self.driver.compile_or_warm_up_model)
        self._answers()

    def shutdown(self) -> None:
        """Shut every rank down, then kill its actor (freeing its resources); idempotent."""
        super().shutdown()
        for actor in self._actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # Ray itself is shutting down: the actor goes with it
                logger.debug("killing a rank's actor failed", exc_info=True)
        self._actors = []
        try:
            self._listener.close()
        except OSError:
            pass

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the ranks' actors (ranks 1..N-1)."""
        return [int(p.process.pid or 0) for p in self._procs]
