"""The out-buffer contract, implemented once for every cached op.

Every cached op of every family ends its signature with ``out=None``:

1. Without ``out`` it returns a new tensor of the full padded token count.
2. With ``out`` (exactly that shape, dtype and device) it writes rows
   ``[0, num_tokens)`` straight into ``out`` (no full-size temporary),
   zero-fills rows ``[num_tokens, padded)`` so stale rows of a reused buffer
   never leak, and returns an empty tensor (``numel() == 0``) as the sentinel:
   a custom op may not return an alias of an input.
3. It is a ``torch.library.custom_op`` whose ``mutates_args`` names ``out``
   and every cache it writes, with a fake implementation that agrees with the
   real one in both cases, so that ``torch.library.opcheck`` passes.
4. It never synchronises with the device; host values come from
   ``batch.host``.

:func:`cached_op` registers such an op and its fake; :func:`output_buffer` and
:func:`finish_output` are the two calls an implementation makes.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._library.custom_ops import CustomOpDef
from torch.fx import _symbolic_trace
from torch.utils._python_dispatch import _get_current_dispatch_mode

#: Whether ``torch.fx.symbolic_trace`` is running. Newer torch deprecates
#: ``is_fx_tracing`` (true under ``torch.export`` too) with a logged warning on its
#: first call and offers ``is_fx_symbolic_tracing`` (the warning's text calls it
#: ``is_fx_tracing_symbolic_tracing``, looked up too); older torch has only
#: ``is_fx_tracing``, which means symbolic tracing there and does not warn. Export
#: and compile are caught by ``torch.compiler.is_compiling()`` where this is used.
_is_fx_symbolic_tracing: Callable[[], bool] = getattr(
    _symbolic_trace,
    "is_fx_symbolic_tracing",
    getattr(_symbolic_trace, "is_fx_tracing_symbolic_tracing", _symbolic_trace.is_fx_tracing),
)


def output_buffer(
    out: torch.Tensor | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Return the tensor an op writes its result rows into.

    :param out: the caller's buffer or ``None``.
    :param shape: the full (padded) result shape.
    :param dtype: the result dtype.
    :param device: the result device.
    :return: ``out`` itself after checking it, or a new uninitialised tensor.
    :raises ValueError: ``out`` differs in shape, dtype or device.
    """
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    shape = tuple(int(s) for s in shape)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != torch.device(device):
        raise ValueError(
            f"out buffer has shape {tuple(out.shape)}, {out.dtype} on {out.device}; "
            f"expected {shape}, {dtype} on {device}"
        )
    return out


def finish_output(out: torch.Tensor | None, buf: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Zero the padding rows and return what the op must return.

    :param out: the caller's buffer or ``None``.
    :param buf: the buffer the op wrote rows ``[0, num_tokens)`` of.
    :param num_tokens: the number of real rows.
    :return: the empty sentinel when ``out`` was given, else ``buf``.
    """
    if num_tokens < buf.shape[0]:
        buf[num_tokens:].zero_()
    if out is not None:
        return buf.new_empty(0)
    return buf


#: Takes over every eager call of a cached op while set (:func:`intercept_cached_ops`).
OpInterceptor = Callable[["CachedOpDef", tuple[Any, ...], dict[str, Any]], Any]


class _Interception(threading.local):
    """The interceptor of this thread (engines in other threads capture on their own)."""

    interceptor: OpInterceptor | None = None


_local = _Interception()


@contextlib.contextmanager
def intercept_cached_ops(interceptor: OpInterceptor) -> Iterator[None]:
    """Route every eager call of a cached op through ``interceptor`` while the block runs.

    A graph runner records a forward as CUDA graphs cut at its dynamic ops this
    way: at each such call it ends the graph being recorded, runs the op
    eagerly and starts the next graph. It holds for the calling thread only.
    Calls made under autograd, tracing or
    ``torch.compile`` are not intercepted; calls through the dispatcher
    (``torch.ops.ns.name(...)``) never reach it.

    :param interceptor: called as ``interceptor(op, args, kwargs)`` with the
        :class:`CachedOpDef` called (its Python function is ``op._init_fn``,
        its overload ``op._opoverload``) and the call's arguments, ``out``
        always among ``kwargs`` unless passed positionally; what it returns is
        the call's result.
    """
    previous, _local.interceptor = _local.interceptor, interceptor
    try:
        yield
    finally:
        _local.interceptor = previous


class CachedOpDef(CustomOpDef):
    """A custom op whose trailing ``out`` may be omitted by Python callers."""

    #: number of schema arguments, set at registration (a plain int keeps the
    #: check traceable by torch.compile)
    num_args: int = 0

    def output_shape(self, *args: Any, **kwargs: Any) -> tuple[Sequence[int], torch.dtype]:
        """The full result ``(shape, dtype)`` of a call with these arguments (set at registration)."""
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if "out" not in kwargs and len(args) < self.num_args:
            kwargs["out"] = None
        if (
            not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and not _is_fx_symbolic_tracing()
        ):
            interceptor = _local.interceptor
            if interceptor is not None:
                return interceptor(self, args, kwargs)
            if _get_current_dispatch_mode() is not None:
                return super().__call__(*args, **kwargs)
            # Eager call on real tensors without autograd (the engine runs under
            # inference mode): the dispatcher would only add its Python
            # overhead (tens of microseconds per layer and step) to the same function.
            # Traced, compiled and fake-tensor runs go through the registered op.
            return self._init_fn(*args, **kwargs)
        return super().__call__(*args, **kwargs)


def cached_op(
    qualname: str,
    mutates_args: Sequence[str],
    output_shape: Callable[..., tuple[Sequence[int], torch.dtype]],
) -> Callable[[Callable[..., torch.Tensor]], torch.library.CustomOpDef]:
    """Register a cached op under the out-buffer contract.

    :param qualname: ``"namespace::name"`` of the custom op.
    :param mutates_args: names of every argument the op writes; must include
        ``"out"`` and every cache.
    :param output_shape: called with the op's arguments, returns the full
        result ``(shape, dtype)``; it serves as the fake implementation so the
        fake and the real op agree by construction.
    :return: a decorator turning the implementation into the custom op; its
        schema has no default for ``out`` (the op object fills in ``None`` when
        a Python caller omits it).
    """
    mutates = tuple(mutates_args)
    if "out" not in mutates:
        raise ValueError(f"{qualname}: mutates_args must name 'out'")

    def decorate(fn: Callable[..., torch.Tensor]) -> torch.library.CustomOpDef:
        params = list(inspect.signature(fn).parameters)
        if not params or params[-1] != "out":
            raise ValueError(f"{qualname}: the last parameter must be 'out'")
        for name in mutates:
            if name not in params:
                raise ValueError(f"{qualname}: mutates_args names unknown argument {name!r}")
        # The schema gets no default for `out`: with one, the dispatcher drops a
        # trailing out=None and some torch releases (2.11) then mis-index the
        # mutable arguments. The dispatcher always sees `out` (None or a buffer).
        sig = inspect.signature(fn)
        fn.__signature__ = sig.replace(
            parameters=[
                p.replace(default=inspect.Parameter.empty) if p.name == "out" else p
                for p in sig.parameters.values()
            ]
        )
        op = torch.library.custom_op(qualname, mutates_args=mutates)(fn)
        # Python callers may still omit ``out``: CachedOpDef.__call__ passes None.
        op.__class__ = CachedOpDef
        op.num_args = len(params)
        op.output_shape = output_shape

        def fake(*args, **kwargs):
            bound = inspect.signature(fn).bind(*args, **kwargs)
            bound.apply_defaults()
            out = bound.arguments["out"]
            shape, dtype = output_shape(*bound.args, **bound.kwargs)
            ref = next(a for a in bound.arguments.values() if isinstance(a, torch.Tensor))
            if out is not None:
                return out.new_empty(0)
            return ref.new_empty(tuple(shape), dtype=dtype)

        op.register_fake(fake)
        return op

    return decorate
