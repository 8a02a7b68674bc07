"""Piecewise CUDA graphs: the forward recorded as graphs cut at its dynamic ops.

A bucket is captured by running the model's forward once more, eagerly, while
recording: a CUDA graph records everything up to the first dynamic op (a
cached op of a selected backend, see :func:`~backplane.core.contract.cached_op`);
there :func:`~backplane.core.contract.intercept_cached_ops` hands the call to
the recorder, which ends that graph, runs the op eagerly into an out buffer in
the runner's pool and starts the next graph. A replay is then the list of
those steps: replay graph 0, run op 0, replay graph 1, and so on; the model's
Python does not run. Nothing is traced, so start-up pays one warm-up and one
recording forward per bucket and no ``torch.compile``.

The out-buffer contract is what makes the cut possible: each op writes at a
stable address that the next graph reads from. The recorder holds the tensors
of a replay without owning them (:func:`~.capture.weak_ref`), so once a bucket
is captured its intermediates, out buffers included, return to the pool and
the next bucket's capture reuses the memory; buckets are captured largest
first. Replays are sequential, and each rewrites an intermediate before
anything reads it.

Dynamic ops must be called through their op objects: a call through the
dispatcher (``torch.ops.ns.name(...)``) would be recorded into a graph with the
capture step's metadata. :class:`EscapeCheck` catches such calls; the
conformance kit runs every backend under it, and ``check_escapes=True`` runs
each bucket's warm-up under it (that bucket then fails and runs eagerly). It is
off in the engine: entering a dispatch mode imports ``torch._dynamo`` (seconds
of start-up).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backplane.core.contract import CachedOpDef, intercept_cached_ops
from backplane.engine.worker.graph.capture import (
    GraphPool,
    Progress,
    allocate_in,
    capture_buckets,
    capture_stream,
    new_pool,
    pool_id,
    weak_refs,
)
from backplane.engine.worker.graph.context import GraphContext, GraphPhase

logger = logging.getLogger(__name__)


def normalize_ops(ops: Iterable[object]) -> frozenset[object]:
    """The ``OpOverload`` set for custom ops given as overloads, packets or op objects."""
    result: set[object] = set()
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            result.update(getattr(op, name) for name in op.overloads())
        elif hasattr(op, "_opoverload"):
            result.add(op._opoverload)
        else:
            result.add(op)
    return frozenset(result)


class EscapedOpError(RuntimeError):
    """A dynamic op was called through the dispatcher, where a recording cannot cut at it."""


class EscapeCheck(TorchDispatchMode):
    """A dispatch mode that raises :class:`EscapedOpError` when a dynamic op reaches the dispatcher.

    Run a forward under it together with :func:`intercept_cached_ops`: calls
    through op objects go to the interceptor, so only calls the recorder would
    miss reach this mode.

    :param ops: the dynamic ops' overloads (:func:`normalize_ops`).
    """

    def __init__(self, ops: frozenset[object]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func in self.ops:
            raise EscapedOpError(
                f"the dynamic op {func} was called through the dispatcher; call it "
                "through its op object (the function cached_op returned) so that a "
                "piecewise graph can run it eagerly"
            )
        return func(*args, **(kwargs or {}))


def _call_out(op: CachedOpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``out`` of a cached op's call (``None`` when the caller gave none)."""
    if len(args) >= op.num_args:
        return args[op.num_args - 1]
    return kwargs.get("out")


def _with_out(
    op: CachedOpDef, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with ``out`` set to ``out``."""
    if len(args) >= op.num_args:
        return (*args[: op.num_args - 1], out, *args[op.num_args :]), kwargs
    return args, {**kwargs, "out": out}


@dataclass
class Recording:
    """One bucket's replay: its graphs and eager op calls in order, and its output.

    :param steps: what a replay calls, in order (graph replays, op calls).
    :param inputs: the forward's inputs at capture (their addresses are the graphs').
    :param output: the forward's output, held without ownership.
    :param graphs: the CUDA graphs among the steps.
    :param ops: how many dynamic op calls are among the steps.
    """

    steps: list[Callable[[], Any]] = field(default_factory=list)
    inputs: tuple[Any, ...] = ()
    output: Any = None
    graphs: list[Any] = field(default_factory=list)
    ops: int = 0
    #: whether a replay found its inputs elsewhere than at capture (said once)
    warned: bool = False

    def replay(self, args: tuple[Any, ...]) -> Any:
        """Run the steps on ``args``, first copied to the capture addresses if they are elsewhere."""
        for i, (a, c) in enumerate(zip(args, self.inputs, strict=True)):
            if isinstance(a, torch.Tensor) and a.data_ptr() != c.data_ptr():
                if not self.warned:
                    self.warned = True
                    logger.warning(
                        "piecewise graphs: input %d (%s %s) is not at its capture address; "
                        "it is copied there before the replay",
                        i,
                        tuple(a.shape),
                        a.dtype,
                    )
                c.copy_(a)
        for step in self.steps:
            step()
        return self.output


class _Recorder:
    """Records a forward as CUDA graphs cut at its dynamic ops (the interceptor of one capture).

    :param ops: the dynamic ops' overloads.
    :param pool: the pool every graph and out buffer is allocated from.
    :param graph_type: makes the graphs (``torch.cuda.CUDAGraph``; tests pass a
        stand-in with ``capture_begin(pool=)``, ``capture_end()`` and ``replay()``).
    """

    def __init__(
        self, ops: frozenset[object], pool: GraphPool, graph_type: Callable[[], Any] | None = None
    ) -> None:
        self.ops = ops
        self.pool = pool
        self.graph_type = graph_type or torch.cuda.CUDAGraph
        self.recording = Recording()
        self._graph: Any = None

    def begin(self) -> None:
        """Start recording the next graph."""
        if torch.cuda.is_initialized():
            # no memory can be given back while a stream records (cudaFree is not
            # allowed then): what the warm-up and the eager ops left cached in the
            # default pool goes back now, or the graph's pool may run out
            torch.cuda.empty_cache()
        self._graph = self.graph_type()
        self._graph.capture_begin(pool=pool_id(self.pool))

    def end(self) -> None:
        """End the graph being recorded and append its replay."""
        graph, self._graph = self._graph, None
        with warnings.catch_warnings():
            # two dynamic ops in a row leave an empty graph between them: harmless
            warnings.filterwarnings("ignore", message=".*[Ee]mpty.*")
            graph.capture_end()
        self.recording.graphs.append(graph)
        self.recording.steps.append(graph.replay)

    def abort(self) -> None:
        """End a capture left open by a failure, so that the stream can run work again."""
        graph, self._graph = self._graph, None
        if graph is None:
            return
        try:
            graph.capture_end()
        except Exception:  # an invalidated capture still ends; the failure is the caller's
            logger.debug("ending a failed piecewise capture raised", exc_info=True)

    def __call__(self, op: CachedOpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if op._opoverload not in self.ops:
            return op._init_fn(*args, **kwargs)
        self.end()
        out = _call_out(op, args, kwargs)
        buf = out
        if buf is None:
            shape, dtype = op.output_shape(*args, **kwargs)
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            with allocate_in(self.pool):
                buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        args, kwargs = _with_out(op, args, kwargs, buf)
        op._init_fn(*args, **kwargs)
        self.recording.steps.append(
            functools.partial(
                op._init_fn, *weak_refs(args), **{k: weak_refs(v) for k, v in kwargs.items()}
            )
        )
        self.recording.ops += 1
        self.begin()
        # with out given the op returns the empty sentinel, without it the buffer
        return buf if out is None else buf.new_empty(0)


class PiecewiseGraphs:
    """Piecewise CUDA graphs of one model forward, per token-count bucket.

    :param forward: the model's forward (``input_ids, positions -> hidden``).
    :param dynamic_ops: the ops to cut at (from the selected backends).
    :param buckets: token counts to capture.
    :param pool: a shared memory pool (default: a new one on CUDA).
    :param cuda: record real CUDA graphs (default: when CUDA is available);
        otherwise capture only warms each bucket up and a replay runs the
        forward eagerly.
    :param check_escapes: run each bucket's warm-up under :class:`EscapeCheck`.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        dynamic_ops: Iterable[Any],
        buckets: list[int],
        pool: GraphPool = None,
        cuda: bool | None = None,
        check_escapes: bool = False,
    ) -> None:
        cuda = torch.cuda.is_available() if cuda is None else cuda
        self.ctx = GraphContext(
            cuda=cuda, pool=pool if pool is not None else (new_pool() if cuda else None)
        )
        self.forward = forward
        self.ops = normalize_ops(dynamic_ops)
        self.buckets = sorted(buckets)
        self.check_escapes = check_escapes
        self.recordings: dict[int, Recording] = {}
        self.captured: set[int] = set()
        self.failed: dict[int, str] = {}

    def capture(
        self,
        make_inputs: Callable[[int], AbstractContextManager[tuple[Any, ...]]],
        postprocess_fn: Callable[..., None] | None = None,
        progress: Progress = None,
    ) -> None:
        """Warm up and record every bucket, largest first.

        :param make_inputs: ``make_inputs(bucket)`` is a context manager that
            prepares a batch of ``bucket`` padded tokens in the persistent
            input buffers (and its forward context) and yields the forward's
            arguments.
        :param postprocess_fn: restores inputs the forward mutates; called with
            the forward's arguments after the warm-up run and after recording.
        :param progress: an optional tqdm-like bar, advanced once per bucket.
        """

        def capture_one(bucket: int) -> None:
            try:
                with make_inputs(bucket) as args:
                    self.ctx.enter(GraphPhase.WARMUP, bucket)
                    with contextlib.ExitStack() as stack:
                        if self.check_escapes:
                            stack.enter_context(intercept_cached_ops(_run_op))
                            stack.enter_context(EscapeCheck(self.ops))
                        self.forward(*args)
                    if postprocess_fn is not None:
                        postprocess_fn(*args)
                    if self.ctx.cuda:
                        self.ctx.enter(GraphPhase.CAPTURE, bucket)
                        self.recordings[bucket] = self._record(args)
                        if postprocess_fn is not None:
                            postprocess_fn(*args)
                self.captured.add(bucket)
            finally:
                self.ctx.enter(GraphPhase.EAGER, None)

        capture_buckets(
            self.buckets,
            capture_one,
            pool=self.ctx.pool,
            label="piecewise bucket",
            failed=self.failed,
            grown=self.ctx.pool_bytes,
            progress=progress,
        )

    def _record(self, args: tuple[Any, ...]) -> Recording:
        recorder = _Recorder(self.ops, self.ctx.pool)
        stream = capture_stream(torch.cuda.current_device())
        stream.wait_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        with torch.cuda.stream(stream), intercept_cached_ops(recorder):
            try:
                recorder.begin()
                out = self.forward(*args)
                recorder.end()
            except BaseException:
                # on the capture stream: a capture can only end where it began
                recorder.abort()
                raise
        torch.cuda.current_stream().wait_stream(stream)
        recording = recorder.recording
        recording.inputs = tuple(args)
        recording.output = weak_refs(out)
        del out  # drop strong refs: the pool is reused by the next bucket
        return recording

    def run(self, bucket: int, *args: Any) -> Any:
        """Replay bucket ``bucket`` on the current inputs (already padded to it).

        Without a recording (no CUDA, or a failed capture) the forward runs eagerly.
        """
        recording = self.recordings.get(bucket)
        if recording is None:
            return self.forward(*args)
        self.ctx.enter(GraphPhase.REPLAY, bucket)
        try:
            return recording.replay(args)
        finally:
            self.ctx.enter(GraphPhase.EAGER, None)

    def release(self) -> None:
        """Drop every recording (graphs, and the references their steps hold)."""
        self.recordings.clear()
        self.captured.clear()


def _run_op(op: CachedOpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a cached op's function directly (the interceptor of warm-up runs)."""
    return op._init_fn(*args, **kwargs)
