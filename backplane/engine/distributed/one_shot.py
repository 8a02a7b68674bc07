"""The one-shot all-reduce's buffers, mapped into every rank of a CUDA tensor-parallel group.

Each rank allocates an exchange buffer with a flag array in front and shares it
with its peers through a CUDA IPC handle (:mod:`.cuda_ipc`; once, at start-up,
over the group); every rank then holds the addresses of all of them and
:func:`~backplane.kernels.one_shot_all_reduce.one_shot_all_reduce` sums a
small message in one kernel of peer loads. Messages larger than the buffers,
and every message on a group whose GPUs cannot reach each other directly, go
through NCCL as before: :func:`setup_one_shot` decides that for all ranks at
once, so that they never take different paths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from backplane.core.parallel import set_small_all_reduce

__all__ = ["OneShotAllReduce", "run_in_stages", "setup_one_shot"]

logger = logging.getLogger(__name__)


class OneShotAllReduce:
    """The exchange buffers of one rank, and every peer's as mapped into this process.

    Built in three steps, each of which every rank of the group takes together
    (see :func:`setup_one_shot`): the constructor allocates this rank's buffer
    (local), :meth:`connect` maps every rank's buffer into every rank
    (collective) and :meth:`check` sums one row of each dtype (collective: the
    kernel waits for every peer). :meth:`close` gives the buffers back.

    :param rank: this rank.
    :param size: the number of ranks.
    :param device: this rank's GPU.
    """

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        from backplane.engine.distributed.cuda_ipc import SharedBuffer
        from backplane.kernels.one_shot_all_reduce import (
            BLOCK,
            DTYPES,
            MAX_PROGRAMS,
            one_shot_all_reduce,
        )

        # held here: the all-reduce path imports nothing per call
        self._kernel, self._dtypes = one_shot_all_reduce, DTYPES
        self.rank, self.size, self.device = rank, size, device
        self._programs = MAX_PROGRAMS
        # two halves, each as large as the largest float32 message, after the flags
        self.max_elems = BLOCK * MAX_PROGRAMS
        self._half_bytes = self.max_elems * 4
        self._flag_bytes = -(-MAX_PROGRAMS * size * 4 // 256) * 256
        # shared with the peers' processes through a CUDA IPC handle, zeroed
        self._buffer = SharedBuffer(device, self._flag_bytes + 2 * self._half_bytes)
        # the kernel's abort word, in pinned host memory so that the host can set it
        # while the device is busy in a wait (see abort()); its device-side address
        self._abort = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        # the host's own record of it, read after every step without touching the tensor
        self._aborted = False
        self._abort_ptr = torch.tensor([self._abort.data_ptr()], dtype=torch.int64, device=device)

    def connect(self, group: Any) -> None:
        """Map every rank's buffer into this one (collective over ``group``).

        :param group: the NCCL process group of the tensor-parallel ranks.
        """
        handles: list[Any] = [None] * self.size
        dist.all_gather_object(handles, self._buffer.handle(), group=group)
        bases = [
            self._buffer.ptr if r == self.rank else self._buffer.open(h)
            for r, h in enumerate(handles)
        ]
        device = self.device
        self._epochs = torch.zeros(self._programs, dtype=torch.int32, device=device)
        self._buffers = torch.tensor(
            [b + self._flag_bytes for b in bases], dtype=torch.int64, device=device
        )
        self._flag_ptrs = torch.tensor(bases, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        # no rank's first flag may land before every rank has mapped its peers
        dist.barrier(group=group)

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (the group is being left; no call
        may run after this)."""
        self._buffer.close()

    def check(self) -> None:
        """Sum a row of every dtype once, on every rank together: the kernels are compiled
        and loaded now rather than in the middle of a forward, and a wrong sum is caught.

        :raises RuntimeError: a sum came out wrong on this rank.
        """
        want = self.size * (self.size + 1) // 2
        for dtype in self._dtypes:
            x = torch.full((1000,), self.rank + 1, dtype=dtype, device=self.device)
            self(x)
            if not bool((x == want).all()):
                raise RuntimeError(f"the one-shot all-reduce summed {dtype} rows wrongly")
        torch.cuda.synchronize(self.device)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the one-shot kernel (small, contiguous, 16-byte aligned).

        Depends only on ``x``'s shape, dtype, device and offset into its
        allocation (allocations are aligned alike), so every rank answers alike.

        :param x: a message.
        :return: whether :meth:`__call__` takes it.
        """
        return (
            x.is_cuda
            and x.dtype in self._dtypes
            and x.is_contiguous()
            and x.data_ptr() % 16 == 0
            # a half holds max_elems float32 values, so any dtype's message of that many
            and 0 < x.numel() <= self.max_elems
        )

    def __call__(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks in place (``x`` as :meth:`fits` takes).

        :param x: this rank's partial result; overwritten with the sum.
        """
        self._kernel(
            x,
            self._buffers,
            self._flag_ptrs,
            self._epochs,
            self._abort_ptr,
            self.rank,
            self._half_bytes // x.element_size(),
        )

    def abort(self) -> None:
        """Make every call of this rank waiting for a peer return now, and every later
        call return at its first wait, without the sum (from any thread).

        For a peer that died: the engine ends, and no result computed since
        may be used (see :attr:`aborted`).
        """
        self._aborted = True
        self._abort.fill_(1)

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called: sums since then are not to be trusted."""
        return self._aborted


def run_in_stages(
    group: Any, rank: int, size: int, stages: Sequence[tuple[str, Callable[[], str | None]]]
) -> str | None:
    """Run a set-up's stages on every rank of ``group``, each only where all finished the last.

    Collective. After each stage the ranks tell one another whether theirs
    went well, so that a rank that failed never leaves the others inside the
    next stage's collective (a rendezvous, a kernel that waits for its peers).

    :param group: the process group.
    :param rank: this rank.
    :param size: the number of ranks.
    :param stages: ``(name, run)`` pairs; ``run`` returns why the set-up cannot go
        on here (or ``None``) or raises.
    :return: ``None`` when every stage went well on every rank, else the first
        failure as ``"rank R, NAME: why"`` (the same text on every rank).
    """
    for name, run in stages:
        try:
            why = run() or ""
        except Exception as exc:  # whatever a stage meets, the group must hear of it
            logger.debug("rank %d: %s failed", rank, name, exc_info=True)
            why = f"{type(exc).__name__}: {exc}"
        reasons: list[Any] = [None] * size
        dist.all_gather_object(reasons, why, group=group)
        failed = next((f"rank {r}, {name}: {w}" for r, w in enumerate(reasons) if w), None)
        if failed is not None:
            return failed
    return None


def setup_one_shot(group: Any, rank: int, size: int, device: torch.device) -> bool:
    """Build the one-shot all-reduce on every rank, or on none.

    Collective. Each rank checks that its GPU reaches every peer's directly
    and that Triton is there, allocates its buffer, maps its peers' and sums a
    row of each dtype, all ranks a stage at a time (:func:`run_in_stages`);
    only when all of them succeed does the tensor-parallel all-reduce use it
    for small messages (:func:`~backplane.core.parallel.set_small_all_reduce`).

    :param group: the NCCL process group.
    :param rank: this rank.
    :param size: the number of ranks.
    :param device: this rank's GPU.
    :return: whether the one-shot path is on.
    """
    places: list[Any] = [None] * size
    dist.all_gather_object(places, device.index, group=group)
    peers = [p for r, p in enumerate(places) if r != rank]
    built: list[OneShotAllReduce] = []

    def devices() -> str | None:
        if device.index in peers:
            return "the ranks' GPUs are not told apart in this process (one visible GPU each)"
        if not all(torch.cuda.can_device_access_peer(device.index, p) for p in peers):
            return "this GPU cannot access its peers' memory directly"
        import triton  # noqa: F401

        from backplane.engine.distributed.cuda_ipc import cudart

        cudart()
        return None

    def allocate() -> None:
        built.append(OneShotAllReduce(rank, size, device))

    failed = run_in_stages(
        group,
        rank,
        size,
        [
            ("devices", devices),
            ("allocation", allocate),
            ("mapping", lambda: built[0].connect(group)),
            ("check", lambda: built[0].check()),
        ],
    )
    if failed is not None:
        if rank == 0:
            logger.warning("custom_all_reduce: small all-reduces stay on NCCL (%s)", failed)
        set_small_all_reduce(None)
        if built:
            try:
                built[0].close()
            except Exception:  # the set-up already failed; this is only tidying up
                logger.debug("rank %d: freeing the one-shot buffers failed", rank, exc_info=True)
        return False
    set_small_all_reduce(built[0])
    logger.debug("rank %d: small all-reduces run the one-shot kernel", rank)
    return True
