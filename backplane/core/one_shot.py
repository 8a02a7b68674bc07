"""A one-shot all-reduce over peer memory, for the small messages of tensor-parallel decode.

At batch 1 a row-parallel projection's all-reduce moves a few KiB, and NCCL's
ring kernel costs a fixed ~10 us for it whatever the size (measured on four
H200s: a quarter of a TP=4 decode step). A one-shot all-reduce has every rank
copy its partial sums into a buffer the other ranks can read (symmetric
memory, mapped into every rank's address space over NVLink), wait at one
barrier, and sum all ranks' buffers itself: one kernel, no ring.

It runs on ``torch.distributed._symmetric_memory`` (PyTorch's
``one_shot_all_reduce``, which needs peer access but no NVLink multicast) and
is opt-in: set ``BACKPLANE_TP_ALL_REDUCE=one_shot`` in the environment of the
engine (its worker processes inherit it). Messages larger than the buffer, or
of a dtype it does not take, go through NCCL as before.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["ENV", "OneShotAllReduce", "one_shot_requested"]

#: the environment variable that turns the one-shot all-reduce on (value ``one_shot``)
ENV = "BACKPLANE_TP_ALL_REDUCE"
#: the largest message, bytes: 64 rows of a 4096-wide bfloat16 hidden state
MAX_BYTES = 512 * 1024
#: the dtypes PyTorch's one-shot kernel sums
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def one_shot_requested() -> bool:
    """Whether the environment asks for the one-shot all-reduce.

    :return: True when :data:`ENV` is ``one_shot``.
    :raises ValueError: for any other value than ``one_shot``, ``nccl`` or none.
    """
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "nccl"):
        return False
    if value == "one_shot":
        return True
    raise ValueError(f"{ENV}={value!r} is not known; use one_shot or nccl (the default)")


class OneShotAllReduce:
    """One rank's symmetric buffer and the one-shot all-reduce that reads its peers' copies.

    Built by every rank of the group at once (the rendezvous is collective).

    :param group: the ``torch.distributed`` process group (NCCL, on CUDA devices).
    :param device: this rank's CUDA device.
    :param max_bytes: the buffer's size, the largest message it takes.
    """

    def __init__(self, group: Any, device: torch.device, max_bytes: int = MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes = int(max_bytes)
        self.group_name: str = group.group_name
        self.buffer = symm_mem.empty(self.max_bytes, dtype=torch.uint8, device=device)
        # keeps the peers' mappings alive as long as the buffer
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can go through the one-shot path.

        :param x: the tensor to sum.
        :return: True for a contiguous CUDA tensor of a summable dtype that fits the buffer.
        """
        return (
            x.is_cuda
            and x.dtype in DTYPES
            and x.is_contiguous()
            and x.numel() * x.element_size() <= self.max_bytes
        )

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place.

        :param x: this rank's partial result (:meth:`fits` must hold); overwritten with the sum.
        """
        flat = x.view(-1)
        buf = self.buffer.view(x.dtype)[: flat.numel()]
        buf.copy_(flat)
        # The kernel waits at a barrier for every rank's copy before reading, and
        # at another before returning, so the next call's copy cannot overwrite a
        # buffer a peer is still reading.
        torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", self.group_name, out=flat)
