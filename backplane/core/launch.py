"""Launching a Triton kernel with the host cost of the driver call alone.

``kernel[grid](*args, **meta)`` re-derives on every call what rarely changes:
it binds the arguments to the signature, specialises each one (dtype, 16-byte
alignment, integers equal to one), hashes that into a cache key, reads the
runtime's settings and builds launch metadata. On the hosts of the H200
machines measured that is 13 to 22 microseconds per launch
(``benchmarks/launch_overhead.py``); an eager decode step of a 1B model makes
over a hundred launches, so it is most of the step.

A :class:`KernelLauncher` keeps, per *caller key*, the compiled kernel that
Triton chose the first time, and later calls hand the arguments straight to
its driver launcher (the call ``torch.compile``'s generated launchers make).
The caller's key is its promise: every call with an equal key compiles to
the same kernel, because the key determines the compile-time constants, the
launch options and everything Triton specialises on (dtypes, which integer
arguments are one or multiples of 16, which pointers are 16-byte aligned).
With :data:`CHECK` on (the test suites, or ``BACKPLANE_CHECK_LAUNCHES=1``),
every launch asks Triton which kernel it would have run and raises
:class:`LaunchKeyError` when the promise does not hold.

In the Triton interpreter (CPU tests) every call goes through the
interpreter, with the constants passed in the same positional order as the
fast call, so that ordering is tested on CPU too.

Inside a compile-only pass (:func:`backplane.core.compile_ahead.compile_only`,
start-up only) a launch asks Triton for the kernel it would run, which queues
its compile on the pass's thread pool, and launches nothing. Compiled kernels
that callers keep and launch directly (:meth:`KernelLauncher.lookup`) are
held for the pass's duration: their launch checks for the pass first, and
gets its direct driver call back when the last pass ends, so serving never
pays for the check.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence

# Any throughout: the Triton kernels, their compiled forms and their arguments come from a
# library core never imports, so their types cannot be named here.
from typing import Any

from backplane.core import compile_ahead

__all__ = [
    "CHECK",
    "KernelLauncher",
    "LaunchKeyError",
    "arg_key",
    "cdiv",
    "dependent_launch",
    "int_key",
    "next_pow2",
]

#: Verify every launch's caller key against Triton's own choice (slow; for tests).
#: Read when a :class:`KernelLauncher` is made.
CHECK: bool = os.environ.get("BACKPLANE_CHECK_LAUNCHES", "0") not in ("", "0")


@functools.cache
def dependent_launch(device: int) -> bool:
    """Whether kernels on CUDA device ``device`` launch as programmatic dependents.

    A kernel launched so (Triton's ``launch_pdl`` option) may start while the
    kernel before it on the stream is still running: its programs are
    scheduled as soon as every program of that kernel has started (or
    signalled with ``gdc_launch_dependents``) and wait with ``gdc_wait``
    before they read what it wrote. Work that does not depend on the previous
    kernel (a projection's first weight tiles) overlaps its tail, and the
    launch latency between the two goes, in CUDA graphs too. Needs compute
    capability 9.0 (Hopper) or newer and a Triton with the option; off in the
    interpreter and with ``BACKPLANE_PDL=0``.

    :param device: the CUDA device index.
    :return: whether kernels that support it should launch with ``launch_pdl``.
    """
    if os.environ.get("BACKPLANE_PDL", "1") in ("", "0"):
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers.

    ``triton.cdiv`` and ``triton.next_power_of_2`` also work inside kernels,
    which makes a host call cost microseconds; launch code calls these.
    """
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (and ``>= 1``), for host integers."""
    return 1 << max(int(n) - 1, 0).bit_length()


def int_key(v: int) -> int:
    """What Triton specialises on in an integer argument, as a small int.

    Bit 0: the value is 1 (compiled in as a constant); bit 1: a multiple of
    16; bit 2: outside the 32-bit range (a 64-bit argument); bit 3: 2**63 or
    more (unsigned).

    :param v: the argument.
    :return: the four bits.
    """
    return (
        (v == 1)
        | (((v & 15) == 0) << 1)
        | ((not -0x80000000 <= v <= 0x7FFFFFFF) << 2)
        | ((v >= 1 << 63) << 3)
    )


def arg_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What Triton specialises on in each of ``args``: a key for :class:`KernelLauncher`.

    Tensors give their dtype and whether they are 16-byte aligned, integers
    :func:`int_key`, anything else (floats, ``None``) its type.

    :param args: a launch's leading (non-constant) arguments.
    :return: a hashable tuple, one entry per argument.
    """
    import torch

    tensor = torch.Tensor
    return tuple(
        [
            (a.dtype, (a.data_ptr() & 15) == 0)
            if isinstance(a, tensor)
            else (int_key(a) if type(a) is int else type(a))
            for a in args
        ]
    )


class LaunchKeyError(AssertionError):
    """A caller key mapped two launches that Triton compiles differently onto one kernel.

    The caller's key misses something Triton specialises on; the fix is in
    the caller (add it to the key).
    """


@functools.cache
def _direct_launch_supported() -> bool:
    """Whether compiled kernels take every parameter, constants included, in their launch call.

    That is the calling convention of the Triton releases without
    ``AttrsDescriptor`` (3.3 on; ``torch.compile`` tells them apart the same
    way). Older releases launch through ``kernel[grid]`` every time.
    """
    import triton.backends.compiler
    import triton.compiler.compiler

    return not (
        hasattr(triton.backends.compiler, "AttrsDescriptor")
        or hasattr(triton.compiler.compiler, "AttrsDescriptor")
    )


# Every launcher, and how many compile-only passes are under way (in any thread): while
# one is, every launcher's compiled kernels launch through a check (_hold_launches).
# The lock orders a new launcher or compiled kernel against the start and end of a hold.
_LAUNCHERS: weakref.WeakSet[KernelLauncher] = weakref.WeakSet()
_HOLD_LOCK = threading.Lock()
_holding = 0


def _held(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run``, made to launch nothing inside a compile-only pass of the calling thread."""

    def held(*args: Any) -> None:
        if not compile_ahead.compiling_only():
            run(*args)

    return held


def _hold_all(on: bool) -> None:
    """Hold (or release) every compiled kernel of every launcher; call with the lock held."""
    for launcher in list(_LAUNCHERS):
        for hit in launcher._cache.values():
            hit.hold(on)


@contextlib.contextmanager
def _hold_launches() -> Iterator[None]:
    """Hold every compiled kernel's direct launch while a compile-only pass runs.

    Entered by every :func:`~backplane.core.compile_ahead.compile_only`. Other
    threads go on launching (through the check) until the last pass ends.
    """
    global _holding
    with _HOLD_LOCK:
        _holding += 1
        if _holding == 1:
            _hold_all(True)
    try:
        yield
    finally:
        with _HOLD_LOCK:
            _holding -= 1
            if _holding == 0:
                _hold_all(False)


compile_ahead.hold_while_compiling_only(_hold_launches)


class _Compiled:
    """What the fast path needs of one compiled kernel (see :meth:`KernelLauncher.lookup`)."""

    __slots__ = (
        "compiled",
        "direct",
        "enter",
        "exit",
        "function",
        "metadata",
        "options",
        "run",
        "stream",
        "tail",
    )

    def __init__(self, compiled: Any, tail: tuple[Any, ...], options: dict[str, Any]) -> None:
        import triton

        compiled._init_handles()
        self.compiled = compiled
        self.tail = tail
        self.options = options
        fast = _direct_launch_supported() and all(
            hasattr(compiled, a) for a in ("run", "function", "packed_metadata")
        )
        # the driver call; ``run`` is it, or while a compile-only pass runs, it held
        self.direct = compiled.run if fast else None
        self.run = self.direct
        self.function = compiled.function if fast else None
        self.metadata = compiled.packed_metadata if fast else None
        # Read once, as torch.compile's launchers do: a profiler hook installed
        # later is seen by new keys only. (Releases before ``triton.knobs`` kept
        # the hooks on the compiled kernel's class.)
        knobs = getattr(triton, "knobs", None)
        hooks = knobs.runtime if knobs is not None else type(compiled)
        self.enter = getattr(hooks, "launch_enter_hook", None)
        self.exit = getattr(hooks, "launch_exit_hook", None)
        if fast:
            import torch

            self.stream = torch._C._cuda_getCurrentRawStream

    def hold(self, on: bool) -> None:
        """Make :meth:`launch` check for a compile-only pass first (``on``), or not.

        :param on: whether a compile-only pass is under way somewhere.
        """
        if self.direct is not None:
            self.run = _held(self.direct) if on else self.direct

    def launch(self, grid0: int, grid1: int, grid2: int, device: int, *args: Any) -> None:
        """Launch on the current stream of ``device`` with the kernel's leading ``args``.

        The constants are the ones the kernel was compiled with; only a
        launcher with a direct launch (``run`` set) has this path.
        """
        self.run(
            grid0,
            grid1,
            grid2,
            self.stream(device),
            self.function,
            self.metadata,
            None,
            self.enter,
            self.exit,
            *args,
            *self.tail,
        )


def _parameter_defaults(kernel: Any) -> dict[str, Any]:
    """The default values of a kernel's parameters, by name.

    A ``triton.jit`` function lists its parameters in ``params``; the
    interpreter's stand-in (``TRITON_INTERPRET=1``) has none, so the Python
    function it wraps is read instead.
    """
    params = getattr(kernel, "params", None)
    if params:
        return {p.name: p.default for p in params if p.has_default}
    signature = inspect.signature(getattr(kernel, "fn", kernel))
    return {
        name: p.default
        for name, p in signature.parameters.items()
        if p.default is not inspect.Parameter.empty
    }


class KernelLauncher:
    """Launches one ``@triton.jit`` kernel, cached per caller key.

    :param kernel: the ``triton.jit`` function (or the interpreter's stand-in).
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        # The interpreter reads the variable when triton is imported, as here.
        self._interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        self._names: tuple[str, ...] = tuple(kernel.arg_names)
        self._defaults: dict[str, Any] = _parameter_defaults(kernel)
        self._cache: dict[Hashable, _Compiled] = {}
        # Every launch goes through Triton in the interpreter and while checking.
        self._always_slow = CHECK or self._interpret
        with _HOLD_LOCK:
            _LAUNCHERS.add(self)

    def __call__(
        self,
        key: Hashable,
        grid: Sequence[int],
        args: tuple[Any, ...],
        device: int,
        **meta: Any,
    ) -> None:
        """Launch ``kernel[grid](*args, **meta)`` on the current stream of ``device``.

        :param key: hashable; equal keys must mean the same compile-time
            constants in ``meta``, the same launch options and the same
            specialisation of ``args`` (see the module docstring).
        :param grid: one to three program counts.
        :param args: the kernel's leading parameters, in order (tensors,
            integers, floats).
        :param device: the CUDA device index the tensors are on.
        :param meta: every remaining parameter (the ``tl.constexpr`` ones) by
            name, plus compile and launch options (``num_warps``, ``num_stages``,
            ``enable_fp_fusion``).
        """
        # A compiled kernel's function handle belongs to one device's context.
        key = (device, key)
        hit = self._cache.get(key)
        if hit is None or self._always_slow:
            hit = self._slow(key, grid, args, meta)
            if hit is None:
                return
        if hit.run is None:
            if not compile_ahead.compiling_only():
                self.kernel[tuple(grid)](*args, *hit.tail, **hit.options)
            return
        g = len(grid)
        hit.launch(grid[0], grid[1] if g > 1 else 1, grid[2] if g > 2 else 1, device, *args)

    def lookup(self, key: Hashable, device: int) -> _Compiled | None:
        """The kernel compiled for ``key`` on ``device``, for a launch without ``meta``.

        The caller launches with ``hit.launch(grid0, grid1, grid2, device,
        *args)``: the path for call sites that keep their key and would
        otherwise rebuild the constants on every call.

        :param key: the caller key, as for :meth:`__call__`.
        :param device: the CUDA device index.
        :return: the cached kernel, or ``None`` where the launch must go through
            :meth:`__call__`: the key's first launch, every launch while
            :data:`CHECK` is on or in the interpreter, and Triton releases
            without direct launches.
        """
        if self._always_slow:
            return None
        hit = self._cache.get((device, key))
        return hit if hit is not None and hit.run is not None else None

    def launch(self, grid: Sequence[int], args: tuple[Any, ...], device: int, **meta: Any) -> None:
        """Launch with a key derived from the arguments (:func:`arg_key`) and ``meta``.

        For callers without a cheaper key of their own; ``meta``'s values must
        be hashable. Arguments as for :meth:`__call__`.
        """
        self((arg_key(args), tuple(meta.items())), grid, args, device, **meta)

    def _tail(self, nargs: int, meta: dict[str, Any]) -> tuple[Any, ...]:
        """The values of the parameters after the leading ``nargs``, in signature order."""
        names = self._names[nargs:]
        missing = [n for n in names if n not in meta and n not in self._defaults]
        if missing:
            raise TypeError(f"{self.kernel.__name__}: parameters {missing} not given")
        return tuple(meta[n] if n in meta else self._defaults[n] for n in names)

    def _slow(
        self, key: Hashable, grid: Sequence[int], args: tuple[Any, ...], meta: dict[str, Any]
    ) -> _Compiled | None:
        """Compile (or look up) through Triton; check the key; ``None`` when already launched
        (or, in a compile-only pass, when nothing is to be launched)."""
        tail = self._tail(len(args), meta)
        # Keywords that are not parameters are compile or launch options (num_warps, ...).
        options = {k: v for k, v in meta.items() if k not in self._names}
        if compile_ahead.compiling_only() and not self._interpret:
            # Triton's async mode queues the compile this launch would wait for, under
            # the key the real launch looks up; the kernel is not loaded or launched
            self.kernel.warmup(*args, *tail, grid=tuple(grid), **options)
            return None
        if self._interpret:
            # The interpreter runs the kernel; the constants go in the fast call's order.
            self.kernel[tuple(grid)](*args, *tail, **options)
            return None
        compiled = self.kernel.warmup(*args, *tail, grid=tuple(grid), **options)
        hit = self._cache.get(key)
        if hit is not None:
            if hit.compiled is not compiled:
                raise LaunchKeyError(
                    f"{self.kernel.__name__}: key {key!r} was compiled as another kernel "
                    "before; the key misses something Triton specialises on"
                )
            return hit
        hit = _Compiled(compiled, tail, options)
        with _HOLD_LOCK:
            self._cache[key] = hit
            if _holding:
                # made by another thread while a compile-only pass runs
                hit.hold(True)
        return hit
