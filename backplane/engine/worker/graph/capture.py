"""Capturing one callable as a CUDA graph, and the memory helpers around it."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from backplane.engine.worker.startup_timings import startup_detail

logger = logging.getLogger(__name__)

#: The memory pool of one runner's graphs: a ``torch.cuda.MemPool``, or on torch
#: builds without it the handle ``torch.cuda.graph_pool_handle()`` returns. Any:
#: that handle's type is private to torch and differs between versions.
GraphPool = Any
#: A graph's inputs or outputs: a tensor, or a tuple/list of them nested to any
#: depth (Any: the nesting follows the captured function's return value).
GraphValues = Any
#: A progress bar (``tqdm``) advanced once per captured bucket. Any: any object with
#: ``update(n)`` and ``set_postfix_str(s)`` will do.
Progress = Any


def new_pool() -> GraphPool:
    """Return a memory pool shared by every graph and out buffer of one runner.

    A ``torch.cuda.MemPool`` when available (so out buffers can be allocated in
    it outside capture), else a graph pool handle.
    """
    if hasattr(torch.cuda, "MemPool"):
        return torch.cuda.MemPool()
    return torch.cuda.graph_pool_handle()


def pool_id(pool: GraphPool) -> GraphPool:
    """Return what ``torch.cuda.graph(pool=...)`` expects for ``pool``."""
    return pool.id if hasattr(pool, "id") else pool


@contextlib.contextmanager
def allocate_in(pool: GraphPool) -> Iterator[None]:
    """Allocate tensors created inside the block from ``pool`` (when supported)."""
    if pool is not None and hasattr(torch.cuda, "use_mem_pool") and hasattr(pool, "id"):
        with torch.cuda.use_mem_pool(pool):
            yield
    else:
        yield


#: the integer dtype (and its ``__cuda_array_interface__`` type string) a tensor
#: of each element width is viewed as by :func:`weak_ref`
_RAW_VIEWS: dict[int, tuple[torch.dtype, str]] = {
    1: (torch.uint8, "|u1"),
    2: (torch.int16, "<i2"),
    4: (torch.int32, "<i4"),
    8: (torch.int64, "<i8"),
}


def weak_ref(t: torch.Tensor) -> torch.Tensor:
    """Return a tensor aliasing ``t``'s memory without keeping it allocated.

    Graph outputs that only feed the next captured segment are held this way,
    so that once a bucket is captured its intermediates return to the pool
    and later captures reuse the memory. Replays are sequential, and each replay
    rewrites an intermediate before anything reads it.
    """
    if t.device.type != "cuda":
        return t

    class _Iface:
        __slots__ = ("__cuda_array_interface__",)

    # Viewed as the integer of its width, a tensor of any dtype (float8 caches and
    # activations, bfloat16, bool) has a type string the interface knows.
    raw = t.view(_RAW_VIEWS[t.element_size()][0])
    iface = _Iface()
    iface.__cuda_array_interface__ = {
        "shape": tuple(raw.shape),
        "strides": tuple(s * raw.element_size() for s in raw.stride()),
        "typestr": _RAW_VIEWS[raw.element_size()][1],
        "data": (raw.data_ptr(), False),
        "version": 2,
    }
    alias = torch.as_tensor(iface, device=t.device)
    return alias.view(t.dtype) if alias.dtype != t.dtype else alias


def weak_refs(value: GraphValues) -> GraphValues:
    """Apply :func:`weak_ref` to every tensor in a (nested) tuple/list."""
    if isinstance(value, torch.Tensor):
        return weak_ref(value)
    if isinstance(value, (tuple, list)):
        return type(value)(weak_refs(v) for v in value)
    return value


class _EagerGraph:
    """Stand-in for ``torch.cuda.CUDAGraph`` without CUDA: replay re-runs the forward."""

    def __init__(self, fn: Callable[..., Any], inputs: tuple, outputs: Any):
        self.fn, self.inputs, self.outputs = fn, inputs, outputs

    def replay(self) -> None:
        result = self.fn(*self.inputs)
        _copy_into(self.outputs, result)


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src, strict=True):
            _copy_into(d, s)


@dataclass
class CapturedGraph:
    """A captured graph and the outputs it writes on every replay."""

    # a torch.cuda.CUDAGraph, or its eager stand-in without CUDA
    graph: torch.cuda.CUDAGraph | _EagerGraph
    outputs: GraphValues

    def replay(self) -> GraphValues:
        """Replay the graph and return its (stable-address) outputs."""
        self.graph.replay()
        return self.outputs


def capture(
    forward_fn: Callable[..., Any],
    postprocess_fn: Callable[..., None] | None,
    inputs: tuple[Any, ...],
    *,
    pool: GraphPool = None,
    num_warmup: int = 1,
    stream: Any = None,
    cuda: bool | None = None,
) -> CapturedGraph:
    """Warm up and capture ``forward_fn(*inputs)`` as one CUDA graph.

    :param forward_fn: the computation; it reads ``inputs`` (stable-address
        tensors) and may mutate some of them in place.
    :param postprocess_fn: called as ``postprocess_fn(*inputs)`` after each
        warmup run and after capture, to restore inputs the forward mutates
        (e.g. offsets advanced in place); without it, warmup runs would
        compound the mutation and the graph would be recorded from wrong inputs.
    :param inputs: the arguments, at the addresses replays will use.
    :param pool: the memory pool to capture into.
    :param num_warmup: eager runs before capture (kernel selection, lazy init).
        One is enough: the first run compiles and autotunes every kernel it
        launches and makes whatever is made on first use, so a second run
        meets nothing new and only costs a forward per graph at start-up (the
        piecewise captures run one as well).
    :param stream: the side stream to capture on (default: a new one).
    :param cuda: record a real CUDA graph (default: when CUDA is available).
    :return: the captured graph; its outputs live in the pool. Without CUDA
        the "graph" re-runs ``forward_fn`` eagerly on replay and copies the
        results into the outputs of the capture run, which keeps the phase
        logic (and this hook) testable on any machine.
    """
    if cuda is None:
        cuda = torch.cuda.is_available()
    if not cuda:
        for _ in range(num_warmup):
            forward_fn(*inputs)
            if postprocess_fn is not None:
                postprocess_fn(*inputs)
        outputs = forward_fn(*inputs)
        if postprocess_fn is not None:
            postprocess_fn(*inputs)
        return CapturedGraph(_EagerGraph(forward_fn, inputs, outputs), outputs)
    stream = stream or capture_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(num_warmup):
            forward_fn(*inputs)
            if postprocess_fn is not None:
                postprocess_fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool_id(pool) if pool is not None else None, stream=stream):
        outputs = forward_fn(*inputs)
    if postprocess_fn is not None:
        postprocess_fn(*inputs)
    return CapturedGraph(graph, outputs)


@functools.cache
def capture_stream(device: int) -> Any:
    """The one side stream every capture on ``device`` runs on.

    cuBLAS keeps a workspace per stream it ran on for the life of the process:
    a new stream per capture would leave one behind for every bucket of every
    engine ever built.

    :param device: the CUDA device index.
    :return: the stream.
    """
    return torch.cuda.Stream(device=device)


def pool_bytes(pool: GraphPool) -> int:
    """Bytes currently reserved by ``pool`` (0 when it cannot be measured)."""
    if pool is None or not torch.cuda.is_available():
        return 0
    if hasattr(pool, "snapshot"):
        try:
            return sum(seg["total_size"] for seg in pool.snapshot())
        except Exception:  # older torch: fall back to the device-wide figure
            pass
    return torch.cuda.memory_reserved()


def capture_buckets(
    buckets: Iterable[int],
    capture_one: Callable[[int], None],
    *,
    pool: GraphPool,
    label: str,
    failed: dict[int, str],
    grown: dict[int, int],
    progress: Progress = None,
) -> None:
    """Capture every bucket, largest first, keeping going past a failed one.

    A bucket whose capture raises is recorded in ``failed`` and runs eagerly;
    the others still replay, so one bad shape never disables graphs altogether.

    :param buckets: the bucket sizes to capture.
    :param capture_one: ``capture_one(bucket)`` captures that bucket.
    :param pool: the memory pool the captures allocate from (for ``grown``).
    :param label: names a bucket in warnings and progress, e.g. ``"decode batch"``.
    :param failed: filled with ``bucket -> error`` for each failed capture.
    :param grown: filled with ``bucket -> bytes`` the pool grew by capturing it.
    :param progress: an optional tqdm-like bar, advanced once per bucket.
    """
    for i, bucket in enumerate(sorted(buckets, reverse=True)):
        before = pool_bytes(pool)
        # the first bucket of a kind pays for tracing, compiling and lazy set-up: timed apart
        detail = f"capture {label} {bucket} (first)" if i == 0 else f"capture {label}s (rest)"
        with startup_detail(detail):
            try:
                capture_one(bucket)
            except Exception as exc:
                failed[bucket] = f"{type(exc).__name__}: {exc}"
                logger.warning(
                    "capture of %s %d failed, it will run eagerly: %s",
                    label,
                    bucket,
                    failed[bucket],
                )
        grown[bucket] = pool_bytes(pool) - before
        if progress is not None:
            progress.set_postfix_str(f"{label} {bucket}, pool {pool_bytes(pool) / 2**20:.1f} MiB")
            progress.update(1)
