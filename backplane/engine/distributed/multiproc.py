"""The multi-process executor: one worker process per tensor-parallel rank on this machine.

Rank 0 is a :class:`~backplane.engine.worker.device_worker.DeviceWorker` in the
engine's own process (the driver: the engine loop, the scheduler and the KV
bookkeeping stay there); ranks ``1..N-1`` are processes started with the
``spawn`` method, each running :func:`~.worker_proc.worker_main`. Every call
the engine makes is sent to the workers first and then run on the driver, so
all ranks run the same work in the same order and their collectives meet.

Per step the driver prepares the inputs once; the other ranks adopt the
prepared step (its packed host bytes go down the pipes, and on CUDA the device
bytes, with the in-flight tokens resolved, are broadcast from rank 0). Every
rank runs the model and the sampling head (a vocabulary-parallel LM head
gathers its logits there); only the driver's sampled tokens are used.

Faults: a worker that raises reports it and exits, one that dies is found by
its exit code; either ends the engine with a
:class:`~.errors.WorkerFailedError` naming the rank, after every worker
process was ended. A watchdog thread waits on the workers' process sentinels:
when one dies while the driver is blocked in a collective that would wait for
it forever (NCCL, or the one-shot all-reduce's kernel), it aborts the group so
that the collective returns and the step fails naming the rank (a one-shot
all-reduce given up on returns no sum: the step's tokens are refused in
:meth:`MultiprocExecutor.check_results`).

Shutdown: the engine's shutdown (also :class:`~backplane.api.AsyncLLM`'s)
ends the workers and destroys the process group; an engine never shut down
is shut down the same way at interpreter exit, before torch's own teardown,
because a process group still alive then can abort the process
(``terminate called without an active exception``). Worker processes are
daemonic and also ended when the engine's process is killed, so none
outlives it.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backplane.core.errors import EngineClosedError
from backplane.core.parallel import small_all_reduce_aborted
from backplane.engine.distributed import messages as msg
from backplane.engine.distributed.errors import WorkerFailedError
from backplane.engine.distributed.group import (
    abort_group,
    free_tcp_address,
    join_group,
    leave_group,
    rank_config,
)
from backplane.engine.distributed.worker_proc import worker_main
from backplane.engine.sampling import SamplerOutput, SamplingRows
from backplane.engine.worker.device_worker import DeviceWorker
from backplane.engine.worker.inputs import BatchInputs, ScheduledSeqLike

if TYPE_CHECKING:
    from backplane.core.registry import BackendRegistry
    from backplane.engine.config import EngineConfig
    from backplane.engine.kv_cache.host_tier import HostTier

logger = logging.getLogger(__name__)

__all__ = ["MultiprocExecutor"]

#: Seconds a start-up command may take on a worker (model loading, graph capture).
START_TIMEOUT = 1800.0
#: Seconds to wait for a failing worker to report or exit, after a collective failed.
FAILURE_GRACE = 10.0
#: Seconds a worker gets to exit on shutdown before it is killed.
EXIT_TIMEOUT = 10.0
#: Seconds between the watchdog's looks at whether the executor was shut down.
WATCH_INTERVAL = 0.5


class RankProcess:
    """A rank's worker process and the driver's end of its command link.

    :param rank: the rank (1..N-1; rank 0 is the driver).
    :param process: the rank's process, or an object with its ``pid``,
        ``is_alive``, ``exitcode``, ``join`` and ``kill``.
    :param conn: the driver's end of the rank's command link.
    """

    def __init__(self, rank: int, process: mp.Process, conn: Connection) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        #: answers read off the link while looking for failures, kept for their reader
        self.inbox: collections.deque[tuple[str, Any]] = collections.deque()


class MultiprocExecutor:
    """An :class:`~backplane.engine.executor.Executor` over ``tensor_parallel_size`` ranks.

    Starts the worker processes, joins their process group, and runs the
    worker start-up sequence on every rank in lock-step (the KV page count is
    the smallest any rank can hold).

    :param config: the engine configuration (``tensor_parallel_size > 1``).
    :param registry: the plugin registry rank 0 chooses backends from; the worker
        processes use their process-wide registry (the installed plugins).
    :raises WorkerFailedError: a worker failed during start-up.
    :raises BackplaneError: rank 0 could not load the model or size its caches.
    """

    def __init__(self, config: EngineConfig, registry: BackendRegistry | None = None) -> None:
        self._init_state(config)
        init_method = free_tcp_address()
        ctx = mp.get_context("spawn")
        driver_config = rank_config(config, 0)
        self._on_cuda = driver_config.device_type == "cuda"
        try:
            for rank in range(1, self.size):
                parent, child = ctx.Pipe(duplex=True)
                process = ctx.Process(
                    target=worker_main,
                    args=(
                        rank,
                        self.size,
                        rank_config(config, rank),
                        init_method,
                        child,
                        os.getpid(),
                    ),
                    name=f"backplane-tp-rank{rank}",
                    daemon=True,
                )
                process.start()
                child.close()
                self._procs.append(RankProcess(rank, process, parent))
            # ends the workers if the executor is dropped without being shut down
            self._finalizer = weakref.finalize(self, _end_processes, list(self._procs))
            self._start_driver(init_method, driver_config, registry)
        except BaseException:
            self.shutdown()
            raise
        self._watch_and_exit_hooks()
        logger.info(
            "tensor parallel: %d ranks (%s)", self.size, "nccl" if self._on_cuda else "gloo"
        )

    def _init_state(self, config: EngineConfig) -> None:
        """Set the executor's bookkeeping before any rank starts (no ranks, no failure).

        :param config: the engine configuration (``tensor_parallel_size > 1``).
        """
        self.size = int(config.tensor_parallel_size)
        self._procs: list[RankProcess] = []
        self._failure: WorkerFailedError | None = None
        self._closed = False
        self._closing = False
        self._joined = False
        # held by each call into the ranks, so that a shutdown from another thread (at
        # interpreter exit) never tears the group down under a step in a collective
        self._lock = threading.RLock()
        self._stop_watch = threading.Event()

    def _start_driver(
        self, init_method: str, config: EngineConfig, registry: BackendRegistry | None
    ) -> None:
        """Join the group as rank 0, build the driver's worker and start every rank up.

        :param init_method: the group's rendezvous address.
        :param config: rank 0's configuration.
        :param registry: the plugin registry rank 0 chooses backends from.
        """
        self._join(init_method, config.torch_device, config.custom_all_reduce)
        self.driver = DeviceWorker(config, registry)
        self._start_up()

    def _start_up(self) -> None:
        """Run the worker start-up sequence on every rank in lock-step.

        Every rank loads the model and says how many KV pages it can hold; all
        of them then size their caches to the smallest count and warm up.
        """
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

    def _watch_and_exit_hooks(self) -> None:
        """Start the watchdog and register the exit hook (once the ranks are up)."""
        # registered after torch's own exit hooks, so it runs before them
        self._at_exit = functools.partial(_shutdown_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        threading.Thread(
            target=_watch,
            args=(weakref.ref(self), list(self._procs), self._stop_watch),
            name="backplane-tp-watchdog",
            daemon=True,
        ).start()

    def _join(self, init_method: str, device: torch.device, one_shot: bool) -> None:
        """Join the group on a helper thread, watching the workers meanwhile.

        The rendezvous waits for every rank; a worker that dies before it joins
        would leave the driver waiting for the whole group timeout.
        """
        done = threading.Event()
        error: list[BaseException] = []

        def join() -> None:
            try:
                join_group(0, self.size, init_method, device, one_shot=one_shot)
            except BaseException as exc:
                error.append(exc)
            finally:
                done.set()

        threading.Thread(target=join, name="backplane-tp-join", daemon=True).start()
        while not done.wait(0.1):
            failure = self._diagnose(wait=0.0)
            if failure is not None:
                self._fail(failure)
        if error:
            raise error[0]
        self._joined = True

    # -- the steps ----------------------------------------------------------------------------

    def prepare_inputs(
        self, scheduled: Sequence[ScheduledSeqLike], pending_tokens: torch.Tensor | None = None
    ) -> BatchInputs:
        """Prepare the step on the driver once and hand it to every other rank.

        :param scheduled: the scheduler's sequences (prefill/extend first).
        :param pending_tokens: the in-flight step's tokens on the driver's device, or ``None``.
        :return: the driver's inputs.
        """
        with self._lock:
            self._check()
            inputs = self.driver.prepare_inputs(scheduled, pending_tokens)
            ib = self.driver.input_batch
            step = ib.last_step
            assert step is not None
            host = ib.step_bytes(step, device=False).numpy().copy()
            self._send_all(msg.ADOPT_STEP, (step, host))
            if self._on_cuda:
                self._guard(dist.broadcast, ib.step_bytes(step, device=True), src=0, fatal=True)
            return inputs

    def execute_model(self, inputs: BatchInputs) -> torch.Tensor:
        """Run the model on every rank; see :meth:`Executor.execute_model`.

        :param inputs: from :meth:`prepare_inputs`.
        :return: the driver's hidden states.
        """
        with self._lock:
            self._check()
            self._send_all(msg.EXECUTE, msg.to_portable(inputs.metadata.verify_states))
            return self._guard(self.driver.execute_model, inputs, fatal=True)

    def sample_tokens(
        self, hidden: torch.Tensor, inputs: BatchInputs, rows: SamplingRows
    ) -> SamplerOutput:
        """Run the sampling head on every rank; the driver's tokens are the step's.

        :param hidden: from :meth:`execute_model`.
        :param inputs: the step's inputs.
        :param rows: the sampling sequences' parameters.
        :return: the driver's tokens (and logprobs where asked), on its device.
        """
        with self._lock:
            self._check()
            portable = rows
            if rows.processing is not None or rows.prompt is not None:
                portable = dataclasses.replace(
                    rows,
                    processing=msg.to_portable(rows.processing),
                    prompt=msg.to_portable(rows.prompt),
                )
            self._send_all(msg.SAMPLE, portable)
            return self._guard(self.driver.sample_tokens, hidden, inputs, rows, fatal=True)

    def check_results(self) -> None:
        """See :meth:`Executor.check_results`.

        A worker that died while the driver's device waited in the one-shot
        all-reduce had that wait aborted by the watchdog: the device went on
        with sums that are not sums, and the step's tokens are refused here.

        :raises WorkerFailedError: the all-reduce was aborted (naming the lost rank).
        """
        if not small_all_reduce_aborted():
            return
        with self._lock:
            if self._failure is not None:
                raise self._failure
            self._fail(
                self._diagnose(wait=FAILURE_GRACE)
                or WorkerFailedError(0, "(the driver) had its all-reduce aborted")
            )

    def compute_logits(self, hidden: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """Run the LM head over the rows on every rank; see :meth:`Executor.compute_logits`.

        :param hidden: from :meth:`execute_model`.
        :param rows: ``[R]`` int64 row indices.
        :return: the driver's logits.
        """
        with self._lock:
            self._check()
            rows = np.ascontiguousarray(rows, dtype=np.int64)
            self._send_all(msg.VERIFY_LOGITS, rows)
            at = torch.from_numpy(rows).to(hidden.device)
            return self._guard(self.driver.compute_logits, hidden, at, fatal=True)

    def keep_verified_states(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy the kept states on every rank; see :meth:`Executor.keep_verified_states`.

        :param src_slots: ``[V]`` the slots holding the states to keep.
        :param dst_slots: ``[V]`` the verifying sequences' own slots.
        """
        with self._lock:
            self._check()
            self._send_all(msg.KEEP_STATES, msg.to_portable((src_slots, dst_slots)))
            self._guard(self.driver.keep_verified_states, src_slots, dst_slots, fatal=True)

    def mirror_host_tier(self, tier: HostTier) -> None:
        """Give every worker a host tier of the same pages and repeat the driver's copies there.

        The copies go down the pipes in the order the driver makes them, between
        the step commands, so each rank moves its pages at the same point of its
        stream of steps as the driver.

        :param tier: the engine's host tier (over the driver's paged caches).
        """
        self._send_all(msg.HOST_TIER, tier.num_pages)

        def mirror(src: Sequence[int], dst: Sequence[int], to_host: bool) -> None:
            with self._lock:
                self._check()
                self._send_all(msg.HOST_COPY, (list(map(int, src)), list(map(int, dst)), to_host))

        tier.on_copy = mirror

    # -- lifetime -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Shut every worker down and end its process; idempotent.

        Workers get :data:`EXIT_TIMEOUT` seconds to exit on their own; any
        still running then is killed. After a worker failed the others are
        killed at once (they may be waiting in a collective for the dead one).
        """
        if self._closed:
            return
        self._closed = True
        self._closing = True  # workers exiting from here on are not failures
        self._stop_watch.set()
        if self._failure is not None:
            _end_processes(self._procs)
        for p in self._procs:
            if p.process.is_alive():
                try:
                    p.conn.send((msg.SHUTDOWN, None))
                except (OSError, ValueError):
                    pass
        driver = getattr(self, "driver", None)
        if driver is not None:
            driver.shutdown()
        deadline = time.monotonic() + EXIT_TIMEOUT
        for p in self._procs:
            p.process.join(max(0.0, deadline - time.monotonic()))
        _end_processes(self._procs)
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        at_exit = getattr(self, "_at_exit", None)
        if at_exit is not None:
            atexit.unregister(at_exit)
        if self._joined:
            leave_group()
            self._joined = False

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the worker processes (ranks 1..N-1)."""
        return [int(p.process.pid or 0) for p in self._procs]

    # -- faults -------------------------------------------------------------------------------

    def _send_all(self, name: str, arg: Any = None) -> None:
        for p in self._procs:
            try:
                p.conn.send((name, arg))
            except (OSError, ValueError):
                self._fail(
                    self._diagnose(wait=FAILURE_GRACE) or WorkerFailedError(p.rank, "is gone")
                )

    def _answers(self) -> list[Any]:
        """The start-up answers of every worker, in rank order."""
        out = []
        for p in self._procs:
            deadline = time.monotonic() + START_TIMEOUT
            while not p.inbox and not p.conn.poll(0.2):
                failure = self._diagnose(wait=0.0)
                if failure is not None:
                    self._fail(failure)
                if time.monotonic() > deadline:
                    self._fail(
                        WorkerFailedError(p.rank, f"did not answer in {START_TIMEOUT:.0f} s")
                    )
            kind, value = self._recv(p)
            out.append(value)
        return out

    def _recv(self, p: RankProcess) -> tuple[str, Any]:
        try:
            kind, value = p.inbox.popleft() if p.inbox else p.conn.recv()
        except (EOFError, OSError):
            self._fail(self._diagnose(wait=FAILURE_GRACE) or WorkerFailedError(p.rank, "is gone"))
        if kind == "error":
            self._fail(WorkerFailedError(p.rank, f"raised {value}"))
        return kind, value

    def _check(self) -> None:
        """Raise the failure of a worker, if one failed or reported an error since the last call."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise EngineClosedError(
                "the tensor-parallel engine was shut down (its worker processes have ended); "
                "start a new engine"
            )
        failure = self._diagnose(wait=0.0)
        if failure is not None:
            self._fail(failure)

    def _diagnose(self, wait: float) -> WorkerFailedError | None:
        """The first worker found failed (an error on its pipe, or its process gone), or ``None``.

        :param wait: seconds to keep looking (a collective that failed because a
            peer died may notice before the peer's exit is visible).
        """
        deadline = time.monotonic() + wait
        while True:
            for p in self._procs:
                try:
                    if p.conn.poll():
                        kind, value = p.conn.recv()
                        if kind == "error":
                            return WorkerFailedError(p.rank, f"raised {value}")
                        # another rank's start-up answer, come before the one awaited
                        p.inbox.append((kind, value))
                except (EOFError, OSError):
                    pass
                if not p.process.is_alive():
                    return WorkerFailedError(p.rank, f"died (exit code {p.process.exitcode})")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    # Any: forwards the driver's own arguments and result
    def _guard(self, fn: Any, *args: Any, fatal: bool = False, **kwargs: Any) -> Any:
        """Run ``fn`` on the driver; if it fails because a worker failed, raise that instead.

        :param fatal: the workers were already told to run the same call: a
            driver that fails halfway has left them in (or before) collectives
            it will never join, so the ranks are out of step and the engine ends.
        """
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            failure = self._diagnose(wait=FAILURE_GRACE if _peer_error(exc) else 0.0)
            if failure is None and fatal:
                failure = WorkerFailedError(
                    0,
                    f"(the driver) raised {type(exc).__name__}: {exc} while the other ranks ran "
                    "the same step, so the ranks are out of step",
                )
            if failure is None:
                raise
            self._fail(failure, exc)

    def _fail(self, failure: WorkerFailedError, cause: BaseException | None = None) -> None:
        """End every worker and raise ``failure``; later calls raise it again."""
        logger.error("%s", failure)
        self._failure = failure
        self.shutdown()
        raise failure from cause


def _peer_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that lost its peer (gloo / NCCL errors)."""
    return isinstance(exc, (RuntimeError, dist.DistBackendError, ConnectionError, OSError))


def _end_processes(procs: list[RankProcess]) -> None:
    """Kill every worker process still running and reap it (no orphan survives the engine)."""
    for p in procs:
        if p.process.is_alive():
            p.process.kill()
    for p in procs:
        p.process.join(EXIT_TIMEOUT)
        try:
            p.conn.close()
        except OSError:
            pass


def _shutdown_at_exit(ref: weakref.ReferenceType[MultiprocExecutor]) -> None:
    """Shut down an executor its engine never shut down, at interpreter exit.

    Waits up to :data:`EXIT_TIMEOUT` for a step another thread is running (an
    engine loop still busy) to finish; a step that does not finish (blocked on
    a lost peer) is left alone and only the worker processes are ended, since
    destroying the group under it would fail.
    """
    executor = ref()
    if executor is None or executor._closed:
        return
    if executor._lock.acquire(timeout=EXIT_TIMEOUT):
        try:
            executor.shutdown()
        finally:
            executor._lock.release()
    else:
        logger.warning("a tensor-parallel step was still running at exit; ending its workers")
        _end_processes(executor._procs)


def _watch(
    ref: weakref.ReferenceType[MultiprocExecutor], procs: list[RankProcess], stop: threading.Event
) -> None:
    """The watchdog: abort the group when a worker process dies while the engine runs.

    Waits on the workers' process sentinels (they become ready when a process
    ends, without reaping it); a death that is not part of a shutdown aborts
    the group, so a collective the driver is blocked in returns with an error
    and the step's :meth:`MultiprocExecutor._guard` names the dead rank.
    Holds the executor only weakly, so an executor dropped without shutdown
    is still collected.
    """
    # a process has a sentinel; a rank elsewhere (a Ray actor) is asked whether it lives
    sentinels = {p.process.sentinel: p for p in procs if hasattr(p.process, "sentinel")}
    while not stop.is_set():
        if sentinels:
            ready = [sentinels[s] for s in wait(list(sentinels), timeout=WATCH_INTERVAL)]
        else:
            stop.wait(WATCH_INTERVAL)
            ready = [p for p in procs if not p.process.is_alive()]
        if not ready:
            continue
        executor = ref()
        if executor is None or executor._closing or stop.is_set():
            return
        p = ready[0]
        # the sentinel can be ready a moment before the exit status is; wait for it briefly
        p.process.join(1.0)
        logger.error(
            "tensor-parallel worker rank %d died (exit code %s); aborting the group so that "
            "the driver's collectives stop waiting for it",
            p.rank,
            p.process.exitcode,
        )
        abort_group()
        return
