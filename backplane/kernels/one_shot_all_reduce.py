"""A one-shot all-reduce over peer-mapped buffers: the small messages of tensor-parallel decode.

At batch 1 a row-parallel projection's output is one row of a few KiB, and
NCCL's ring kernel costs a fixed ~7-10 us for it, inside CUDA graphs too. Here
every rank's program copies its slice of the row into its own exchange buffer,
tells every peer so (a flag stored into the peer's memory), waits for the
peers' flags, and sums every rank's slice read straight from their buffers
(NVLink peer loads) in rank order, so that every rank gets the same bits. It is
one kernel and it needs no NVLink multicast. It launches in plain stream order
(so that every earlier all-reduce has finished: a programmatic dependent only
waits for the kernel just before it, which may itself have finished before the
previous all-reduce did), and lets the kernel after it start early.

Calls are told apart by an epoch per program (a counter in device memory that
the program itself advances), so a captured graph replays them without host
arguments; the buffers alternate between two halves by epoch, so a rank
writing call ``n + 1`` cannot overwrite what a slower peer still reads of call
``n``. Every rank must run the same sequence of all-reduces (as the ranks of a
tensor-parallel model do).

A peer that died never stores its flag, and nothing on the device would end
the wait. Every :data:`ABORT_SPINS` turns of its wait a program also reads an
abort word in pinned host memory; once the host sets it (a watchdog that saw
the peer's process end), every waiting program leaves its wait and the call
returns a sum that is not one, which the host then refuses to use. The word is
read so rarely that a wait that ends normally never reads it across the bus.

The buffers come from :class:`~backplane.engine.distributed.one_shot.OneShotAllReduce`,
which maps them into every rank's address space.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backplane.core.launch import KernelLauncher, cdiv, dependent_launch
from backplane.kernels.elementwise import INTERPRET, _round

__all__ = ["ABORT_SPINS", "BLOCK", "DTYPES", "MAX_PROGRAMS", "one_shot_all_reduce"]

#: elements of the message one program sums
BLOCK = 2048
#: programs of one call (each has its own flags and epoch): the largest message is
#: ``BLOCK * MAX_PROGRAMS`` elements
MAX_PROGRAMS = 64
#: dtypes the kernel sums
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: turns of a program's wait for a flag between two reads of the abort word (a power of two)
ABORT_SPINS = 1024


@triton.jit(do_not_specialize=["numel", "rank", "half_elems"])
def _one_shot_kernel(
    x_ptr,
    numel,
    buffers_ptr,
    flags_ptr,
    epochs_ptr,
    abort_ptr,
    rank,
    half_elems,
    WORLD: tl.constexpr,
    SPINS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    if PDL:
        # The next kernel's weight loads may start; it waits for this one's sums.
        tl.extra.cuda.gdc_launch_dependents()
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    # Only this program touches its epoch; volatile so that no stale cached copy
    # of the last call's value is read.
    epoch = tl.load(epochs_ptr + pid, volatile=True) + 1
    tl.store(epochs_ptr + pid, epoch)
    half = (epoch & 1).to(tl.int64) * half_elems
    own = tl.load(buffers_ptr + rank).to(tl.pointer_type(dt))
    tl.store(own + half + offs, x, mask=ok)
    # Every thread's slice is stored before any flag says so.
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        peer_flags = tl.load(flags_ptr + r).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(peer_flags + pid * WORLD + rank, epoch, sem="release", scope="sys")
    # the host's abort word (pinned memory), read every SPINS turns of a wait
    abort = tl.load(abort_ptr).to(tl.pointer_type(tl.int32))
    stop = tl.full([], 0, tl.int32)
    own_flags = tl.load(flags_ptr + rank).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        flag = own_flags + pid * WORLD + r
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        spins = tl.full([], 0, tl.int32)
        # Epochs only grow (a peer may already be one call ahead); the signed
        # difference stays right across the counter's wrap.
        while (seen - epoch < 0) & (stop == 0):
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            spins += 1
            if spins % SPINS == 0:
                stop = tl.load(abort, volatile=True)
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(WORLD):
        peer = tl.load(buffers_ptr + r).to(tl.pointer_type(dt))
        acc += tl.load(peer + half + offs, mask=ok, other=0.0, volatile=True).to(tl.float32)
    # rounded once (the interpreter's bfloat16 cast would truncate)
    tl.store(x_ptr + offs, _round(acc, dt, INTERPRET).to(dt), mask=ok)


_LAUNCHER = KernelLauncher(_one_shot_kernel)


def one_shot_all_reduce(
    x: torch.Tensor,
    buffers: torch.Tensor,
    flags: torch.Tensor,
    epochs: torch.Tensor,
    abort: torch.Tensor,
    rank: int,
    half_elems: int,
) -> None:
    """Sum ``x`` over the ranks in place, reading the peers' exchange buffers.

    :param x: this rank's contiguous partial result (one of :data:`DTYPES`), at
        most ``min(half_elems, BLOCK * MAX_PROGRAMS)`` elements; overwritten with
        the sum.
    :param buffers: int64 ``[world]``: every rank's exchange buffer address, as
        mapped in this process (two halves of ``half_elems`` elements of
        ``x``'s dtype each).
    :param flags: int64 ``[world]``: every rank's flag array address
        (int32 ``[MAX_PROGRAMS, world]``), as mapped here (``flags[rank]``: its own).
    :param epochs: int32 ``[MAX_PROGRAMS]`` of this rank, zero before the first call.
    :param abort: int64 ``[1]`` on the device: the address of an int32 word the
        kernel can read (pinned host memory on CUDA), zero while the ranks run; a
        call waiting for a peer when it turns non-zero returns without the sum.
    :param rank: this rank.
    :param half_elems: the elements of ``x``'s dtype in one half of a buffer.
    :raises ValueError: ``x`` is too large for the buffers or not contiguous.

    Every rank must make the same calls in the same order, on one stream.
    """
    numel = x.numel()
    if numel > min(half_elems, BLOCK * MAX_PROGRAMS) or not x.is_contiguous():
        raise ValueError(
            f"one_shot_all_reduce takes a contiguous tensor of at most "
            f"{min(half_elems, BLOCK * MAX_PROGRAMS)} elements, got {tuple(x.shape)}"
        )
    if numel == 0:
        return
    world = buffers.numel()
    device = x.device.index
    pdl = dependent_launch(device)
    # the integers are not specialised on: the key is the dtype (and the tensors' alignment)
    _LAUNCHER(
        (x.dtype, x.data_ptr() % 16 == 0, world, pdl),
        (cdiv(numel, BLOCK),),
        (x, numel, buffers, flags, epochs, abort, rank, half_elems),
        device,
        WORLD=world,
        SPINS=ABORT_SPINS,
        BLOCK=BLOCK,
        PDL=pdl,
        INTERPRET=INTERPRET,
        num_warps=4,
    )
