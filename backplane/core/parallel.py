"""The tensor-parallel group a model is built for, and its collectives.

A model shards its layers over the ranks of one tensor-parallel group: each
rank holds a slice of every projection's rows or columns and the collectives
here (all-reduce after a row-parallel projection, all-gather of a
vocabulary-parallel LM head) put the slices back together. Layers read the
group of the process with :func:`tensor_parallel` when they are built; with one
rank (the default, and what every single-device engine has) each collective
returns its input and no ``torch.distributed`` call is made.

The group is set once per worker process, before the model is built, with
:func:`set_tensor_parallel` (the engine's worker does it after
``torch.distributed.init_process_group``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from backplane.core.errors import ConfigError

__all__ = [
    "abort_small_all_reduce",
    "TensorParallel",
    "UnevenSplitError",
    "SmallAllReduce",
    "divide",
    "set_small_all_reduce",
    "small_all_reduce_aborted",
    "set_tensor_parallel",
    "shard_range",
    "tensor_parallel",
    "unsplit",
]


class UnevenSplitError(ConfigError, ValueError):
    """A model dimension (heads, channels, vocabulary) cannot be split over the tensor-parallel ranks.

    A configuration error (the ``tensor_parallel_size`` does not fit the
    model), and a ``ValueError`` for callers that catch that.
    """


def divide(total: int, parts: int, what: str = "size") -> int:
    """``total // parts``, refusing a remainder.

    :param total: the size to split (heads, channels, rows).
    :param parts: the number of ranks.
    :param what: what ``total`` counts, for the error message.
    :return: each rank's share.
    :raises UnevenSplitError: ``total`` is not a multiple of ``parts``.
    """
    if parts <= 0 or total % parts:
        raise UnevenSplitError(
            f"{what} {total} cannot be split evenly over {parts} tensor-parallel ranks; "
            f"choose a tensor_parallel_size that divides {total}"
        )
    return total // parts


def shard_range(total: int, rank: int, parts: int, what: str = "size") -> tuple[int, int]:
    """The ``[start, end)`` slice of ``total`` that ``rank`` of ``parts`` holds (even split).

    :param total: the size to split.
    :param rank: this rank.
    :param parts: the number of ranks.
    :param what: what ``total`` counts, for the error message.
    :return: ``(start, end)``.
    """
    share = divide(total, parts, what)
    return rank * share, (rank + 1) * share


@dataclass(frozen=True)
class TensorParallel:
    """One process's place in its tensor-parallel group.

    :param rank: this process's rank in the group (0 is the driver).
    :param size: the number of ranks.
    :param group: the ``torch.distributed`` process group, ``None`` with one rank.
    """

    rank: int = 0
    size: int = 1
    group: Any = None

    @property
    def enabled(self) -> bool:
        """Whether the model is split over more than one rank."""
        return self.size > 1

    def shard(self, total: int, what: str = "size") -> tuple[int, int]:
        """This rank's ``[start, end)`` slice of ``total`` (see :func:`shard_range`)."""
        return shard_range(total, self.rank, self.size, what)

    def share(self, total: int, what: str = "size") -> int:
        """This rank's share of ``total`` (see :func:`divide`)."""
        return divide(total, self.size, what)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (the partial outputs of a row-parallel product).

        :param x: this rank's partial result; overwritten with the sum.
        :return: ``x``.
        """
        if self.size > 1:
            torch.ops.backplane.tp_all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, in rank order.

        :param x: this rank's slice (same shape on every rank).
        :param dim: the dimension the slices are joined along.
        :return: the joined tensor (``x`` itself with one rank).
        """
        if self.size == 1:
            return x
        return torch.ops.backplane.tp_all_gather(x.contiguous(), dim % x.dim())


#: the single-tensor all-gather: ``all_gather_single`` where torch has it (newer
#: releases deprecate ``all_gather_into_tensor``), else ``all_gather_into_tensor``
_gather_single = getattr(
    torch.distributed,
    "all_gather_single",
    getattr(torch.distributed, "all_gather_into_tensor", None),
)

_current = TensorParallel()


class SmallAllReduce(Protocol):
    """An all-reduce faster than the group's own for the messages it takes.

    Every rank of the group must hold one (or none), and :meth:`fits` must
    answer alike on every rank for the same message, so that the ranks never
    take different paths.
    """

    def fits(self, x: torch.Tensor) -> bool:
        """Whether this all-reduce takes ``x``; otherwise the group's collective sums it."""
        ...

    def __call__(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks in place."""
        ...

    def abort(self) -> None:
        """Stop waiting for peers, from any thread: a peer died and the engine ends.

        Calls waiting now, and every later call, return without the sum.
        """
        ...

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called (results computed since are not sums)."""
        ...

    def close(self) -> None:
        """Give back what it holds (the group is being left; no call follows)."""
        ...


_small: SmallAllReduce | None = None


def set_small_all_reduce(small: SmallAllReduce | None) -> SmallAllReduce | None:
    """Route the all-reduces that ``small`` takes through it (``None``: all through the group).

    Set by the engine's worker once the group is joined, before any model
    runs; read inside the all-reduce op, so layers built before it use it too.

    :param small: the all-reduce for small messages, or ``None``.
    :return: the one it replaces (for the caller to close), or ``None``.
    """
    global _small
    previous, _small = _small, small
    return previous


def abort_small_all_reduce() -> bool:
    """Abort this process's small all-reduce (see :meth:`SmallAllReduce.abort`), if it has one.

    :return: whether there was one to abort.
    """
    small = _small
    if small is None:
        return False
    small.abort()
    return True


def small_all_reduce_aborted() -> bool:
    """Whether this process's small all-reduce was aborted (its sums since are not to be used)."""
    small = _small
    return small is not None and small.aborted


def tensor_parallel() -> TensorParallel:
    """The tensor-parallel group of this process (one rank unless a worker set it)."""
    return _current


def set_tensor_parallel(tp: TensorParallel) -> TensorParallel:
    """Make ``tp`` this process's group; return the one it replaces.

    :param tp: the group layers built from now on shard over.
    :return: the previous group (for restoring it).
    """
    global _current
    previous, _current = _current, tp
    return previous


@contextlib.contextmanager
def unsplit() -> Iterator[TensorParallel]:
    """Build (and run) a model whole in this block, even in a process of a split one.

    Layers take the group current when they are built, so a model built here
    holds its full weights and never calls a collective: a draft model the
    driver runs alone next to a tensor-parallel target.

    :return: the single-rank group in force inside the block.
    """
    one = TensorParallel()
    previous = set_tensor_parallel(one)
    try:
        yield one
    finally:
        set_tensor_parallel(previous)


# The collectives are custom ops so that torch.compile keeps each one as a single
# opaque call inside a piecewise graph (dynamo does not trace into
# torch.distributed) and CUDA graphs capture it like any kernel (NCCL calls are
# capturable). They act on the group set with set_tensor_parallel.


@torch.library.custom_op("backplane::tp_all_reduce", mutates_args=("x",))
def _tp_all_reduce(x: torch.Tensor) -> None:
    """Sum ``x`` over the ranks of this process's tensor-parallel group, in place."""
    small = _small
    if small is not None and small.fits(x):
        small(x)
        return
    torch.distributed.all_reduce(x, group=_current.group)


@torch.library.custom_op("backplane::tp_all_gather", mutates_args=())
def _tp_all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's contiguous ``x`` joined along ``dim``, in rank order."""
    tp = _current
    if torch.distributed.get_backend(tp.group) == "gloo":
        # gloo's single-tensor gather is missing from older torch releases and
        # refuses stacked outputs; its list gather works on every release.
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        torch.distributed.all_gather(parts, x, group=tp.group)
        return torch.cat(parts, dim=dim)
    # Gathered as flat rank-major slices: the one layout every backend's
    # single-tensor gather accepts.
    out = torch.empty(tp.size * x.numel(), dtype=x.dtype, device=x.device)
    _gather_single(out, x.view(-1), group=tp.group)
    return torch.cat(out.view(tp.size, *x.shape).unbind(0), dim=dim)


@_tp_all_gather.register_fake
def _(x: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= _current.size
    return x.new_empty(shape)
