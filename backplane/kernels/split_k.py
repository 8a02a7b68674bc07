"""Scratch memory of the split-K kernels: arrival counters and partial sums, one set per device.

A split-K launch has each of its programs store a partial sum; the program that
arrives last at its row block (an int32 counter per block) adds them in split
order and resets the counter to zero. So the counters need zeroing once, when
allocated, and every launch leaves them as it found them; one set serves every
launch of every split-K kernel (:mod:`.gemv`, :mod:`.qgemv`) on a device, since
launches on one stream run one after the other.
"""

from __future__ import annotations

import torch

from backplane.core.launch import next_pow2

__all__ = ["SCRATCH", "scratch"]

#: per device: the split-K arrival counters and partial sums (see :func:`scratch`)
SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
#: outgrown scratch buffers, never freed (captured graphs may still use them)
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []


def scratch(device: torch.device, blocks: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K scratch on ``device``: zeroed int32 arrival counters for ``blocks`` row
    blocks (each launch leaves them zero) and ``parts`` float32 partial sums.

    Shared by every launch: launches on one stream run one after the other,
    and each is done with both before it ends. Outgrown buffers are kept: a
    captured graph replays into the ones it was captured with.

    :param device: where the kernel runs.
    :param blocks: row blocks of the launch (counters needed).
    :param parts: partial sums of the launch (``split_k * rows``).
    :return: ``(counters, partial sums)``, at least that large.
    """
    bufs = SCRATCH.get(device)
    if bufs is None or bufs[0].numel() < blocks or bufs[1].numel() < parts:
        if bufs is not None:
            _RETIRED.append(bufs)
        counters = (
            bufs[0]
            if bufs is not None and bufs[0].numel() >= blocks
            else torch.zeros(max(next_pow2(blocks), 1024), dtype=torch.int32, device=device)
        )
        part = (
            bufs[1]
            if bufs is not None and bufs[1].numel() >= parts
            else torch.empty(max(next_pow2(parts), 1 << 16), dtype=torch.float32, device=device)
        )
        bufs = SCRATCH[device] = (counters, part)
    return bufs
