"""Checks shared by every family's conformance tests.

* :data:`TOLERANCES` — documented per-dtype tolerances against the float64
  references of the kit.
* :func:`poison_` — fill a buffer with NaN (or the largest integer) so that any
  element an op forgets to write is caught.
* :func:`check_out_contract` — the out-buffer contract of
  :mod:`backplane.core.contract`, checked in one place.
* :func:`no_host_sync` — fail on any device synchronisation (CUDA only).
* :func:`run_opcheck` — ``torch.library.opcheck`` with the kit's defaults.
* :func:`record_custom_ops` — the custom ops a backend's forward calls, to
  opcheck them and to compare them with its ``dynamic_ops()``.
* :func:`check_custom_ops` — both of the above for one call of a backend, and
  :func:`check_op_objects_called`: its dynamic ops reached through their op objects.
* :func:`check_graph_replay` — a step captured in a CUDA graph replays like
  the eager step (CUDA only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backplane.core.contract import intercept_cached_ops
from backplane.core.forward_context import forward_context
from backplane.core.metadata import BatchMetadata

#: ``dtype -> (atol, rtol)`` for comparing a backend's output with the kit's
#: float64 reference (computed from the same, already rounded, inputs). The
#: half-precision entries allow for inputs, intermediate products and the
#: output each being rounded once (bfloat16 keeps 8 significant bits, float16
#: 11); float32 allows for accumulation-order differences only.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (2e-4, 2e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def tolerance(dtype: torch.dtype, scale: float = 1.0) -> tuple[float, float]:
    """Return ``(atol, rtol)`` for ``dtype``, optionally scaled.

    :param dtype: the dtype the backend computed in.
    :param scale: a multiplier for ops whose error grows with sequence length
        (recurrences); document why wherever it is not 1.
    :return: the tolerances.
    """
    atol, rtol = TOLERANCES[dtype]
    return atol * scale, rtol * scale


def assert_close_to_reference(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    *,
    scale: float = 1.0,
    msg: str = "",
) -> None:
    """Compare a backend result with a float64 reference under :data:`TOLERANCES`.

    Every element is compared (NaN never passes).

    :param actual: the backend's output.
    :param expected: the reference (any float dtype; compared in float64).
    :param dtype: the dtype whose tolerance applies.
    :param scale: see :func:`tolerance`.
    :param msg: context prepended to the failure message.
    """
    atol, rtol = tolerance(dtype, scale)
    torch.testing.assert_close(
        actual.detach().to("cpu", torch.float64),
        expected.detach().to("cpu", torch.float64),
        atol=atol,
        rtol=rtol,
        equal_nan=False,
        msg=(lambda m: f"{msg}\n{m}") if msg else None,
    )


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with values no correct op leaves behind.

    Floating tensors get NaN, integer tensors their largest value, booleans
    ``True``.

    :param t: the tensor to poison.
    :return: ``t``.
    """
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).max)


def check_out_contract(
    run: Callable[[torch.Tensor | None], torch.Tensor],
    caches: Sequence[torch.Tensor],
    num_tokens: int,
) -> torch.Tensor:
    """Check the out-buffer contract of one cached op on one batch.

    ``run(None)`` calls the op without ``out`` and ``run(buf)`` calls it with
    ``out=buf``; ``run`` must use the same inputs and the same active forward
    context both times. The caches are snapshotted first and restored between
    the two calls, so both calls see the same starting state.

    Checked: the op without ``out`` returns a full-size tensor; with a
    NaN-poisoned ``out`` it returns an empty sentinel (``numel() == 0``), rows
    ``[0, num_tokens)`` of ``out`` equal the rows returned without ``out``,
    rows ``[num_tokens, padded)`` are exactly zero, and every cache ends up
    bit-identical after the two calls.

    :param run: calls the op, with ``out`` or ``None``.
    :param caches: every cache the op may write (they are restored in place).
    :param num_tokens: the batch's real token count.
    :return: the result of ``run(None)`` (compare it with a reference).
    """
    snapshot = [c.clone() for c in caches]
    full = run(None)
    assert isinstance(full, torch.Tensor), f"op without out returned {type(full).__name__}"
    assert full.dim() >= 1 and full.shape[0] >= num_tokens, (
        f"op without out returned shape {tuple(full.shape)}; expected {num_tokens}+ rows"
    )
    assert full.numel() > 0 or num_tokens == 0, "op without out returned an empty tensor"
    after_plain = [c.clone() for c in caches]
    for cache, saved in zip(caches, snapshot, strict=True):
        cache.copy_(saved)

    out = poison_(torch.empty_like(full))
    ret = run(out)
    assert isinstance(ret, torch.Tensor) and ret.numel() == 0, (
        "with out= the op must return an empty sentinel tensor (numel() == 0), got "
        f"{type(ret).__name__} of shape {tuple(getattr(ret, 'shape', ()))}"
    )
    head_out, head_full = out[:num_tokens], full[:num_tokens]
    if head_out.is_floating_point():
        assert not torch.isnan(head_out).any(), (
            f"rows [0, {num_tokens}) of out still hold NaN poison: the op did not write every "
            "element (or produced NaN)"
        )
    torch.testing.assert_close(
        head_out,
        head_full,
        atol=0,
        rtol=0,
        equal_nan=False,
        msg=lambda m: (
            f"rows [0, {num_tokens}) differ between the out= call and the plain call\n{m}"
        ),
    )
    tail = out[num_tokens:]
    if tail.numel():
        bad = tail != 0
        if tail.is_floating_point():
            bad = bad | torch.isnan(tail)
        assert not bad.any(), (
            f"padding rows [{num_tokens}, {out.shape[0]}) of out must be exactly zero; "
            f"{int(bad.sum())} elements are not"
        )
    for i, (cache, expected) in enumerate(zip(caches, after_plain, strict=True)):
        assert torch.equal(cache, expected), (
            f"cache {i} differs between the call with out= and the call without it"
        )
    return full


@contextlib.contextmanager
def no_host_sync(device: torch.device | str | None = None) -> Iterator[None]:
    """Make any host-device synchronisation inside the block an error.

    On CUDA this sets ``torch.cuda.set_sync_debug_mode("error")`` (``.item()``,
    ``.cpu()``, ``nonzero``, blocking copies raise); elsewhere it does nothing,
    since a CPU "device" has nothing to synchronise with.

    :param device: the device the op runs on (``None``: CUDA when available).
    """
    dev = torch.device(device) if device is not None else None
    use_cuda = torch.cuda.is_available() and (dev is None or dev.type == "cuda")
    if not use_cuda:
        yield
        return
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def run_opcheck(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    test_utils: Sequence[str] | None = None,
) -> dict[str, str]:
    """Run ``torch.library.opcheck`` on one call of a cached op.

    opcheck calls the op several times on the same arguments (eagerly, on
    fake tensors, under AOT dispatch) and compares the results, so the call
    must be idempotent: an attention append rewrites the same slots, but a
    recurrent op must be checked on a batch that does not read the state it
    writes (every ``has_initial_state`` false, e.g. a pure-prefill case).

    :param op: the custom op (``CustomOpDef`` or ``OpOverload``).
    :param args: positional arguments of the call.
    :param kwargs: keyword arguments of the call.
    :param test_utils: opcheck's checks (default: all of its defaults).
    :return: opcheck's result dict; failures raise.
    """
    extra: dict[str, Any] = {}
    if test_utils is not None:
        extra["test_utils"] = tuple(test_utils)
    return torch.library.opcheck(op, args, kwargs or {}, **extra)


class _OpRecorder(TorchDispatchMode):
    """Records the non-aten operator calls that reach the dispatcher (only ``ops``, if given)."""

    def __init__(self, ops: Collection[Any] | None = None) -> None:
        super().__init__()
        self.ops = None if ops is None else frozenset(ops)
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self.ops is not None:
            if func in self.ops:
                self.calls.append((func, tuple(args), dict(kwargs)))
        elif getattr(func, "namespace", "aten") not in _BUILTIN_NAMESPACES:
            self.calls.append((func, tuple(args), dict(kwargs)))
        return func(*args, **kwargs)


_BUILTIN_NAMESPACES = frozenset({"aten", "prim", "prims", "_c10d_functional", "c10d_functional"})


def record_custom_ops(
    fn: Callable[[], Any],
    ops: Collection[Any] | None = None,
) -> tuple[Any, list[tuple[Any, tuple[Any, ...], dict[str, Any]]]]:
    """Run ``fn()`` and record the custom (non-aten) operators it calls directly.

    Calls made from inside a custom op's implementation are not recorded: a
    dispatch mode is suspended while the op it intercepted runs.

    :param fn: the call to observe, e.g. ``lambda: backend.forward(...)``.
    :param ops: record only calls of these op overloads (default: every custom op).
    :return: ``(fn's result, [(op overload, args, kwargs), ...])`` in call order.
    """
    recorder = _OpRecorder(ops)
    with recorder:
        result = fn()
    return result, recorder.calls


def _with_out(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Return ``(args, kwargs)`` of a recorded call with its ``out`` argument replaced."""
    names = [a.name for a in op._schema.arguments]
    if "out" not in names:
        raise AssertionError(f"{op} has no 'out' argument; cached ops must end with out=None")
    idx = names.index("out")
    if idx < len(args):
        args = args[:idx] + (out,) + args[idx + 1 :]
    else:
        kwargs = dict(kwargs, out=out)
    return args, kwargs


def check_custom_ops(
    backend: Any,
    fn: Callable[[], Any],
    out_shape: Sequence[int],
    out_dtype: torch.dtype,
) -> int:
    """Check the custom ops one call of a backend makes.

    Every custom op ``fn`` calls must be listed by ``backend.dynamic_ops()``
    (the graph runner splits only at listed ops) and pass
    ``torch.library.opcheck`` both without ``out`` and with one. Call it
    inside the forward context of the batch ``fn`` runs on; the batch must not
    read the state it writes (opcheck calls the op repeatedly, so a recurrent
    op needs a batch without ``has_initial_state``).

    :param backend: the backend object.
    :param fn: calls the backend once.
    :param out_shape: the op's full result shape.
    :param out_dtype: the op's result dtype.
    :return: the number of op calls checked (at least one).
    """
    dynamic = set(backend.dynamic_ops())
    _, calls = record_custom_ops(fn)
    assert calls, "forward called no custom op; cached ops must be torch.library custom ops"
    check_op_objects_called(backend, fn)
    for op, args, kwargs in calls:
        assert op in dynamic, (
            f"forward called {op} which dynamic_ops() does not list; the graph runner "
            "splits only at listed ops"
        )
        device = next(a for a in args if isinstance(a, torch.Tensor)).device
        for out in (None, torch.zeros(tuple(out_shape), dtype=out_dtype, device=device)):
            a, k = _with_out(op, args, kwargs, out)
            run_opcheck(op, a, k)
    return len(calls)


def check_op_objects_called(backend: Any, fn: Callable[[], Any]) -> int:
    """Check that one call of a backend reaches its dynamic ops through their op objects.

    The piecewise graphs cut a recorded forward where a cached op's object is
    called (:func:`~backplane.core.contract.intercept_cached_ops`); a call
    through the dispatcher (``torch.ops.ns.name(...)``) would be recorded into
    a graph with one step's metadata.

    :param backend: the backend object.
    :param fn: calls the backend once.
    :return: the number of dynamic op calls seen (at least one).
    :raises EscapedOpError: a dynamic op was called through the dispatcher.
    """
    from backplane.engine.worker.graph.piecewise import EscapeCheck, normalize_ops

    ops = normalize_ops(backend.dynamic_ops())
    seen: list[Any] = []

    def note(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if op._opoverload in ops:
            seen.append(op._opoverload)
        return op._init_fn(*args, **kwargs)

    # as the engine runs it: without autograd, where op objects skip the dispatcher
    with torch.no_grad(), intercept_cached_ops(note), EscapeCheck(ops):
        fn()
    assert seen, (
        "forward reached none of dynamic_ops() through an op object; call the object "
        "cached_op returned, so that piecewise graphs can run the op eagerly"
    )
    return len(seen)


def check_graph_replay(
    batch: BatchMetadata,
    plans: dict[str, Any],
    step: Callable[[], None],
    per_step_inputs: Sequence[torch.Tensor],
    caches: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    seed: int = 0,
) -> None:
    """Capture ``step`` in a CUDA graph, replay it on a new step, compare with eager.

    The replayed step gets fresh per-token inputs and the batch's state slots
    in reverse order (written in place into the batch's device tensor, as the
    engine does with its persistent buffers), so an op that baked slots or
    inputs into the graph as constants fails.

    :param batch: a decode batch on CUDA.
    :param plans: the backends' plans for ``batch``.
    :param step: runs the op(s), writing into ``outs``.
    :param per_step_inputs: tensors refreshed before the replay.
    :param caches: every cache the op(s) write.
    :param outs: the out buffers ``step`` writes.
    :param seed: seeds the fresh inputs.
    """
    gen = torch.Generator().manual_seed(seed)
    snapshot = [c.clone() for c in caches]
    with forward_context(batch, plans):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm up outside the graph
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    for t in per_step_inputs:
        t.copy_(torch.randn(t.shape, generator=gen).to(t))
    for cache, saved in zip(caches, snapshot, strict=True):
        cache.copy_(saved)
    batch.state_slots.copy_(batch.state_slots.flip(0))
    batch.host.state_slots[:] = batch.host.state_slots[::-1].copy()
    graph.replay()
    torch.cuda.synchronize()
    replayed = [o.clone() for o in outs]
    replayed_caches = [c.clone() for c in caches]
    for cache, saved in zip(caches, snapshot, strict=True):
        cache.copy_(saved)
    for o in outs:
        o.fill_(float("nan"))
    with forward_context(batch, plans):
        step()
    for i, (got, want) in enumerate(zip(replayed, outs, strict=True)):
        torch.testing.assert_close(
            got, want, atol=1e-6, rtol=1e-6, msg=lambda m, i=i: f"out {i}: {m}"
        )
    for i, (got, want) in enumerate(zip(replayed_caches, caches, strict=True)):
        torch.testing.assert_close(
            got, want, atol=1e-6, rtol=1e-6, msg=lambda m, i=i: f"cache {i}: {m}"
        )
    del graph
