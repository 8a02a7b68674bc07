"""Piecewise CUDA graphs: captured static segments, eager dynamic ops between them.

The model's forward is traced by ``torch.compile`` with a backend of ours
(:class:`PiecewiseCompiler`) that splits the traced graph at the dynamic ops
and swaps every segment for a runner:

* :class:`StaticSegment` records one CUDA graph per bucket and replays it;
* :class:`DynamicOpSegment` runs its cached op eagerly, writing into an out
  buffer allocated once in the shared pool (the out-buffer contract is what
  makes this possible: the op writes at a stable address the next captured
  segment reads from).

Buckets are captured largest first. After a bucket is captured, strong
references to its intermediates are dropped so the pool memory is reused by the
next bucket's capture; out buffers of smaller buckets are row-prefix views of
the largest bucket's buffer for the same op, so each op owns one allocation.
"""

from __future__ import annotations

import itertools
import logging
import types
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.fx

from backplane.engine.worker.graph.capture import (
    GraphPool,
    Progress,
    allocate_in,
    capture_buckets,
    new_pool,
    pool_id,
    weak_ref,
    weak_refs,
)
from backplane.engine.worker.graph.context import GraphContext, GraphPhase
from backplane.engine.worker.graph.split import Segment, node_overload, split_at_dynamic_ops

logger = logging.getLogger(__name__)


class StaticSegment(torch.nn.Module):
    """A segment without dynamic ops: eager, or one CUDA graph per bucket.

    :param name: the segment's name, for messages.
    :param module: the traced submodule.
    :param ctx: the runner's shared :class:`GraphContext`.
    """

    def __init__(self, name: str, module: torch.nn.Module, ctx: GraphContext) -> None:
        super().__init__()
        self.name = name
        self.module = module
        self.ctx = ctx
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}
        self.static_inputs: dict[int, list[torch.Tensor | None]] = {}
        self.copy_inputs: dict[int, list[int]] = {}
        self.checked: set[int] = set()

    def forward(self, *args: Any) -> Any:
        ctx = self.ctx
        phase, bucket = ctx.phase, ctx.bucket
        if phase in (GraphPhase.EAGER, GraphPhase.WARMUP) or bucket is None:
            return self.module(*args)
        if phase is GraphPhase.CAPTURE:
            if not ctx.cuda:
                return self.module(*args)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool_id(ctx.pool)):
                out = self.module(*args)
            self.graphs[bucket] = graph
            self.outputs[bucket] = weak_refs(out)
            # Inputs made by earlier segments of this capture are held without
            # ownership (the pool reuses them once the bucket is done); anything
            # else (weights, caches, persistent input buffers) is held strongly,
            # so a moved input can always be copied back to where the graph reads it.
            self.static_inputs[bucket] = [
                (weak_ref(a) if a.data_ptr() in ctx.produced else a)
                if isinstance(a, torch.Tensor)
                else None
                for a in args
            ]
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    ctx.produced.add(t.data_ptr())
            return out
        graph = self.graphs.get(bucket)
        if graph is None:  # no CUDA (or capture skipped): same code, eagerly
            return self.module(*args)
        if bucket not in self.checked:
            self._check_inputs(bucket, args)
        for i in self.copy_inputs.get(bucket, ()):
            self.static_inputs[bucket][i].copy_(args[i])
        graph.replay()
        return self.outputs[bucket]

    def release(self) -> None:
        """Drop the captured graphs and the references they keep to their inputs."""
        self.graphs.clear()
        self.outputs.clear()
        self.static_inputs.clear()
        self.copy_inputs.clear()
        self.checked.clear()

    def _check_inputs(self, bucket: int, args: tuple[Any, ...]) -> None:
        """At the first replay of a bucket, find inputs that are not where capture saw them.

        Inputs should live in persistent buffers; one that does not is copied
        into its capture-time address before every replay (correct, but a copy
        per step), and reported once.
        """
        moved = []
        for i, (a, s) in enumerate(zip(args, self.static_inputs[bucket], strict=True)):
            if isinstance(a, torch.Tensor) and s is not None and a.data_ptr() != s.data_ptr():
                moved.append(i)
                logger.warning(
                    "piecewise segment %s, bucket %d: input %d (%s %s) is not at its capture "
                    "address; it is copied before each replay",
                    self.name,
                    bucket,
                    i,
                    tuple(a.shape),
                    a.dtype,
                )
        self.copy_inputs[bucket] = moved
        self.checked.add(bucket)


class DynamicOpSegment(torch.nn.Module):
    """A segment holding exactly one cached op, always run eagerly.

    In capture and replay phases the op writes into an out buffer of the
    current bucket, so the following captured segment finds its input at the
    address it was recorded with.

    :param name: the segment's name.
    :param module: the traced submodule (one ``call_function`` node).
    :param op: the op's overload.
    :param ctx: the runner's shared context.
    """

    def __init__(self, name: str, module: torch.fx.GraphModule, op: Any, ctx: GraphContext) -> None:
        super().__init__()
        self.name = name
        self.module = module
        self.op = op
        self.ctx = ctx
        self.with_out = _rewrite_with_out(module, op)
        self.out_info: dict[int, tuple[tuple[int, ...], torch.dtype, torch.device]] = {}
        self.buffers: dict[int, torch.Tensor] = {}
        self._base: torch.Tensor | None = None

    def forward(self, *args: Any) -> Any:
        ctx = self.ctx
        phase, bucket = ctx.phase, ctx.bucket
        if phase is GraphPhase.EAGER or bucket is None:
            return self.module(*args)
        if phase is GraphPhase.WARMUP:
            out = self.module(*args)
            self.out_info[bucket] = (tuple(out.shape), out.dtype, out.device)
            return out
        buf = self.buffers.get(bucket)
        if buf is None:
            if phase is GraphPhase.REPLAY:
                raise RuntimeError(
                    f"{self.name}: bucket {bucket} is replayed but was never captured"
                )
            if bucket not in self.out_info:
                # this trace was first reached at capture time (a recompile): discover the shape now
                out = self.module(*args)
                self.out_info[bucket] = (tuple(out.shape), out.dtype, out.device)
                del out
            buf = self._allocate(bucket)
        self.with_out(*args, buf)
        if phase is GraphPhase.CAPTURE:
            self.ctx.produced.add(buf.data_ptr())
        return buf

    def _allocate(self, bucket: int) -> torch.Tensor:
        shape, dtype, device = self.out_info[bucket]
        base = self._base
        if (
            base is not None
            and base.dtype == dtype
            and tuple(base.shape[1:]) == shape[1:]
            and base.shape[0] >= shape[0]
        ):
            buf = base[: shape[0]]
        else:
            with allocate_in(self.ctx.pool if device.type == "cuda" else None):
                buf = torch.empty(shape, dtype=dtype, device=device)
            if base is None or buf.shape[0] > base.shape[0]:
                self._base = buf
        self.buffers[bucket] = buf
        return buf

    def release(self) -> None:
        """Drop the out buffers (they live in the graph pool)."""
        self.buffers.clear()
        self._base = None


def _python_impl(op: Any) -> Callable[..., Any] | None:
    """The Python function behind a custom op's overload, or ``None``.

    A dynamic segment replays its op eagerly on real tensors under inference
    mode, where the dispatcher would only add its bookkeeping for mutated
    arguments (tens of microseconds per layer and step) to the same function;
    ``core.contract``'s cached ops skip it the same way for eager callers.
    """
    from torch._library.custom_ops import OPDEFS

    fn = getattr(OPDEFS.get(op._schema.name), "_init_fn", None)
    if fn is None:
        return None

    def call(*args: Any, **kwargs: Any) -> Any:
        # with autograd on, the dispatcher's checks are wanted
        return op(*args, **kwargs) if torch.is_grad_enabled() else fn(*args, **kwargs)

    return call


def _rewrite_with_out(module: torch.fx.GraphModule, op: Any) -> torch.fx.GraphModule:
    """Copy ``module`` so that it takes an extra last input, the op's ``out``, and returns it."""
    gm = torch.fx.GraphModule(module, torch.fx.Graph())
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        env[n] = graph.node_copy(n, lambda x: env[x])
    out_ph = graph.placeholder("backplane_out")
    result = None
    for n in module.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            graph.output(out_ph)
            continue
        new = graph.node_copy(n, lambda x: env[x])
        if n.op == "call_function" and node_overload(n) is op:
            names = [a.name for a in op._schema.arguments]
            out_pos = names.index("out")
            if len(new.args) > out_pos:
                new.args = (*new.args[:out_pos], out_ph, *new.args[out_pos + 1 :])
            else:
                new.kwargs = {**new.kwargs, "out": out_ph}
            impl = _python_impl(op)
            if impl is not None:
                new.target = impl
            result = new
        env[n] = new
    if result is None:
        raise RuntimeError("dynamic segment does not call its op")
    gm.graph = graph
    gm.recompile()
    return gm


_RUNNER_IDS = itertools.count()


def _own_code(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``forward`` in a function with a code object of its own.

    Dynamo keeps its compiled entries, and its recompile limit, per code
    object. Every runner traces ``model(...)`` through the same method, so
    without this the engines of one process (several models, or tests) would
    share one cache, guard on each other's modules and, past the limit, fail to
    trace at all.
    """

    def traced(*args: Any) -> Any:
        return forward(*args)

    code = traced.__code__.replace(co_name=f"piecewise_forward_{next(_RUNNER_IDS)}")
    return types.FunctionType(code, traced.__globals__, code.co_name, None, traced.__closure__)


class PiecewiseCompiler:
    """A ``torch.compile`` backend that splits at dynamic ops and installs segment runners.

    :param dynamic_ops: the cached ops of the selected backends.
    :param ctx: the runner's shared context.
    """

    def __init__(self, dynamic_ops: Iterable[Any], ctx: GraphContext) -> None:
        self.dynamic_ops = list(dynamic_ops)
        self.ctx = ctx
        self.splits: list[tuple[torch.fx.GraphModule, list[Segment]]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        split, segments = split_at_dynamic_ops(gm, self.dynamic_ops)
        for seg in segments:
            sub = getattr(split, seg.name)
            if seg.dynamic:
                runner: torch.nn.Module = DynamicOpSegment(seg.name, sub, seg.op, self.ctx)
            else:
                runner = StaticSegment(seg.name, sub, self.ctx)
            setattr(split, seg.name, runner)
        self.splits.append((split, segments))
        n_dyn = sum(s.dynamic for s in segments)
        logger.info(
            "piecewise graph: %d segments (%d dynamic ops, %d static)",
            len(segments),
            n_dyn,
            len(segments) - n_dyn,
        )
        return split

    def release(self) -> None:
        """Release every segment's graphs and buffers and forget the traced splits."""
        for split, segments in self.splits:
            for seg in segments:
                runner = getattr(split, seg.name, None)
                if runner is not None and hasattr(runner, "release"):
                    runner.release()
        self.splits.clear()


class PiecewiseGraphs:
    """Piecewise CUDA graphs of one model forward, per token-count bucket.

    :param forward: the model's forward (``input_ids, positions -> hidden``).
    :param dynamic_ops: the ops to split at (from the selected backends).
    :param buckets: token counts to capture.
    :param pool: a shared memory pool (default: a new one on CUDA).
    :param cuda: record real CUDA graphs (default: when CUDA is available);
        otherwise every phase runs the segments eagerly.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        dynamic_ops: Iterable[Any],
        buckets: list[int],
        pool: GraphPool = None,
        cuda: bool | None = None,
    ) -> None:
        cuda = torch.cuda.is_available() if cuda is None else cuda
        self.ctx = GraphContext(
            cuda=cuda, pool=pool if pool is not None else (new_pool() if cuda else None)
        )
        self.buckets = sorted(buckets)
        self.compiler = PiecewiseCompiler(dynamic_ops, self.ctx)
        # Only the token dimension of the inputs is symbolic (marked at the first
        # capture); everything else, module constants included, is specialised, so
        # no per-call scalar tensors become graph inputs.
        self._traced = _own_code(forward)
        self.compiled: Any = torch.compile(
            self._traced, backend=self.compiler, dynamic=None, fullgraph=True
        )
        self.captured: set[int] = set()
        self.failed: dict[int, str] = {}
        self._marked = False

    def capture(
        self,
        make_inputs: Callable[[int], AbstractContextManager[tuple[Any, ...]]],
        postprocess_fn: Callable[..., None] | None = None,
        progress: Progress = None,
    ) -> None:
        """Warm up and capture every bucket, largest first.

        :param make_inputs: ``make_inputs(bucket)`` is a context manager that
            prepares a batch of ``bucket`` padded tokens in the persistent
            input buffers (and its forward context) and yields the forward's
            arguments.
        :param postprocess_fn: restores inputs the forward mutates; called with
            the forward's arguments after the warmup run and after capture.
        :param progress: an optional tqdm-like bar, advanced once per bucket.
        """

        def capture_one(bucket: int) -> None:
            try:
                with make_inputs(bucket) as args:
                    if not self._marked:
                        # one trace with a symbolic token count serves every bucket above 1
                        for a in args:
                            if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] > 1:
                                torch._dynamo.mark_dynamic(a, 0)
                        self._marked = True
                    self.ctx.enter(GraphPhase.WARMUP, bucket)
                    self.compiled(*args)
                    if postprocess_fn is not None:
                        postprocess_fn(*args)
                    self.ctx.enter(GraphPhase.CAPTURE, bucket)
                    self.ctx.produced.clear()
                    out = self.compiled(*args)
                    if postprocess_fn is not None:
                        postprocess_fn(*args)
                    del out  # drop strong refs: the pool is reused by the next bucket
                    self.ctx.produced.clear()
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

    def run(self, bucket: int, *args: Any) -> Any:
        """Replay bucket ``bucket`` on the current inputs (already padded to it)."""
        self.ctx.enter(GraphPhase.REPLAY if bucket in self.captured else GraphPhase.EAGER, bucket)
        try:
            return self.compiled(*args)
        finally:
            self.ctx.enter(GraphPhase.EAGER, None)

    def release(self) -> None:
        """Release the graphs, and torch.compile's hold on this forward and its backend.

        The segments keep the tensors their graphs read (weights, caches) as
        static inputs, and torch.compile keeps the backend and the traced code
        in process-wide caches: without this the model and its caches would
        outlive the engine.
        """
        self.compiler.release()
        self.captured.clear()
        try:
            from torch._dynamo import eval_frame

            torch._dynamo.reset_code(self._traced.__code__)
            cached = getattr(eval_frame, "cached_backends", {})
            for key, backend in list(cached.items()):
                if (
                    backend is self.compiler
                    or getattr(backend, "__wrapped__", None) is self.compiler
                ):
                    del cached[key]
        except Exception:  # private torch API: a missing piece only costs memory
            logger.debug(
                "could not drop torch.compile's caches of a piecewise forward", exc_info=True
            )
        self.compiled = None
