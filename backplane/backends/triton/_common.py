"""Helpers shared by the Triton backends (imported only when a Triton backend is selected)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import numpy as np
import torch

# The backends import it from here too.
from backplane.core.launch import next_pow2

_F32_ENV = "TRITON_F32_DEFAULT"

#: Largest number of key/value splits the split-KV decode uses per sequence.
MAX_KV_SPLITS = 64


def dot_block(n: int) -> int:
    """Round a dimension up to a block size ``tl.dot`` accepts (a power of two, at least 16)."""
    return max(16, next_pow2(n))


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def num_sms(device_index: int) -> int:
    """Return the number of streaming multiprocessors of a CUDA device (cached per device)."""
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def device_parallelism(device: torch.device) -> int:
    """Return how many programs keep the device busy: ``2 x SMs`` on CUDA, a small constant otherwise.

    The CPU interpreter gets a small value so that tests still exercise several
    key/value splits without running for long.
    """
    if device.type == "cuda":
        return 2 * num_sms(
            device.index if device.index is not None else torch.cuda.current_device()
        )
    return 8


def sequence_blocks(lens: np.ndarray, block: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The ``(sequence, block within it)`` pairs that cover ragged sequences in blocks of tokens.

    A kernel over the rows of this table runs one program per real block, however
    uneven the lengths (a grid of ``sequences x blocks of the longest`` would start
    mostly empty programs). The table is built from host lengths and, on CUDA,
    copied from pinned memory without blocking, so building it never waits for the
    device (a device ``repeat_interleave`` or a copy from pageable memory would).

    :param lens: host lengths of the sequences (each at least 1).
    :param block: tokens per block.
    :param device: where the table goes.
    :return: ``(table, source)``: the ``[num_blocks, 2]`` int64 table on ``device``
        and its host source, which must stay alive until the copy is done.
    """
    lens = np.asarray(lens, dtype=np.int64)
    counts = -(-lens // block)
    seq_ids = np.repeat(np.arange(len(lens), dtype=np.int64), counts)
    firsts = np.repeat(np.cumsum(counts) - counts, counts)
    source = torch.from_numpy(
        np.stack([seq_ids, np.arange(len(seq_ids), dtype=np.int64) - firsts], 1)
    )
    if device.type == "cuda":
        source = source.pin_memory()
    return source.to(device, non_blocking=True), source


def ieee_dot(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` must use exact float32 products (no TF32) for inputs of ``dtype``."""
    return dtype == torch.float32


@contextlib.contextmanager
def exact_fp32_dots(dtype: torch.dtype) -> Iterator[None]:
    """Make ``tl.dot`` on float32 operands exact (no TF32) for library kernels run inside.

    mamba-ssm's and fla's kernels call ``tl.dot`` without an input precision, so
    on a GPU their float32 products default to TF32 (about 1e-3 relative error),
    far from float32 accuracy. Inside this context, for float32 activations,
    ``TRITON_F32_DEFAULT=ieee`` is set while they compile. Kernels of a float32
    model are separate specialisations (their pointer dtypes differ) from those
    of a 16-bit model, so this never changes the 16-bit kernels.

    :param dtype: the activation dtype; nothing is changed unless it is float32.
    """
    if dtype != torch.float32:
        yield
        return
    previous = os.environ.get(_F32_ENV)
    os.environ[_F32_ENV] = "ieee"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_F32_ENV, None)
        else:
            os.environ[_F32_ENV] = previous
