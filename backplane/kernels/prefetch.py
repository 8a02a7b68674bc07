"""Pull a weight into the GPU's L2 cache ahead of the projection that reads it.

At batch 1 a decode step is bound by the bytes of its weights, but not every
kernel of it reads them: between an attention layer's q/k/v projection and its
output projection the attention kernel walks the KV pages, a latency-bound
chain of small loads that leaves the memory bus mostly idle for several
microseconds (about 10 us per layer at the Llama-3.1-8B shape, 512 keys). The
same holds for a Mamba2 mixer's convolution, scan and gated norm before its
output projection. :func:`prefetch_l2` issues ``prefetch.global.L2`` for the
first bytes of the next projection's weight (up to a share of the L2) from a
kernel of its own, launched before that gap: the bus streams the weight while
the gap runs, and the projection then reads most of it from L2.

A prefetch is a hint: it changes no value, so it is correct whatever runs
beside it. As a programmatic dependent launch (see
:func:`~backplane.core.launch.dependent_launch`) the kernel starts during the
kernel before it, lets the next one start at once, and waits for the one
before it only at its end, so that the kernels after it still wait, through
it, for everything launched before it.

In the Triton interpreter the kernel issues no hint (the interpreter runs no
PTX) but walks the same lines, so the launch path is tested on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backplane.core.launch import KernelLauncher, cdiv, dependent_launch, int_key
from backplane.kernels.availability import interpreting

#: bytes per L2 cache line
LINE = 128

#: cache lines each program hints per loop step (8 per thread at 4 warps)
LINES_PER_STEP = 1024

#: share of the L2 a weight may take: the rest keeps the step's activations and
#: KV pages, which are read while the weight streams in
L2_SHARE = 0.6


@triton.jit
def _prefetch_kernel(
    ptr,
    n_lines,
    LINE_BYTES: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Hint lines ``0 .. n_lines - 1`` of the bytes at ``ptr``, the programs taking turns."""
    if PDL:
        # The next kernel may start now: nothing it reads comes from here.
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n_lines, step):
        # Clamped, not masked: a line hinted twice costs nothing.
        line = tl.minimum(start + tl.arange(0, BLOCK), n_lines - 1)
        addr = ptr + line.to(tl.int64) * LINE_BYTES
        if not INTERPRET:
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
                "=r,l",
                [addr],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
    if PDL:
        # Completing only after the kernel before it keeps the stream's order for
        # the kernels after this one, which wait on this kernel alone.
        tl.extra.cuda.gdc_wait()


_LAUNCHER = KernelLauncher(_prefetch_kernel)


def prefetch_bytes(weight: torch.Tensor) -> int:
    """How many leading bytes of ``weight`` :func:`prefetch_l2` hints on its device.

    :param weight: a contiguous CUDA tensor (in the interpreter, a CPU one).
    :return: the tensor's bytes, at most :data:`L2_SHARE` of the device's L2
        (a 4 MiB L2 stands in for the interpreter's).
    """
    l2 = (
        4 << 20
        if not weight.is_cuda
        else torch.cuda.get_device_properties(weight.device).L2_cache_size
    )
    return min(weight.numel() * weight.element_size(), int(L2_SHARE * l2))


def prefetch_l2(weight: torch.Tensor) -> None:
    """Start pulling the leading bytes of ``weight`` into L2; returns at once.

    :param weight: a contiguous tensor on a CUDA device (a CPU tensor in the
        interpreter), e.g. a projection's weight read a few kernels later.
    :raises ValueError: for a tensor that is not contiguous.
    """
    if not weight.is_contiguous():
        raise ValueError("prefetch_l2 hints a contiguous tensor's bytes")
    n_lines = cdiv(prefetch_bytes(weight), LINE)
    if n_lines == 0:
        return
    raw = weight.reshape(-1).view(torch.uint8)
    interpret = interpreting()
    if interpret:
        device, programs, pdl = 0, min(cdiv(n_lines, LINES_PER_STEP), 4), False
    else:
        device = weight.device.index
        sms = torch.cuda.get_device_properties(weight.device).multi_processor_count
        programs = min(cdiv(n_lines, LINES_PER_STEP), sms)
        pdl = dependent_launch(device)
    meta = dict(LINE_BYTES=LINE, BLOCK=LINES_PER_STEP, PDL=pdl, INTERPRET=interpret)
    if pdl:
        meta["launch_pdl"] = True
    key = (pdl, int_key(n_lines), raw.data_ptr() & 15 == 0)
    _LAUNCHER(key, (programs,), (raw, n_lines), device, **meta)
