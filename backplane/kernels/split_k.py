"""Scratch memory of the split-K kernels: arrival counters and partial sums, one set per device.

A split-K launch has each of its programs store a partial sum; the program that
arrives last at its row block (an int32 counter per block) adds them in split
order and resets the counter to zero. So the counters need zeroing once, when
allocated, and every launch leaves them as it found them; one set serves every
launch of every split-K kernel (:mod:`.gemv`, :mod:`.qgemv`, :mod:`.qgemv_packed`,
:mod:`.qgemv_packed_q6k`) on a device, since launches on one stream run one
after the other.

That last program's reads are on the kernel's critical path: every other
program is done by then. :func:`sum_parts` issues a row block's loads of its
partials together (the loop over splits unrolled to the split count rounded up
to a power of two at compile time) instead of one after another; the packed
Q4_K kernel, whose programs each finish a run of many row blocks, takes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backplane.core.launch import next_pow2

__all__ = ["SCRATCH", "scratch", "sum_parts"]

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
        with torch.inference_mode(False):
            # Normal tensors, not inference ones: the buffers outlive the engine's
            # inference mode and serve callers outside it (kernel tests poison them).
            return _grow(device, bufs, blocks, parts)
    return bufs


def _grow(
    device: torch.device, bufs: tuple[torch.Tensor, torch.Tensor] | None, blocks: int, parts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`scratch`'s buffers grown to ``blocks`` counters and ``parts`` partial sums."""
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


@triton.jit
def sum_parts(part_ptr, rows, rows_ok, split_k, row_stride, split_stride, SPLITS: tl.constexpr):
    """The sums over splits of the partials of ``rows``, their loads issued together.

    :param part_ptr: the float32 partial sums, the one of row ``r`` and split ``s``
        at ``r * row_stride + s * split_stride``.
    :param rows: the row indices ``[BLOCK]``.
    :param rows_ok: which of them exist ``[BLOCK]``.
    :param split_k: the launch's split count.
    :param row_stride: elements from one row's partial to the next row's.
    :param split_stride: elements from one split's partial to the next split's.
    :param SPLITS: ``split_k`` rounded up to a power of two: the loop is unrolled, so
        the loads do not wait for each other.
    :return: float32 ``[BLOCK]``, each row's partials added in split order
        (deterministic). Loads bypass L1 (``.cg``): other multiprocessors wrote the
        partials.
    """
    total = tl.load(part_ptr + rows * row_stride, mask=rows_ok, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLITS):
        total += tl.load(
            part_ptr + rows * row_stride + s * split_stride,
            mask=rows_ok & (rows * 0 + s < split_k),
            other=0.0,
            cache_modifier=".cg",
        )
    return total
