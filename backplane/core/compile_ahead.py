"""Compiling a call's Triton kernels side by side, before its launches need them (start-up only).

Triton compiles a kernel variant when it is first launched, and the launch
waits for it; an autotuned kernel that meets a new tuning key compiles every
configuration, one after the other, before timing them. mamba-ssm's chunked
scan is six autotuned kernels with 51 configurations between them, so the
first prefill of a cold Nemotron-H start-up compiled 51 kernels in a row.
Most of a compile runs without the GIL (the MLIR and LLVM passes, and
``ptxas`` in a subprocess), so threads compile side by side, and Triton's
``AsyncCompileMode`` hands every compile a launch asks for to an executor and
returns at once.

* :func:`startup_window` marks the start-up steps (the worker's model load,
  memory profiling, graph capture and warm-up): compiling ahead happens only
  inside one, so a serving step never pays for it (other start-up work that
  should not run later, such as FlashInfer's background builds, asks
  :func:`in_startup_window` too).
* :func:`can_compile_ahead` says whether compiling ahead is possible now:
  inside the window, on CUDA, not while a CUDA graph is being captured, with a
  Triton that has ``AsyncCompileMode``, not already inside a compile-only pass.
  A start-up step that runs many forwards (the graph captures, the warm-up
  steps, the memory profiling) asks it before one pass over all of them.
* :func:`ahead_of` asks the same for one call site, the first time for the
  caller's key (what its launches specialise on).
* :func:`run_ahead` then runs the call site's code once under
  :func:`compile_only`: every launch made through :func:`launch`, through a
  :class:`~backplane.core.launch.KernelLauncher` or through an autotuner of
  :mod:`backplane.backends.triton._autotune` compiles on a thread pool and
  launches nothing; leaving waits for the compiles. The call site then runs
  for real and finds every variant compiled, because the compile-only pass
  launched with the same arguments. (Launches made directly, ``kernel[grid]``,
  by libraries compile in the pool too, but wait for their compile and run.)

A start-up that has run before with the same shapes finds every kernel in
Triton's disk cache: its launches load them in milliseconds, and a pass would
only cost a forward each. :func:`disk_cache_warm` tells, from the passes run
so far in the process (the first is the memory-profiling step's), whether
every compile they asked for was such a load, so that later steps can skip
theirs.

Under the Triton interpreter, on the CPU, with a Triton without
``AsyncCompileMode`` or with ``BACKPLANE_COMPILE_AHEAD=0``,
:func:`can_compile_ahead` and :func:`ahead_of` are false and nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "AHEAD_DETAIL",
    "ENV",
    "ahead_of",
    "attempt",
    "can_compile_ahead",
    "compile_only",
    "compiles",
    "compiling_only",
    "disk_cache_warm",
    "hold_while_compiling_only",
    "in_startup_window",
    "launch",
    "record",
    "run_ahead",
    "signature",
    "startup_window",
]

#: the start-up detail that :func:`run_ahead` adds its wall seconds to by default
AHEAD_DETAIL = "compile ahead"
#: set to 0 to compile every kernel when it is first launched (read once per process)
ENV = "BACKPLANE_COMPILE_AHEAD"

# seconds per detail of the open start-up window (None: no window)
_WINDOW: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "backplane_compile_ahead_window", default=None
)
_COMPILE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "backplane_compile_only", default=False
)
# the keys compiled ahead in this process (the compiled kernels stay in Triton's
# in-memory caches, so a key is never worth a second pass)
_DONE: set[Hashable] = set()
# context managers entered around every compile-only pass (hold_while_compiling_only)
_HOLDS: list[Callable[[], contextlib.AbstractContextManager[Any]]] = []
#: a compile job that spent less CPU than this (seconds, in its own thread) loaded its
#: kernel from Triton's disk cache (milliseconds); compiling one takes tens to hundreds
#: (the MLIR and LLVM passes; ptxas runs in a subprocess and is not counted)
LOADED_CPU_S = 0.03


class _Tally:
    """The compile jobs of this process's compile-only passes: asked for, and compiled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.asked = 0
        self.compiled = 0

    def add(self, compiled: bool) -> None:
        """Count one job, finished (``compiled``: not a load from the disk cache)."""
        with self.lock:
            self.asked += 1
            self.compiled += compiled


_TALLY = _Tally()


class _CompilePool(ThreadPoolExecutor):
    """The thread pool of a compile-only pass; it tallies whether each job compiled."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the pool, timing its thread's CPU.

        :return: the job's future.
        """

        def job() -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                _TALLY.add(time.thread_time() - start >= LOADED_CPU_S)

        return super().submit(job)


def compiles() -> tuple[int, int]:
    """The compile jobs of this process's compile-only passes so far.

    :return: ``(asked for, compiled)``; the others loaded their kernel from
        Triton's disk cache.
    """
    with _TALLY.lock:
        return _TALLY.asked, _TALLY.compiled


def disk_cache_warm() -> bool:
    """Whether this process's compile-only passes asked for compiles and all were loads.

    :return: ``True`` once some pass has asked for a compile and none so far has
        compiled (each loaded its kernel from Triton's disk cache).
    """
    with _TALLY.lock:
        return _TALLY.asked > 0 and _TALLY.compiled == 0


@contextlib.contextmanager
def startup_window() -> Iterator[dict[str, float]]:
    """Allow compiling ahead while the wrapped start-up step runs.

    :return: a context manager yielding ``{detail: seconds}``, filled by
        :func:`record` (and :func:`run_ahead`) while it is open, for the
        start-up timings.
    """
    details: dict[str, float] = {}
    token = _WINDOW.set(details)
    try:
        yield details
    finally:
        _WINDOW.reset(token)


def in_startup_window() -> bool:
    """Whether a start-up step is running (inside :func:`startup_window`)."""
    return _WINDOW.get() is not None


def record(detail: str, seconds: float) -> None:
    """Add ``seconds`` to ``detail`` of the open start-up window (nothing without one).

    :param detail: e.g. ``"autotune timing"``.
    :param seconds: wall seconds.
    """
    details = _WINDOW.get()
    if details is not None:
        details[detail] = details.get(detail, 0.0) + seconds


@functools.cache
def _async_compile_mode() -> type | None:
    """Triton's ``AsyncCompileMode``, or ``None`` (interpreter, no triton, an older release,
    compiling ahead turned off with :data:`ENV`)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    if os.environ.get(ENV, "1") in ("", "0"):
        return None
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "AsyncCompileMode", None)


def _cuda_ready() -> bool:
    """Whether Triton compiles for a CUDA device here, and no CUDA graph is being captured."""
    import torch

    return torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing()


def signature(*values: Any) -> tuple[Any, ...]:
    """A key of :func:`ahead_of` from a call's arguments.

    Tensors give their dtype, shape, strides and 16-byte alignment (what a
    launch from them can specialise on); anything else stands for itself.

    :param values: the call's arguments.
    :return: a hashable tuple.
    """
    import torch

    return tuple(
        (v.dtype, tuple(v.shape), v.stride(), v.data_ptr() % 16 == 0)
        if isinstance(v, torch.Tensor)
        else v
        for v in values
    )


def can_compile_ahead() -> bool:
    """Whether a compile-only pass (:func:`run_ahead`) can run now (see the module docstring).

    :return: ``True`` inside a start-up window and outside a compile-only pass,
        on CUDA outside a graph capture, with a Triton that compiles asynchronously.
    """
    if _WINDOW.get() is None or _COMPILE_ONLY.get():
        return False
    return _async_compile_mode() is not None and _cuda_ready()


def ahead_of(key: Callable[[], Hashable]) -> bool:
    """Whether the caller should compile its launches ahead now (see the module docstring).

    A true answer counts: the same key is never answered true again in this process.

    :param key: makes what the caller's launches specialise on (see
        :func:`signature`); called only inside a start-up window, so a serving
        step pays one context-variable read.
    :return: :func:`can_compile_ahead`, the first time for the key.
    """
    if not can_compile_ahead():
        return False
    made = key()
    if made in _DONE:
        return False
    _DONE.add(made)
    return True


def compiling_only() -> bool:
    """Whether launches compile without running (inside :func:`compile_only`)."""
    return _COMPILE_ONLY.get()


def _workers() -> int:
    """Compile threads: one per CPU this process may use (each runs one ``ptxas`` at a time)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 32))


def hold_while_compiling_only(hold: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
    """Enter ``hold()`` around every :func:`compile_only` pass from now on.

    For launch paths that keep compiled kernels of their own and would launch
    them without asking :func:`compiling_only` (the fast path of
    :class:`~backplane.core.launch.KernelLauncher`): the hold makes them ask
    for the pass's duration only, so serving pays nothing.

    :param hold: makes the context manager; entered after the pass has begun
        (:func:`compiling_only` is true inside) and left before it waits for
        the compiles.
    """
    _HOLDS.append(hold)


@contextlib.contextmanager
def compile_only(workers: int | None = None) -> Iterator[None]:
    """Within: launches through :func:`launch`, the kernel launchers and the adapted
    autotuners compile, concurrently, and launch nothing; leaving waits for every compile.

    A compile that fails is dropped (Triton's ``ignore_errors``): the real
    launch compiles it again and raises its error there.

    :param workers: compile threads (default: one per usable CPU, at most 32).
    :return: a context manager.
    :raises RuntimeError: Triton has no ``AsyncCompileMode`` here (check :func:`ahead_of`).
    """
    mode_class = _async_compile_mode()
    if mode_class is None:
        raise RuntimeError("this Triton cannot compile asynchronously (no AsyncCompileMode)")
    with _CompilePool(workers or _workers(), thread_name_prefix="triton-compile") as pool:
        token = _COMPILE_ONLY.set(True)
        try:
            with mode_class(pool, ignore_errors=True), contextlib.ExitStack() as holds:
                for hold in _HOLDS:
                    holds.enter_context(hold())
                yield
        finally:
            _COMPILE_ONLY.reset(token)


def run_ahead(what: str, fn: Callable[..., Any], *args: Any, detail: str = AHEAD_DETAIL) -> None:
    """Run ``fn(*args)`` once under :func:`compile_only`, to compile what its launches need.

    Whatever ``fn`` returns is dropped: its launches did not run. A failure is
    logged and swallowed; the real call compiles what is left when it launches.

    :param what: the call, for the log (e.g. ``"the Triton SSM prefill"``).
    :param fn: the call site's code.
    :param args: its arguments, those of the real call that follows.
    :param detail: the start-up detail its wall seconds are added to.
    """
    start = time.perf_counter()
    asked, compiled = _TALLY.asked, _TALLY.compiled
    try:
        with compile_only():
            fn(*args)
    except Exception as exc:  # noqa: BLE001 - the real call compiles on launch instead
        logger.warning(
            "compiling %s ahead failed (%s: %s); its kernels compile when launched",
            what,
            type(exc).__name__,
            exc,
        )
    elapsed = time.perf_counter() - start
    record(detail, elapsed)
    logger.debug(
        "compiled %s ahead in %.2f s (%d compiles asked for, %d not in the disk cache)",
        what,
        elapsed,
        _TALLY.asked - asked,
        _TALLY.compiled - compiled,
    )


def attempt(what: str, fn: Callable[..., Any], *args: Any) -> bool:
    """Run ``fn(*args)``, one part of a compile-only pass, logging and swallowing its failure.

    So that one part that fails (a batch some backend refuses, say) leaves the
    other parts of the pass compiling; the failed part's kernels compile when
    its real run launches them.

    :param what: the part, for the log (e.g. ``"decode batch 8"``).
    :param fn: the part's code.
    :param args: its arguments.
    :return: whether it ran without an exception.
    """
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the real run compiles on launch instead
        logger.warning(
            "compiling ahead: %s failed (%s: %s); its kernels compile when launched",
            what,
            type(exc).__name__,
            exc,
        )
        return False
    return True


def launch(kernel: Any, grid: Sequence[int], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)``, or, inside :func:`compile_only`, its compile alone.

    :param kernel: a ``triton.jit`` function.
    :param grid: the program counts.
    :param args: the kernel's arguments, in order.
    :param meta: its constants and launch options.
    """
    if _COMPILE_ONLY.get():
        kernel.warmup(*args, grid=tuple(grid), **meta)
    else:
        kernel[tuple(grid)](*args, **meta)
