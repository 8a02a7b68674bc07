"""The worker process of a tensor-parallel engine: one rank's DeviceWorker and its command loop.

:func:`worker_main` is the entry point a process of rank ``1..N-1`` runs (the
multiprocessing executor spawns it; another launcher, such as a Ray actor, can
call it the same way). It joins the engine's process group, builds a
:class:`~backplane.engine.worker.device_worker.DeviceWorker` on its device and
then does what the driver's commands (:mod:`.messages`) say, in their order,
so that every collective of the model meets its peers on the other ranks.

A step is never prepared here: the driver's prepared step arrives as its
packed bytes (:meth:`~backplane.engine.worker.inputs.InputBatch.adopt`), on
CUDA with the device bytes broadcast from rank 0 (the tokens still in flight
are resolved there).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from backplane.engine.distributed import messages as msg
from backplane.engine.distributed.group import join_group, leave_group

if TYPE_CHECKING:
    from backplane.engine.config import EngineConfig
    from backplane.engine.kv_cache.host_tier import HostTier
    from backplane.engine.worker.device_worker import DeviceWorker
    from backplane.engine.worker.inputs import BatchInputs

logger = logging.getLogger(__name__)

__all__ = ["WorkerLoop", "worker_main"]


class WorkerLoop:
    """Runs the driver's commands on one rank's worker until told to shut down.

    :param worker: this rank's worker (constructed, nothing loaded yet).
    :param conn: this rank's end of the driver's pipe.
    :param rank: this rank.
    """

    def __init__(self, worker: DeviceWorker, conn: Connection, rank: int) -> None:
        self.worker = worker
        self.conn = conn
        self.rank = rank
        self._inputs: BatchInputs | None = None
        self._hidden: torch.Tensor | None = None
        self._host_tier: HostTier | None = None

    def run(self) -> None:
        """Receive and run commands until :data:`~.messages.SHUTDOWN` (or the pipe closes)."""
        while True:
            try:
                name, arg = self.conn.recv()
            except EOFError:  # the driver is gone: nothing more will come
                logger.warning("rank %d: the driver closed its pipe; exiting", self.rank)
                return
            if name == msg.SHUTDOWN:
                self.conn.send(("ok", None))
                return
            answer = self.handle(name, arg)
            if name in (msg.LOAD, msg.START):
                self.conn.send(("ok", answer))

    # Any: each command has its own argument (see messages)
    def handle(self, name: str, arg: Any) -> Any:
        """Run one command.

        :param name: one of the command names of :mod:`.messages`.
        :param arg: its argument.
        :return: the answer of a start-up command, else ``None``.
        :raises ValueError: an unknown command.
        """
        w = self.worker
        if name == msg.ADOPT_STEP:
            packet, host_bytes = arg
            ib = w.input_batch
            self._inputs = ib.adopt(packet, host_bytes)
            if w.device.type == "cuda":
                dist.broadcast(ib.step_bytes(packet, device=True), src=0)
            return None
        if name == msg.EXECUTE:
            assert self._inputs is not None
            # a speculative verification's per-position states, as the driver marked them
            self._inputs.metadata.verify_states = msg.from_portable(arg, w.device)
            self._hidden = w.execute_model(self._inputs)
            return None
        if name == msg.VERIFY_LOGITS:
            assert self._hidden is not None
            w.compute_logits(self._hidden, torch.from_numpy(arg).to(w.device))
            return None
        if name == msg.KEEP_STATES:
            src, dst = msg.from_portable(arg, w.device)
            w.keep_verified_states(src, dst)
            return None
        if name == msg.SAMPLE:
            assert self._inputs is not None and self._hidden is not None
            w.sample_tokens(self._hidden, self._inputs, msg.from_portable(arg, w.device))
            return None
        if name == msg.HOST_COPY:
            assert self._host_tier is not None
            src, dst, to_host = arg
            self._host_tier.copy_pages(src, dst, to_host=to_host)
            return None
        if name == msg.HOST_TIER:
            from backplane.engine.kv_cache.host_tier import HostTier

            self._host_tier = HostTier(w.paged_cache_tensors(), int(arg))
            return None
        if name == msg.LOAD:
            w.load_model()
            return w.determine_num_kv_pages()
        if name == msg.START:
            w.initialize_cache(int(arg))
            w.compile_or_warm_up_model()
            return None
        raise ValueError(f"unknown worker command {name!r}")


#: seconds between the orphan watch's looks at the parent process
PARENT_POLL_S = 1.0


def _exit_when_orphaned(rank: int, parent: int) -> None:
    """End this process once its parent (the driver's process) is gone.

    A worker blocked inside a collective never reads its pipe again, so the
    pipe's end-of-file cannot stop it; left alone it would spin on its GPU
    (slowing every later job there) until NCCL's own timeout.

    :param rank: this worker's rank (for the log).
    :param parent: the driver's process id.
    """
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    logger.error("rank %d: the driver's process %d is gone; exiting", rank, parent)
    sys.stderr.flush()
    os._exit(1)


def _own_progress_lock() -> None:
    """Give this process's progress bars a lock of its own (a thread lock).

    tqdm otherwise makes a multiprocessing lock when its first bar starts (even a
    disabled one), a semaphore that the resource tracker shared with the driver
    counts: this process leaves with ``os._exit``, which never releases it, and
    the driver's exit would warn of a leaked semaphore. (The ranks' bars are the
    driver's to show: the weight loader and the graph capture show theirs on
    rank 0 only.)
    """
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def worker_main(
    rank: int,
    size: int,
    config: EngineConfig,
    init_method: str,
    conn: Connection,
    driver_pid: int | None = None,
) -> None:
    """Entry point of the worker process of ``rank``: join the group, build the worker, serve.

    Any exception is sent to the driver as ``("error", text)`` and ends the
    process with exit code 1; the driver turns it into an error naming the rank.

    :param rank: this worker's rank (1..size-1).
    :param size: the number of ranks.
    :param config: this rank's configuration (its device set by the driver).
    :param init_method: the process group's rendezvous address.
    :param conn: this rank's end of the driver's pipe.
    :param driver_pid: the driver's process id, when it is this process's parent
        (the process ends once the driver is gone); ``None`` for no watch.
    """
    logging.basicConfig(
        level=os.environ.get("BACKPLANE_WORKER_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s",
    )
    _own_progress_lock()
    from backplane.engine.worker.device_worker import DeviceWorker

    if driver_pid is not None:
        # the driver's id comes from the driver: read here, a driver that died while this
        # process started would already have been replaced as its parent
        threading.Thread(
            target=_exit_when_orphaned,
            args=(rank, driver_pid),
            name="backplane-orphan-watch",
            daemon=True,
        ).start()
    code = 0
    worker = None
    try:
        join_group(
            rank,
            size,
            init_method,
            config.torch_device,
            one_shot=config.custom_all_reduce,
        )
        worker = DeviceWorker(config)
        WorkerLoop(worker, conn, rank).run()
    except BaseException as exc:
        code = 1
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        logger.error("rank %d failed:\n%s", rank, text)
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except (OSError, ValueError):  # the driver is gone already
            pass
    finally:
        if worker is not None:
            worker.shutdown()
        if code == 0:
            leave_group()
        conn.close()
    # Leave without the interpreter's teardown: a group whose peer failed cannot be torn
    # down cleanly, and after a clean leave the communicators' C++ threads can still abort
    # the process while static objects are destroyed ("terminate called without an
    # active exception"), which would look like a failure to whoever watches the exit code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
