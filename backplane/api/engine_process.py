"""A data-parallel replica in an engine process of its own, driven over a pipe.

A process holds one ``torch.distributed`` default group, so two replicas that
each split their model over tensor-parallel ranks cannot share one. With
``data_parallel_size > 1`` and ``tensor_parallel_size > 1`` replica 0 runs in
the :class:`~backplane.api.async_llm.AsyncLLM`'s process and every other
replica in an *engine process* of its own (:func:`engine_process_main`),
which builds a whole :class:`~backplane.api.llm.LLM` there (its scheduler,
KV cache, output processing and its own tensor-parallel worker processes).

:class:`ProcessLLM` is that replica as the ``AsyncLLM``'s engine loop sees
it: the same calls as an :class:`LLM` (``_add_tokens``, ``abort``, ``step``,
``shutdown``, the requests it tracks and the load its snapshot reads), each
one message and its answer on the pipe. A step's outputs come back already
detokenised, so the pipe carries token ids in and
:class:`~backplane.api.outputs.RequestOutput` objects out.

Faults: an engine process that dies ends its replica with an
:class:`~backplane.core.errors.EngineFailedError` naming the replica; an
engine process whose front is gone (its pipe closed) shuts its engine down
and exits; a front never shut down ends its engine processes at exit.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import pickle
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch.multiprocessing as mp

from backplane.core.errors import EngineFailedError

if TYPE_CHECKING:
    from backplane.api.outputs import RequestOutput
    from backplane.engine.config import EngineConfig
    from backplane.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["EngineLoad", "ProcessLLM", "engine_process_main"]

#: Seconds an engine process may take to start (model loading, graph capture, warm-up).
START_TIMEOUT = 1800.0
#: Seconds an engine process gets to shut down before it is killed.
EXIT_TIMEOUT = 20.0

ADD = "add"
ABORT = "abort"
STEP = "step"
SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class EngineLoad:
    """The load of a replica's engine as it was after the last call into it.

    :param unfinished: whether the engine has requests queued or running.
    :param running: running requests.
    :param waiting: requests waiting for admission.
    :param steps: steps run so far.
    :param kv_pages_used: KV pages in use.
    :param kv_pages_total: KV pages the engine has.
    :param lookup_pages: prefix-cache pages looked up.
    :param device_hit_pages: of them, found on the device.
    :param host_hit_pages: of them, found in the host tier.
    :param max_model_len: the engine's longest sequence.
    """

    unfinished: bool = False
    running: int = 0
    waiting: int = 0
    steps: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    lookup_pages: int = 0
    device_hit_pages: int = 0
    host_hit_pages: int = 0
    max_model_len: int = 0


def _load_of(llm: Any) -> EngineLoad:
    """The load of a local :class:`LLM`'s engine."""
    engine = llm.engine
    kv = engine.kv_manager
    return EngineLoad(
        unfinished=bool(engine.has_unfinished_requests()),
        running=int(engine.scheduler.num_running),
        waiting=int(engine.scheduler.num_waiting),
        steps=int(engine.scheduler.stats.steps),
        kv_pages_used=int(kv.num_used_pages),
        kv_pages_total=int(kv.pool.num_usable),
        lookup_pages=int(kv.stats.lookup_pages),
        device_hit_pages=int(kv.stats.device_hit_pages),
        host_hit_pages=int(kv.stats.host_hit_pages),
        max_model_len=int(engine.max_model_len),
    )


def _portable_error(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pipe, else one that does with the same message and kind."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # an exception whose constructor takes other arguments than its message
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, EngineFailedError):
            return EngineFailedError(text)
        return RuntimeError(text)


def engine_process_main(config: EngineConfig, conn: Connection) -> None:
    """Entry point of a replica's engine process: build the engine, then serve the front's calls.

    Answers ``("ready", EngineLoad)`` once the engine is built, then each call
    with ``("ok", value)`` or ``("error", exception)``. A start-up failure is
    answered ``("error", exception)`` and ends the process with exit code 1.

    :param config: the replica's configuration.
    :param conn: this process's end of the front's pipe.
    """
    logging.basicConfig(
        level=os.environ.get("BACKPLANE_WORKER_LOG_LEVEL", "WARNING"),
        format="%(asctime)s engine process %(levelname)s %(name)s: %(message)s",
    )
    from backplane.api.llm import LLM
    from backplane.core.gc_heap import freeze_startup_heap, released_startup_heap

    llm = None
    code = 0
    try:
        llm = LLM(config=config)
        freeze_startup_heap()  # see backplane.core.gc_heap: this process serves from now on
        conn.send(("ready", _load_of(llm)))
        while True:
            try:
                name, arg = conn.recv()
            except EOFError:  # the front is gone: nothing more will come
                logger.warning("the front closed its pipe; shutting the engine down")
                break
            if name == SHUTDOWN:
                break
            try:
                if name == ADD:
                    ids, params, rid, text = arg
                    value: Any = (llm._add_tokens(ids, params, rid, text), _load_of(llm))
                elif name == ABORT:
                    value = llm.abort(arg)
                elif name == STEP:
                    value = (llm.step(), _load_of(llm))
                else:
                    raise ValueError(f"unknown engine process call {name!r}")
            except Exception as exc:
                conn.send(("error", _portable_error(exc)))
                continue
            conn.send(("ok", value))
    except BaseException as exc:
        code = 1
        logger.error(
            "the engine process failed:\n%s",
            "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )
        try:
            conn.send(("error", _portable_error(exc)))
        except (OSError, ValueError):  # the front is gone already
            pass
    finally:
        if llm is not None:
            with released_startup_heap():
                llm.shutdown()
        try:
            conn.send(("ok", None))  # the shutdown's answer (ignored when nobody listens)
        except (OSError, ValueError):
            pass
        conn.close()
    # Leave without the interpreter's teardown whatever the outcome: after a clean
    # shutdown torch's communicator threads can still abort the process while static
    # objects are destroyed, which would read as a crashed replica.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _SchedulerLoad:
    """The scheduler's counts an engine loop and its snapshot read, from an :class:`EngineLoad`."""

    def __init__(self, load: EngineLoad) -> None:
        self.num_running = load.running
        self.num_waiting = load.waiting
        self.stats = _Counts(steps=load.steps)


class _KVLoad:
    """The KV-cache counts a snapshot reads, from an :class:`EngineLoad`."""

    def __init__(self, load: EngineLoad) -> None:
        self.num_used_pages = load.kv_pages_used
        self.pool = _Counts(num_usable=load.kv_pages_total)
        self.stats = _Counts(
            lookup_pages=load.lookup_pages,
            device_hit_pages=load.device_hit_pages,
            host_hit_pages=load.host_hit_pages,
        )


class _Counts:
    """Named counts (attribute access, as the local objects they stand for)."""

    def __init__(self, **counts: int) -> None:
        self.__dict__.update(counts)


class _GrammarsElsewhere:
    """The structured-output cache of an engine in another process: grammars compile there."""

    def compile(self, params: Any) -> None:
        """Nothing to do here: the engine process compiles the grammar when the request is added.

        :param params: the request's structured-output parameters.
        """


class _EngineView:
    """What the engine loop reads of a replica's engine: its load after the last call."""

    def __init__(self, load: EngineLoad) -> None:
        self.structured_output = _GrammarsElsewhere()
        self.update(load)

    def update(self, load: EngineLoad) -> None:
        """Take the load the engine process reported.

        :param load: the engine's load after its last call.
        """
        self.load = load
        self.max_model_len = load.max_model_len
        self.scheduler = _SchedulerLoad(load)
        self.kv_manager = _KVLoad(load)

    def has_unfinished_requests(self) -> bool:
        """Whether the engine had requests queued or running after the last call."""
        return self.load.unfinished


class ProcessLLM:
    """A replica whose :class:`LLM` runs in an engine process of its own.

    Starts the process at once; :meth:`wait_ready` waits for its engine. One
    caller at a time (the replica's engine loop), as an :class:`LLM`.

    :param config: the replica's configuration.
    :param index: the replica's number (in errors and the process name).
    """

    def __init__(self, config: EngineConfig, index: int) -> None:
        self.index = index
        self._tracked: set[str] = set()
        self._closed = False
        self._lock = threading.Lock()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        # not daemonic: the engine process starts tensor-parallel worker processes of its own
        self._process = ctx.Process(
            target=engine_process_main,
            args=(config, child),
            name=f"backplane-dp-replica{index}",
            daemon=False,
        )
        self._process.start()
        child.close()
        self.engine = _EngineView(EngineLoad())
        # registered after multiprocessing's own exit hook (which joins non-daemonic
        # children), so it runs first and the join does not wait forever
        self._at_exit = functools.partial(_end_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return int(self._process.pid or 0)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Wait for the engine process to build its engine.

        :param timeout: seconds.
        :raises EngineFailedError: the process died or did not start in time.
        :raises BackplaneError: the engine refused its configuration (as :class:`LLM` would).
        """
        kind, value = self._receive(timeout, "while starting")
        if kind == "error":
            self.shutdown()
            raise value
        self.engine.update(value)

    # -- the calls of the engine loop ---------------------------------------------------------

    def _add_tokens(
        self,
        ids: Any,
        sampling_params: SamplingParams | None,
        request_id: str | None,
        prompt_text: str | None,
        *,
        stop_automaton: Any = None,
    ) -> str:
        """Queue a tokenized prompt in the replica (as :meth:`LLM._add_tokens`).

        :param ids: the prompt's token ids.
        :param sampling_params: its parameters.
        :param request_id: its id.
        :param prompt_text: its text, for the outputs.
        :param stop_automaton: ignored: the engine process builds the stop
            strings' automaton itself (it does not cross a pipe cheaply).
        :return: the request id.
        """
        rid, load = self._call(ADD, (ids, sampling_params, request_id, prompt_text))
        self._tracked.add(rid)
        self.engine.update(load)
        return str(rid)

    def abort(self, request_id: str) -> bool:
        """Abort a request in the replica (as :meth:`LLM.abort`).

        :param request_id: the request.
        :return: whether it was still running.
        """
        return bool(self._call(ABORT, request_id))

    def step(self) -> list[RequestOutput]:
        """Run one step of the replica's engine (as :meth:`LLM.step`).

        :return: the step's outputs.
        """
        outs, load = self._call(STEP)
        self.engine.update(load)
        for out in outs:
            if out.finished:
                self._tracked.discard(out.request_id)
        return list(outs)

    def shutdown(self) -> None:
        """Shut the engine process down (its engine and worker processes with it); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._tracked.clear()
        atexit.unregister(self._at_exit)
        _end_process(self._process, self._conn)

    # -- the pipe -----------------------------------------------------------------------------

    # Any: each call has its own argument and answer
    def _call(self, name: str, arg: Any = None) -> Any:
        if self._closed:
            from backplane.core.errors import EngineClosedError

            raise EngineClosedError(f"data-parallel replica {self.index} was shut down")
        with self._lock:
            try:
                self._conn.send((name, arg))
            except (OSError, ValueError):
                raise self._died("while taking a call") from None
            kind, value = self._receive(None, f"during {name}")
        if kind == "error":
            raise value
        return value

    def _receive(self, timeout: float | None, when: str) -> tuple[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(0.1):
            if not self._process.is_alive():
                raise self._died(when)
            if deadline is not None and time.monotonic() > deadline:
                _end_process(self._process, self._conn, graceful=False)
                raise EngineFailedError(
                    f"data-parallel replica {self.index}'s engine process did not answer in "
                    f"{timeout:.0f} s {when}; it was ended"
                )
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise self._died(when) from None

    def _died(self, when: str) -> EngineFailedError:
        self._process.join(1.0)
        self._closed = True
        return EngineFailedError(
            f"data-parallel replica {self.index}'s engine process died {when} (exit code "
            f"{self._process.exitcode}); its requests are lost. Check the log above for its "
            "error and start a new engine"
        )


def _end_process(process: Any, conn: Connection, *, graceful: bool = True) -> None:
    """Ask an engine process to shut down, wait for it, kill it if it does not exit."""
    if graceful and process.is_alive():
        try:
            conn.send((SHUTDOWN, None))
        except (OSError, ValueError):
            pass
        process.join(EXIT_TIMEOUT)
    if process.is_alive():
        logger.warning("engine process %s did not exit; killing it", process.pid)
        process.kill()
        process.join(EXIT_TIMEOUT)
    try:
        conn.close()
    except OSError:
        pass


def _end_at_exit(ref: weakref.ReferenceType[ProcessLLM]) -> None:
    """Shut down an engine process its front never shut down, at interpreter exit."""
    replica = ref()
    if replica is not None:
        replica.shutdown()
