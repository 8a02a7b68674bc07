"""A split-K matrix-vector product for one-row projections (batch-1 decode).

At one input row a projection reads its whole weight to produce one output row,
so its time is the weight's bytes over the memory bandwidth, if enough loads
are in flight. cuBLAS reaches that for wide projections (many output rows), but
not for tall ones (few output rows, a long reduction: a down projection, a
Mamba2 out projection) nor for small ones: those run split-K with a second
reduce kernel, at 45-60% of the read bandwidth on an H200
(``benchmarks/gemv.py``).

:func:`gemv` splits the reduction dimension ``K`` into ``split_k`` parts and the
output rows into blocks of ``block_n``; each program streams its
``[block_n, K / split_k]`` slice of the weight in ``block_k`` chunks,
accumulating in float32, and stores its partial sums. The program that
finishes a row block last (an arrival counter per block, reset by that program,
so the kernel needs no zeroed buffer and replays in a CUDA graph) adds the
partials in split order, adds the bias, and writes the row in the input's
dtype. One launch, deterministic results.

Neighbouring elementwise work rides along, each piece saving a launch (and
the gap before the next kernel) per layer at batch 1:

* an activation epilogue (``act=``): a non-gated MLP's ReLU² applied to the up
  projection's output before it is stored;
* an RMS-norm prologue (:func:`norm_gemv`): a pre-norm layer's residual add and
  RMS norm computed while the first projection reads its input, so the
  normalised row is never stored;
* a gated-activation prologue (``gemv(gate_act=...)``): a gated MLP's
  ``act(gate) * up`` formed while the down projection reads its input;
* a rotary epilogue (``norm_gemv(rotary=...)``): the query and key heads of
  an attention layer's q/k/v projection rotated before they are stored. Each
  program of the rotated rows computes whole pairs ``(i, i + h)`` (its rows
  in pair order), so the rotation needs no other program's outputs;
* a gated epilogue (``glu=``): a gated MLP's gate/up projection stores
  ``act(gate) * up``, each program computing gate rows ``i`` and up rows
  ``i + I`` together (paired as the rotary rows are). The down projection then
  reads a plain row of half the width: forming the product in its prologue
  instead costs every one of its programs the activation of its whole input
  chunk (the Llama-3.1-8B down projection took 33.5 us so against 28.8 for
  the plain product, ``benchmarks/gemv.py --fused``).

On Hopper and newer, launches are programmatic dependents of the kernel
before them (:func:`~backplane.core.launch.dependent_launch`): a program
loads its first two weight tiles, then waits for the previous kernel to
finish, so the weight stream starts during that kernel's tail instead of
after it.

FP8 (e4m3) weights are read one byte per element and dequantised as they are
read (weight-only: the row stays in its 16- or 32-bit dtype, the sums in
float32), with one scale per tensor or output row applied to each row's sum,
or one per block of rows and columns (see :func:`weight_scale_layout`)
applied to each chunk, whose columns lie within one block or hold whole
ones, scaled per column group (:func:`chunk_fits_blocks`, :func:`plan_fp8`).
A compile-time switch keeps the unscaled path's code as it was.

:class:`OneRowProjection` holds one projection's launch with all of that
decided, for the call sites that run it every step.

All round as the separate kernels of :mod:`.elementwise` do.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from backplane.core.launch import KernelLauncher, cdiv, dependent_launch, next_pow2
from backplane.kernels.availability import interpreting
from backplane.kernels.elementwise import (
    _EXACT_MATH,
    ACT_CODES,
    INTERPRET,
    MAX_ROW,
    _act,
    _inv_rms,
    _round,
)
from backplane.kernels.split_k import scratch as _scratch

#: dtypes the kernel reads and writes
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: the scaled weight dtype: read one byte per element, dequantised in the kernel
FP8_WEIGHT = torch.float8_e4m3fn


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    r_ptr,
    g_ptr,
    r_out_ptr,
    cos_ptr,
    sin_ptr,
    s_ptr,
    eps,
    N,
    K,
    k_per_split,
    split_k,
    stride_wn,
    stride_sn,
    rot_rows,
    rot_half,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,
    GATE_ACT: tl.constexpr,
    NORM: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROPE: tl.constexpr,
    GLU: tl.constexpr,
    PAIRED: tl.constexpr,
    INTERPRET: tl.constexpr,
    EXACT: tl.constexpr,
    PDL: tl.constexpr,
    SCALE: tl.constexpr,
    SCALE_K: tl.constexpr,
    SCALE_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dt = x_ptr.dtype.element_ty
    if PDL > 0 and not INTERPRET:
        # The next kernel's programs may be scheduled once all of these run.
        tl.extra.cuda.gdc_launch_dependents()
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PAIRED:
        rn = _pair_rows(rn, pid_n, rot_rows, rot_half, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    if PDL > 0:
        # The weights are no other kernel's output: the first two tiles' loads
        # overlap the previous kernel's tail (two measured faster than one).
        kk0 = k_start + rk
        k_ok0 = kk0 < k_end
        w0 = tl.load(w_rows + kk0[None, :], mask=n_ok[:, None] & k_ok0[None, :], other=0.0)
        kk1 = kk0 + BLOCK_K
        k_ok1 = kk1 < k_end
        w1 = tl.load(w_rows + kk1[None, :], mask=n_ok[:, None] & k_ok1[None, :], other=0.0)
    if PDL > 0 and not INTERPRET:
        # Everything below reads (or writes what may still be read by) the
        # previous kernels.
        tl.extra.cuda.gdc_wait()
    inv = 0.0
    if NORM > 0:
        # The input's RMS over the whole row, in every program (the row is a few
        # KiB, read from L2); the first program stores the residual stream.
        offs = tl.arange(0, BLOCK_D)
        d_ok = offs < K
        whole = tl.load(x_ptr + offs, mask=d_ok, other=0.0).to(tl.float32)
        if NORM == 2:
            r = tl.load(r_ptr + offs, mask=d_ok, other=0.0).to(tl.float32)
            whole = _round(whole + r, dt, INTERPRET)
            if pid_n + pid_k == 0:
                tl.store(r_out_ptr + offs, whole.to(dt), mask=d_ok)
        inv = _inv_rms(whole, K, eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    k_first = k_start
    if PDL > 0:
        x0 = _input_chunk(
            x_ptr, r_ptr, g_ptr, kk0, k_ok0, K, inv, dt,
            GATE_ACT, NORM, ZERO_CENTERED, INTERPRET, EXACT,
        )  # fmt: skip
        acc += _term(
            w0, x0, s_ptr, rn, n_ok, pid_n, k_start, k_end, stride_sn,
            SCALE, SCALE_K, SCALE_N, BLOCK_N, BLOCK_K, PAIRED,
        )  # fmt: skip
        x1 = _input_chunk(
            x_ptr, r_ptr, g_ptr, kk1, k_ok1, K, inv, dt,
            GATE_ACT, NORM, ZERO_CENTERED, INTERPRET, EXACT,
        )  # fmt: skip
        acc += _term(
            w1, x1, s_ptr, rn, n_ok, pid_n, k_start + BLOCK_K, k_end, stride_sn,
            SCALE, SCALE_K, SCALE_N, BLOCK_N, BLOCK_K, PAIRED,
        )  # fmt: skip
        k_first = k_start + 2 * BLOCK_K
    for k0 in range(k_first, k_end, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k_end
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = _input_chunk(
            x_ptr, r_ptr, g_ptr, kk, k_ok, K, inv, dt,
            GATE_ACT, NORM, ZERO_CENTERED, INTERPRET, EXACT,
        )  # fmt: skip
        acc += _term(
            w, x, s_ptr, rn, n_ok, pid_n, k0, k_end, stride_sn,
            SCALE, SCALE_K, SCALE_N, BLOCK_N, BLOCK_K, PAIRED,
        )  # fmt: skip
    part = tl.sum(acc, axis=1)
    if SCALE == 1:
        # One scale per output row: applied once to the row's sum.
        part *= tl.load(s_ptr + rn.to(tl.int64) * stride_sn, mask=n_ok, other=0.0)
    if not SPLIT:
        if HAS_BIAS:
            part += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        y = _epilogue(part, y_ptr, ACT, INTERPRET, EXACT)
        if ROPE:
            y = _rotated(y, y_ptr, cos_ptr, sin_ptr, pid_n, rot_rows, rot_half, BLOCK_N)
        _store(y, y_ptr, rn, n_ok, pid_n, rot_half, GLU, BLOCK_N, INTERPRET, EXACT)
    else:
        tl.store(part_ptr + pid_k * N + rn, part, mask=n_ok)
        # Every thread's partial stores come before the (releasing) arrival.
        tl.debug_barrier()
        counter = count_ptr + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == split_k - 1:
            total = tl.zeros([BLOCK_N], tl.float32)
            # In split order, whichever program arrives last: the same sums
            # every run. Loads bypass L1 (".cg"): other SMs wrote the partials.
            for s in range(0, split_k):
                total += tl.load(part_ptr + s * N + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            y = _epilogue(total, y_ptr, ACT, INTERPRET, EXACT)
            if ROPE:
                y = _rotated(y, y_ptr, cos_ptr, sin_ptr, pid_n, rot_rows, rot_half, BLOCK_N)
            _store(y, y_ptr, rn, n_ok, pid_n, rot_half, GLU, BLOCK_N, INTERPRET, EXACT)
            tl.atomic_xchg(counter, 0)


@triton.jit
def _term(
    w,
    x,
    s_ptr,
    rn,
    n_ok,
    pid_n,
    k0,
    k_end,
    stride_sn,
    SCALE: tl.constexpr,
    SCALE_K: tl.constexpr,
    SCALE_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PAIRED: tl.constexpr,
):
    """A chunk's products, weight tile ``w`` (columns from ``k0``) times input chunk ``x``,
    in float32: ``[BLOCK_N, BLOCK_K]``.

    A chunk within one column block of block scales (or without them) takes
    :func:`_weight`'s tile. A chunk holding ``BLOCK_K // SCALE_K`` whole
    column blocks is scaled per column group: where the program's rows all
    lie in one row block (``SCALE_N`` a multiple of ``BLOCK_N``, rows in
    order) the scale depends on the column alone and multiplies the input
    chunk, ``BLOCK_K`` products instead of the tile's ``BLOCK_N * BLOCK_K``;
    otherwise (row-form blocks, rows in pair order) a
    ``[BLOCK_N, BLOCK_K // SCALE_K]`` scale tile multiplies the weight tile
    viewed as ``[BLOCK_N, BLOCK_K // SCALE_K, SCALE_K]``.
    """
    if SCALE == 2 and BLOCK_K > SCALE_K:
        if SCALE_N % BLOCK_N == 0 and not PAIRED:
            srow = ((pid_n * BLOCK_N) // SCALE_N).to(tl.int64) * stride_sn
            kk = k0 + tl.arange(0, BLOCK_K)
            s = tl.load(s_ptr + srow + kk // SCALE_K, mask=kk < k_end, other=0.0)
            prod = w.to(tl.float32) * (x * s)[None, :]
        else:
            GROUPS: tl.constexpr = BLOCK_K // SCALE_K
            g = tl.arange(0, GROUPS)
            srow = (rn // SCALE_N).to(tl.int64) * stride_sn
            # Groups past the reduction's end hold masked (zero) weights.
            g_ok = k0 + g * SCALE_K < k_end
            s = tl.load(
                s_ptr + srow[:, None] + (k0 // SCALE_K + g)[None, :],
                mask=n_ok[:, None] & g_ok[None, :],
                other=0.0,
            )
            wf = tl.reshape(w.to(tl.float32), [BLOCK_N, GROUPS, SCALE_K]) * s[:, :, None]
            prod = tl.reshape(wf, [BLOCK_N, BLOCK_K]) * x[None, :]
    else:
        prod = _weight(w, s_ptr, rn, n_ok, k0, stride_sn, SCALE, SCALE_K, SCALE_N) * x[None, :]
    return prod


@triton.jit
def _weight(
    w,
    s_ptr,
    rn,
    n_ok,
    k0,
    stride_sn,
    SCALE: tl.constexpr,
    SCALE_K: tl.constexpr,
    SCALE_N: tl.constexpr,
):
    """A weight tile in float32; with block scales (``SCALE == 2``) times the scale of each
    row's ``SCALE_N``-row block and the ``SCALE_K`` columns holding the chunk at ``k0`` (a
    chunk here lies within one column block; wider ones are scaled by :func:`_term`)."""
    wf = w.to(tl.float32)
    if SCALE == 2:
        srow = (rn // SCALE_N).to(tl.int64) * stride_sn
        s = tl.load(s_ptr + srow + k0 // SCALE_K, mask=n_ok, other=0.0)
        wf = wf * s[:, None]
    return wf


@triton.jit
def _input_chunk(
    x_ptr,
    r_ptr,
    g_ptr,
    kk,
    k_ok,
    K,
    inv,
    dt: tl.constexpr,
    GATE_ACT: tl.constexpr,
    NORM: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    INTERPRET: tl.constexpr,
    EXACT: tl.constexpr,
):
    """The projected input at columns ``kk`` in float32, after the prologue's work (the
    gated activation, or the residual add and RMS norm)."""
    x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    if GATE_ACT >= 0:
        # The input row is [gate | up]: act(gate) * up, rounded as the gated
        # activation kernel rounds it.
        u = tl.load(x_ptr + K + kk, mask=k_ok, other=0.0).to(tl.float32)
        x = _round(_round(_act(x, GATE_ACT, EXACT), dt, INTERPRET) * u, dt, INTERPRET)
    if NORM > 0:
        # RMS-normalised, rounded as the norm kernel rounds it.
        if NORM == 2:
            r = tl.load(r_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            x = _round(x + r, dt, INTERPRET)
        g = tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            x = _round(x * inv * (1.0 + g), dt, INTERPRET)
        else:
            x = _round(g * _round(x * inv, dt, INTERPRET), dt, INTERPRET)
    return x


@triton.jit
def _pair_rows(rn, pid_n, rot_rows, rot_half, BLOCK_N: tl.constexpr):
    """The output rows of a block in rotary pair order, where the block lies in the rotated rows.

    A block of the first ``rot_rows`` rows (whole heads of ``2 * rot_half``
    channels) holds ``BLOCK_N / 2`` rotary pairs ``(i, i + rot_half)`` of
    consecutive pair indices: their first channels, then their second ones.
    Blocks past ``rot_rows`` keep their consecutive rows. The gated epilogue
    pairs every row this way (``rot_rows = N``, ``rot_half = N / 2``: gate
    ``i`` with up ``i``).
    """
    half: tl.constexpr = BLOCK_N // 2
    j = tl.arange(0, BLOCK_N)
    pair = pid_n * half + j % half
    rows = (pair // rot_half) * (2 * rot_half) + pair % rot_half + (j // half) * rot_half
    return tl.where(pid_n * BLOCK_N < rot_rows, rows, rn)


@triton.jit
def _rotated(y, y_ptr, cos_ptr, sin_ptr, pid_n, rot_rows, rot_half, BLOCK_N: tl.constexpr):
    """A block's output rows in pair order (see :func:`_pair_rows`) rotated by ``cos``/``sin``,
    rounded as the rotary kernel rounds the stored product; other blocks as they are.

    Each rounding goes through the float's bits (as in the interpreter): this
    kernel is compiled with FP contraction, which a float round trip does
    not reliably stop from merging the products into the sums.
    """
    dt = y_ptr.dtype.element_ty
    half: tl.constexpr = BLOCK_N // 2
    x1, x2 = tl.split(tl.trans(tl.reshape(y.to(tl.float32), [2, half])))
    i = (pid_n * half + tl.arange(0, half)) % rot_half
    c = tl.load(cos_ptr + i).to(tl.float32)
    s = tl.load(sin_ptr + i).to(tl.float32)
    # As _rotary_kernel: x1_sin = x1 * sin; x1 = x1 * cos - x2 * sin; x2 = x2 * cos + x1_sin
    x1_sin = _round(x1 * s, dt, True)
    o1 = _round(_round(x1 * c, dt, True) - _round(x2 * s, dt, True), dt, True)
    o2 = _round(_round(x2 * c, dt, True) + x1_sin, dt, True)
    rotated = tl.reshape(tl.trans(tl.join(o1, o2)), [BLOCK_N]).to(dt)
    return tl.where(pid_n * BLOCK_N < rot_rows, rotated, y)


@triton.jit
def _store(
    y,
    y_ptr,
    rn,
    n_ok,
    pid_n,
    half_rows,
    GLU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Store a block's output rows; with a gated epilogue (``GLU >= 0``) its rows in pair
    order (gate ``i``, then up ``i + half_rows``, see :func:`_pair_rows`) become
    ``act(gate) * up`` at ``i``, rounded as the gated activation kernel rounds it."""
    if GLU >= 0:
        dt = y_ptr.dtype.element_ty
        half: tl.constexpr = BLOCK_N // 2
        gate, up = tl.split(tl.trans(tl.reshape(y.to(tl.float32), [2, half])))
        h = _round(_round(_act(gate, GLU, EXACT), dt, INTERPRET) * up, dt, INTERPRET)
        i = pid_n * half + tl.arange(0, half)
        tl.store(y_ptr + i, h.to(dt), mask=i < half_rows)
    else:
        tl.store(y_ptr + rn, y, mask=n_ok)


@triton.jit
def _epilogue(y, y_ptr, ACT: tl.constexpr, INTERPRET: tl.constexpr, EXACT: tl.constexpr):
    """The float32 sums as ``y_ptr``'s dtype, through the activation ``ACT`` (< 0: none)."""
    dt = y_ptr.dtype.element_ty
    # Rounded to nearest (the interpreter's casts truncate), then, as an
    # activation applied to the stored product would see it, activated and
    # rounded again.
    y = _round(y, dt, INTERPRET)
    if ACT >= 0:
        y = _round(_act(y, ACT, EXACT), dt, INTERPRET)
    return y.to(dt)


#: launches :func:`_gemv_kernel` with the host cost of the driver call
_LAUNCHER = KernelLauncher(_gemv_kernel)


#: warps per program unless a launch names its own (Triton's default)
NUM_WARPS = 4


#: widest input row the models send through :func:`norm_gemv` (every program
#: holds the whole row in registers for its RMS; wider rows take the norm kernel)
NORM_MAX_ROW = 8192

#: weights up to this many elements count as small (16 MiB in 16-bit types)
SMALL_WEIGHT = 1 << 23

#: weights below this many elements (64 MiB in 16-bit types) and above
#: :data:`SMALL_WEIGHT` count as medium
MEDIUM_WEIGHT = 1 << 25


#: a reduction at least this long per program streams in chunks of 512 columns,
#: at every weight size (the 8B-class shapes, ``K = 4096``)
LONG_ROW = 4096

#: a split of a tall weight at least this long streams in chunks of 512 columns
WIDE_SPLIT = 2048


def plan(n: int, k: int, sms: int) -> tuple[int, int, int]:
    """The launch shape for an ``[n, k]`` weight at one row.

    Measured on an H200 at one row, weights cold in L2 (``benchmarks/gemv.py``).
    Projections of 1B-class models (``K = 2048``, ``--model llama-1b`` and
    ``nemotron-h-0.85b``):

    * tall weights (``k >= 2n``: down and Mamba2 out projections) split the
      reduction until about three programs per SM are in flight, at least
      1024 columns per split, in row blocks of 16, in steps of 512 where a
      split holds :data:`WIDE_SPLIT` columns and 256 below: 8192 -> 2048 in
      four splits in 10.1 us against 12.4 in steps of 256 and cuBLAS's 14.1,
      4096 -> 2048 in 8.0 against 9.5;
    * small weights (up to :data:`SMALL_WEIGHT` elements: attention
      projections) run unsplit, in row blocks of 8 and steps of 512: 2048 ->
      2048 in 4.2 us against 6.1, 2048 -> 3072 in 4.5 against 6.2;
    * medium weights (below :data:`MEDIUM_WEIGHT` elements: Mamba2 in
      projections, non-gated MLP up projections) run unsplit, in row blocks of
      16 and steps of 256: 2048 -> 10304 in 12.1 us against 13.1, 2048 -> 8192
      in 10.5 against 10.9;
    * larger weights (gate/up of 2048 -> 16384, LM heads) run unsplit in row
      blocks of 16 and steps of 512: 16.0 us against cuBLAS's 18.4 (97% of the
      bandwidth against 85%), a 32000-row head in 30.3 against 35.0. Once
      slower than cuBLAS here, the kernel overtook it with its dependent
      launches and row tiles.

    With both the wider steps of tall weights and the kernel for larger ones,
    Nemotron-H 0.85B's batch-1 step (its untied 32000-row head, twelve 8192
    -> 2048 down projections) went from 0.685-0.698 to 0.662-0.666 ms per
    token (three pairs, each in one call on an H200); the
    Llama-3.2-1B shape's stayed at 0.93 (its tied head is a cuBLAS product of
    the embedding, and the shorter down and gate/up launches gained nothing
    in the layer).

    Where each program reduces at least :data:`LONG_ROW` columns (8B-class
    models, ``--model llama-8b``) every size runs the kernel in steps of 512,
    the tall ones split as above: q/k/v 4096 -> 6144 in 13.9 us against
    cuBLAS's 16.2 (14.9 in steps of 256), o 4096 -> 4096 in 10.0 against 13.4,
    gate/up 4096 -> 28672 in 55.5 against 61.1 (101% and 89% of the
    bandwidth), down 14336 -> 4096 in two splits in 28.8 against 32.1 (38.1 in
    steps of 256), a 128k LM head in 235 against 247.

    :param n: output features.
    :param k: input features.
    :param sms: the device's multiprocessor count.
    :return: ``(block_n, block_k, split_k)`` (``split_k`` a power of two).
    """
    if k >= 2 * n:
        block_n = 16
        blocks = cdiv(n, block_n)
        split_k = 1
        while blocks * split_k < 3 * sms and k // (split_k * 2) >= 1024:
            split_k *= 2
        return block_n, 512 if k // split_k >= WIDE_SPLIT else 256, split_k
    if k >= LONG_ROW:
        return 16, 512, 1
    if n * k <= SMALL_WEIGHT:
        return 8, 512, 1
    if n * k < MEDIUM_WEIGHT:
        return 16, 256, 1
    return 16, 512, 1


def default_launch(
    n: int, k: int, device: torch.device, scale_k: int | None = None, fp8: bool = False
) -> tuple[int, ...]:
    """:func:`plan`'s launch for an ``[n, k]`` weight on ``device``; for FP8 weights
    (``fp8``, with ``scale_k`` for block scales), :func:`plan_fp8`'s."""
    sms = 4 if interpreting() else torch.cuda.get_device_properties(device).multi_processor_count
    if fp8 or scale_k is not None:
        return plan_fp8(n, k, sms, scale_k)
    return plan(n, k, sms)


def plan_gated(n: int, k: int, sms: int, fp8: bool = False) -> tuple[int, int, int] | None:
    """The launch for a tall ``[n, k]`` weight with long rows whose input the kernel forms
    from a gated MLP's ``[gate | up]`` row (``gemv(gate_act=...)``), or ``None`` where the
    weight takes its usual plan.

    Each chunk then loads two input chunks and applies the activation, which
    changes the best tiles. Measured on an H200 at the Llama-3.1-8B down
    projection (14336 -> 4096, ``benchmarks/gemv.py --fused``): bfloat16 in
    four splits of 512-column chunks, 33.5 us against 37.2 in :func:`plan`'s
    two; FP8 in row blocks of 16, two splits of 512-column chunks, 19.4 us
    against 27.5 in :func:`plan_fp8`'s ``(8, 1024, 1)``.

    A rank's share of a split down projection is wide but not tall (``n <= k <
    2n``, ``k >= LONG_ROW``): one split, in row blocks of 8. Measured at the Llama-3.1-8B down
    projection's half (7168 -> 4096, ``--fused --model llama-8b-tp2``): 17.3
    us against 20.1 in :func:`plan`'s row blocks of 16.

    :param n: output features.
    :param k: input features (of the gated product, half the row's width).
    :param sms: the device's multiprocessor count.
    :param fp8: the weight is FP8 with one scale per row or per tensor.
    :return: ``(block_n, block_k, split_k)``, or ``None``.
    """
    launch = plan(n, k, sms)
    if not fp8 and k >= LONG_ROW and n <= k < 2 * n:
        return 8, 512, 1
    if k < 2 * n or k // launch[2] < LONG_ROW:
        return None
    block_n, block_k, split_k = launch
    return (block_n, block_k, split_k) if fp8 else (block_n, block_k, 2 * split_k)


#: FP8 weights of at least this many elements (64 MiB: gate/up and LM heads of
#: 8B-class models) take eight warps per program on long rows, as wide ones do
FP8_LARGE = 1 << 26


#: the narrowest column block a chunk may hold several of (its scales applied per
#: column group, see :func:`chunk_fits_blocks`)
MIN_SCALE_GROUP = 16


def chunk_fits_blocks(block_k: int, scale_k: int) -> bool:
    """Whether chunks of ``block_k`` columns read a weight with scale blocks of ``scale_k`` columns.

    A chunk either lies within one column block (``block_k`` divides
    ``scale_k``: one scale per row and chunk) or holds whole ones
    (``scale_k`` a power of two of at least :data:`MIN_SCALE_GROUP`
    dividing ``block_k``: the scales applied per column group); a chunk
    straddling a block boundary is not read.

    :param block_k: columns per chunk, a power of two.
    :param scale_k: columns per scale block.
    :return: ``True`` where the kernel reads the weight in such chunks.
    """
    if scale_k % block_k == 0:
        return True
    return scale_k >= MIN_SCALE_GROUP and scale_k & (scale_k - 1) == 0 and block_k % scale_k == 0


def plan_fp8(n: int, k: int, sms: int, scale_k: int | None = None) -> tuple[int, ...]:
    """The launch shape for an ``[n, k]`` FP8 (e4m3) weight at one row.

    Every shape runs the kernel: the alternative at one row,
    ``torch._scaled_mm``, quantises the activation in a launch of its own and
    multiplies a row padded to 16 (5-8x slower, ``benchmarks/gemv.py --fp8``).

    With one scale per row (or tensor) and rows of at least
    :data:`LONG_ROW` columns, the shapes measured on an H200 at the
    Llama-3.1-8B projections (``--fp8 channel --model llama-8b``): weights of
    :data:`FP8_LARGE` elements and more, and wide ones (``n > k``), in row
    blocks of 16, steps of 512 and eight warps (gate/up 30.7-32.2 us at 86-89%
    of the bandwidth, a 128k LM head 126.5 us at 97%, q/k/v 8.5 us against 9.8
    in the launch below, and with its norm and rotary riding along, ``--fused``,
    9.0 against 10.8); smaller ones in row blocks of 8 and steps of 1024,
    split as :func:`plan` splits tall weights, two chunks per split at least
    (o 5.8 us against 12.2 for the 16-bit shapes below, down 16.6 against
    24.8): an FP8 tile holds half the bytes of a 16-bit one of the same shape.

    Block scales on such rows take the same shapes where the chunk holds
    whole scale blocks or lies within one (see :func:`chunk_fits_blocks`:
    the 128x128 blocks of DeepSeek-V3 checkpoints and the row-form blocks of
    ``quantization="fp8"``, 128 columns each), the scales applied per column
    group. Chunks narrowed to the 128-column blocks measured slower at those
    projections (o 7.4 us in ``(32, 128, 8)`` against 5.8 in
    ``(8, 1024, 1)``, down 18.7 against 16.6, q/k/v 10.1 against 8.3).

    Otherwise the shapes are :func:`plan`'s, with the chunks narrowed to divide the
    weight's scale blocks so that each chunk takes one scale per row.

    :param n: output features.
    :param k: input features.
    :param sms: the device's multiprocessor count.
    :param scale_k: input columns per weight scale for block scales, ``None``
        for one scale per row (or per tensor).
    :return: ``(block_n, block_k, split_k)``, with the warps per program
        after them where they are not :data:`NUM_WARPS`.
    :raises ValueError: for scale blocks of fewer than 16 columns or not a
        multiple of 16.
    """
    blocked = scale_k is not None and scale_k < k
    eight_warps = n * k >= FP8_LARGE or n > k
    wide = 512 if eight_warps else 1024
    if k >= LONG_ROW and (not blocked or chunk_fits_blocks(wide, scale_k)):
        if eight_warps:
            return 16, wide, 1, 8
        blocks = cdiv(n, 8)
        split_k = 1
        while blocks * split_k < 3 * sms and k // (split_k * 2) >= 2 * wide:
            split_k *= 2
        return 8, wide, split_k
    block_n, block_k, split_k = plan(n, k, sms)
    if blocked:
        if scale_k % 16:
            raise ValueError(
                f"gemv: FP8 scale blocks of {scale_k} columns are not read by the kernel; "
                "they must be a multiple of 16 columns (checkpoints use 128)"
            )
        # The largest power of two dividing the scale block.
        block_k = min(block_k, scale_k & -scale_k)
    return block_n, block_k, split_k


def weight_scale_layout(
    weight: torch.Tensor, scale: torch.Tensor | None, scale_k: int | None, scale_n: int = 1
) -> tuple[int, int, int, int]:
    """How the kernel reads a weight's scales: checks them against the weight.

    :param weight: ``[N, K]``, a dtype of :data:`DTYPES` without scales, or
        :data:`FP8_WEIGHT` with them.
    :param scale: float32: one element (per tensor), ``[N]`` or ``[N, 1]`` (per
        output row), or ``[ceil(N / scale_n), ceil(K / scale_k)]`` with unit
        stride along the columns (block scales: ``scale_n = 1`` is the models'
        row form, ``scale_n = scale_k = 128`` a DeepSeek-V3 checkpoint's form);
        ``None`` for an unscaled weight.
    :param scale_k: input columns per scale, for block scales.
    :param scale_n: output rows per scale, for block scales.
    :return: ``(mode, scale_k, scale_n, row stride)``: mode 0 (no scales), 1
        (one per output row, the row stride 0 for one per tensor) or 2
        (blocks); ``scale_k`` and ``scale_n`` are 1 where unused.
    :raises ValueError: for a weight dtype that does not go with ``scale``, or
        a scale that does not fit the weight.
    """
    n, k = weight.shape
    if scale is None:
        if weight.dtype not in DTYPES:
            raise ValueError(
                f"gemv: a {weight.dtype} weight needs its scales (scale=); unscaled weights "
                f"are one of {', '.join(map(str, DTYPES))}"
            )
        return 0, 1, 1, 0
    if weight.dtype != FP8_WEIGHT:
        raise ValueError(f"gemv: scales go with {FP8_WEIGHT} weights, not {weight.dtype}")
    if scale.dtype != torch.float32 or scale.device != weight.device:
        raise ValueError(
            f"gemv: weight scales must be float32 on {weight.device}, got {scale.dtype} "
            f"on {scale.device}"
        )
    if scale.numel() == 1:
        return 1, 1, 1, 0
    if scale.dim() == 1 and scale.shape[0] == n and scale.stride(0) == 1:
        return 1, 1, 1, 1
    if scale.dim() == 2 and scale.shape == (n, 1):
        return 1, 1, 1, scale.stride(0)
    if scale.dim() == 2 and scale_k is not None and scale_n >= 1 and scale.stride(1) == 1:
        want = (cdiv(n, scale_n), cdiv(k, scale_k))
        if tuple(scale.shape) == want:
            # One scale block across the whole row: every chunk divides this.
            cols = int(scale_k) if want[1] > 1 else 1 << 30
            return 2, cols, int(scale_n), scale.stride(0)
    raise ValueError(
        f"gemv: scale {tuple(scale.shape)} (scale_k={scale_k}, scale_n={scale_n}) fits no "
        f"layout of a {(n, k)} weight: give one element, [N] or [N, 1], or "
        "[ceil(N / scale_n), ceil(K / scale_k)] with unit stride along the columns"
    )


#: dtypes the rotary epilogue rounds as the rotary kernel does (bfloat16 on the
#: float's bits; float32 needs no rounding)
ROTARY_DTYPES = (torch.float32, torch.bfloat16)


def rotary_fits(
    launch: tuple[int, int, int], n: int, rows: int, half: int, dtype: torch.dtype
) -> bool:
    """Whether a projection launched as ``launch`` can rotate its first ``rows`` outputs.

    The rotary epilogue takes whole heads of ``2 * half`` channels (rotary over
    the whole head), row blocks that hold whole pairs and do not straddle the
    rotated rows' end, and a dtype of :data:`ROTARY_DTYPES`.
    """
    block_n = launch[0]
    return (
        dtype in ROTARY_DTYPES
        and half > 0
        and 0 < rows <= n
        and rows % (2 * half) == 0
        and block_n % 2 == 0
        and rows % block_n == 0
    )


def glu_pays(k: int) -> bool:
    """Whether a gated MLP with ``k`` input features gains from the gated epilogue at one row.

    Measured on an H200, ``backplane bench latency`` at batch 1, one machine:
    the Llama-3.2-1B shape (``K = 2048``; gate/up in row blocks of 16 and steps
    of 256, the down projection's launch the same either way) 0.974 -> 0.955
    ms per token. The Llama-3.1-8B shape (``K = 4096``) lost: alone the
    epilogue costs gate/up 1.5 us and saves the down projection 4.8 us
    (``benchmarks/gemv.py --fused``: 59.2 against 57.8 us, 29.0 plain in two
    splits against 33.8 gated in four), but in the layer the step took 4.630
    ms against 4.475 with the prologue, and 4.476 at best with other down
    launches. So rows of :data:`LONG_ROW` features and more keep the prologue.

    :param k: the gate/up projection's input features.
    :return: whether the MLP should ask for ``glu=``.
    """
    return k < LONG_ROW


def glu_fits(
    launch: tuple[int, ...], n: int, act: str | None = None, rotary: tuple[int, int] | None = None
) -> bool:
    """Whether a projection launched as ``launch`` can form ``act(gate) * up`` as its epilogue.

    The gated epilogue reads a gated MLP's ``[gate | up]`` weight of ``n`` rows
    and stores ``n / 2`` outputs: each program computes gate rows ``i`` and up
    rows ``i + n / 2`` together (in pair order, as the rotary epilogue pairs
    its rows), so it needs an even ``n``, even row blocks, and no other
    epilogue.

    :param launch: ``(block_n, block_k, split_k)``.
    :param n: the weight's output rows (gate and up).
    :param act: an activation epilogue asked for with it (``None``: none).
    :param rotary: a rotary epilogue asked for with it (``None``: none).
    :return: whether :class:`OneRowProjection` takes ``glu=`` with these.
    """
    return n % 2 == 0 and launch[0] % 2 == 0 and act is None and rotary is None


class OneRowProjection:
    """A one-row projection with everything but its inputs decided.

    Holds the weight, the bias, the launch shape and the work that rides
    along (an activation epilogue, a gated-activation or RMS-norm prologue, a
    rotary or gated epilogue), so that a call site run every decode step (a
    :class:`~backplane.models.linear.Linear`) pays for its launch alone: an
    output allocation and the driver call. The arguments are checked once,
    here; :meth:`__call__` trusts its inputs' shapes (``[1, K]`` rows with unit
    stride, ``[1, 2K]`` with ``gate_act``) and reads only their alignment.

    :param weight: ``[N, K]`` with unit stride along ``K``.
    :param bias: optional ``[N]``, contiguous.
    :param launch: ``(block_n, block_k, split_k)``, powers of two (default:
        :func:`default_launch`), optionally followed by the warps per program
        (default :data:`NUM_WARPS`).
    :param act: the epilogue's activation (a key of
        :data:`~backplane.kernels.elementwise.ACT_CODES`) or ``None``.
    :param gate_act: the gated-activation prologue's activation, or ``None``.
    :param norm: ``(norm weight [K], eps, zero_centered)``: project the
        RMS-normalised input (see :func:`norm_gemv`), or ``None``.
    :param rotary: ``(rows, half)``: rotate output pairs ``(i, i + half)`` of
        every head of ``2 * half`` channels among the first ``rows`` outputs,
        with the ``cos``/``sin`` given per call (see :func:`norm_gemv`); ``None``
        for none.
    :param pdl: launch as a programmatic dependent of the previous kernel,
        loading the first two weight tiles before waiting for it (see
        :func:`~backplane.core.launch.dependent_launch`, the default). The
        interpreter runs the same order of loads without the launch option.
    :param scale: an FP8 weight's float32 scales (see
        :func:`weight_scale_layout`): the weight is read one byte per element
        and multiplied by its scale in float32; ``None`` for a weight of
        :data:`DTYPES`.
    :param scale_k: input columns per scale, for block scales.
    :param scale_n: output rows per scale, for block scales (1: one scale row
        per output row).
    :param dtype: the dtype of the rows projected and of the output (default:
        the weight's; required with an FP8 weight).
    :param glu: the gated epilogue's activation: the weight is a gated MLP's
        ``[gate | up]`` and the output ``act(gate) * up``, ``[1, N / 2]`` (see
        :func:`glu_fits`); ``None`` for none.
    :raises ValueError: for an unknown activation, a weight, scale or norm
        weight the kernel cannot read, or a rotary or gated epilogue the
        launch cannot hold.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        launch: tuple[int, int, int] | None = None,
        act: str | None = None,
        gate_act: str | None = None,
        norm: tuple[torch.Tensor, float, bool] | None = None,
        rotary: tuple[int, int] | None = None,
        pdl: bool | None = None,
        scale: torch.Tensor | None = None,
        scale_k: int | None = None,
        scale_n: int = 1,
        dtype: torch.dtype | None = None,
        glu: str | None = None,
    ) -> None:
        for a in (act, gate_act, glu):
            if a is not None and a not in ACT_CODES:
                raise ValueError(f"gemv: unknown activation {a!r}; known: {', '.join(ACT_CODES)}")
        if weight.dim() != 2 or weight.stride(1) != 1:
            raise ValueError(f"gemv: weight {tuple(weight.shape)} needs unit stride along K")
        n, k = weight.shape
        if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"gemv: bias {tuple(bias.shape)} does not match weight {(n, k)}")
        scale_mode, scale_k, scale_n, stride_sn = weight_scale_layout(
            weight, scale, scale_k, scale_n
        )
        if launch is None:
            launch = default_launch(
                n, k, weight.device, scale_k if scale_mode == 2 else None, fp8=scale_mode > 0
            )
        block_n, block_k = launch[0], launch[1]
        num_warps = launch[3] if len(launch) > 3 else NUM_WARPS
        launch = tuple(launch[:3])
        if scale_mode == 2 and not chunk_fits_blocks(block_k, scale_k):
            raise ValueError(
                f"gemv: chunks of {block_k} columns straddle the weight's scale blocks of "
                f"{scale_k} columns; launch with a block_k that divides {scale_k}, or a "
                f"multiple of it where {scale_k} is a power of two of at least "
                f"{MIN_SCALE_GROUP} (see plan_fp8)"
            )
        out_dtype = weight.dtype if dtype is None else dtype
        if out_dtype not in DTYPES:
            raise ValueError(
                f"gemv: activations in {out_dtype} are not read by the kernel; "
                f"use one of {', '.join(map(str, DTYPES))}"
            )
        if scale_mode == 0 and out_dtype != weight.dtype:
            raise ValueError(
                f"gemv: a {weight.dtype} weight projects {weight.dtype} rows, not {out_dtype}"
            )
        blocks, k_per_split, split_k = _split_shape(n, k, launch)
        if norm is not None:
            norm_weight, eps, zero_centered = norm
            if norm_weight.shape != (k,) or norm_weight.stride(0) != 1:
                raise ValueError(
                    f"norm_gemv: norm weight {tuple(norm_weight.shape)} does not match K={k}"
                )
            if k > MAX_ROW:
                raise ValueError(f"norm_gemv: rows of at most {MAX_ROW} features, got {k}")
        else:
            norm_weight, eps, zero_centered = None, 0.0, False
        if glu is not None and not glu_fits(launch, n, act, rotary):
            raise ValueError(
                f"gemv: a gated epilogue pairs the {n} output rows' halves; it needs an even "
                f"row count, even row blocks (launch {launch}) and no other epilogue"
            )
        rot_rows, rot_half = rotary if rotary is not None else (0, 1)
        if glu is not None:
            # The rows pair as a rotation's would, gate i with up i + n/2.
            rot_rows, rot_half = n, n // 2
        # Asked for or not, the launch option needs a device that runs it; the
        # interpreter runs the kernel's order of loads alone.
        supported = INTERPRET or (weight.is_cuda and dependent_launch(weight.device.index))
        pdl = supported if pdl is None else (pdl and supported)
        if rotary is not None and (
            act is not None or not rotary_fits(launch, n, *rotary, out_dtype)
        ):
            raise ValueError(
                f"gemv: a rotary epilogue over {rot_rows} rows in pairs {rot_half} apart does "
                f"not fit launch {launch} of {n} {out_dtype} outputs (or comes with an "
                "activation)"
            )
        self.weight, self.bias, self.norm_weight = weight, bias, norm_weight
        self.scale = scale if scale_mode else None
        self.launch = launch
        self.n, self.k, self.blocks, self.split_k = n, k, blocks, split_k
        self.out_features = n if glu is None else n // 2
        self.dtype, self.device = out_dtype, weight.device
        self._device_index = weight.device.index
        self.rotary = rotary is not None
        # Outgrown scratch stays allocated (see _scratch): these remain valid.
        if split_k > 1:
            self._counters, self._part = _scratch(weight.device, blocks, split_k * n)
        else:
            self._counters = self._part = None
        self._tail = (
            float(eps),
            n,
            k,
            k_per_split,
            split_k,
            weight.stride(0),
            stride_sn,
            rot_rows,
            rot_half,
        )
        act_code = -1 if act is None else ACT_CODES[act]
        gate_code = -1 if gate_act is None else ACT_CODES[gate_act]
        glu_code = -1 if glu is None else ACT_CODES[glu]
        # Everything Triton specialises on but the per-call pointers' alignment.
        self._key = (
            n,
            k,
            launch,
            num_warps,
            weight.stride(0),
            weight.dtype,
            weight.data_ptr() & 15,
            None if bias is None else (bias.dtype, bias.data_ptr() & 15),
            None if norm_weight is None else (norm_weight.dtype, norm_weight.data_ptr() & 15),
            float(eps),
            act_code,
            gate_code,
            glu_code,
            bool(zero_centered),
            rot_rows,
            rot_half,
            pdl,
            out_dtype,
            None if not scale_mode else (scale_mode, scale_k, scale_n, stride_sn),
        )
        self._meta = dict(
            HAS_BIAS=bias is not None,
            SPLIT=split_k > 1,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            ACT=act_code,
            GATE_ACT=gate_code,
            ZERO_CENTERED=bool(zero_centered),
            BLOCK_D=next_pow2(k) if norm is not None else 1,
            ROPE=rotary is not None,
            GLU=glu_code,
            PAIRED=rotary is not None or glu is not None,
            INTERPRET=INTERPRET,
            num_warps=num_warps,
            EXACT=_EXACT_MATH,
            PDL=int(pdl),
            SCALE=scale_mode,
            SCALE_K=scale_k,
            SCALE_N=scale_n,
        )
        if pdl and not INTERPRET:
            self._meta["launch_pdl"] = True
        self._hits: dict[tuple[int, int], Any] = {}

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Project one row.

        :param x: ``[1, K]`` (``[1, 2K]`` with ``gate_act``), unit stride along
            the features, the weight's dtype.
        :param residual: with a norm only: the residual stream, like ``x``;
            ``None`` when the stream starts at ``x``.
        :param cos: with a rotary epilogue: the token's ``half`` cosines
            (unit stride, the weight's dtype).
        :param sin: likewise, the sines.
        :return: ``(output [1, N]`` (``[1, N / 2]`` with ``glu``), ``new residual
            stream [1, K])``; the stream is ``None`` without a norm or a residual.
        """
        y = torch.empty((1, self.out_features), dtype=self.dtype, device=self.device)
        if residual is not None:
            res_out = torch.empty((1, self.k), dtype=self.dtype, device=self.device)
            mode = 2
            ptrs = x.data_ptr() | residual.data_ptr()
        else:
            res_out = None
            mode = 0 if self.norm_weight is None else 1
            ptrs = x.data_ptr()
        if self.rotary:
            ptrs |= cos.data_ptr() | sin.data_ptr()
        # Triton specialises on 16-byte alignment; the outputs and scratch are fresh allocations.
        dyn = (mode, ptrs & 15 == 0)
        part = self._part if self._part is not None else y
        args = (
            x,
            self.weight,
            self.bias if self.bias is not None else y,
            y,
            part,
            self._counters if self._counters is not None else y,
            residual if residual is not None else y,
            self.norm_weight if self.norm_weight is not None else y,
            res_out if res_out is not None else y,
            cos if cos is not None else y,
            sin if sin is not None else y,
            self.scale if self.scale is not None else y,
            *self._tail,
        )
        hit = self._hits.get(dyn)
        if hit is not None:
            hit.launch(self.blocks, self.split_k, 1, self._device_index, *args)
        else:
            key = (self._key, dyn)
            _LAUNCHER(
                key, (self.blocks, self.split_k), args, self._device_index, NORM=mode, **self._meta
            )
            hit = _LAUNCHER.lookup(key, self._device_index)
            if hit is not None:
                self._hits[dyn] = hit
        return y, res_out


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    launch: tuple[int, int, int] | None = None,
    act: str | None = None,
    gate_act: str | None = None,
    scale: torch.Tensor | None = None,
    scale_k: int | None = None,
    scale_n: int = 1,
    glu: str | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for one input row, as :func:`torch.nn.functional.linear`.

    With ``scale``, ``weight`` is FP8 (e4m3) and the product is
    ``x @ (weight * scale).T``, the weight dequantised in float32 as it is
    read (see :func:`weight_scale_layout` for the scale layouts).

    :param x: ``[1, K]`` (or ``[K]``) with unit stride along ``K``; with
        ``gate_act``, ``[1, 2K]``: a gated MLP's ``[gate | up]`` row.
    :param weight: ``[N, K]`` with unit stride along ``K``, the dtype of ``x``.
    :param bias: optional ``[N]``, contiguous.
    :param launch: ``(block_n, block_k, split_k)``, ``block_n`` and ``block_k``
        powers of two, optionally followed by the warps per program; default:
        :func:`default_launch`.
    :param act: an activation applied to the product before it is stored (a
        key of :data:`~backplane.kernels.elementwise.ACT_CODES`, e.g.
        ``"relu2"``), with the roundings of the projection followed by the
        activation kernel; ``None`` for the plain product.
    :param gate_act: project ``gate_act(gate) * up`` instead of ``x``, with the
        roundings of the gated activation kernel
        (:func:`~backplane.kernels.elementwise.act_and_mul`): the down
        projection of a gated MLP without the launch that forms its input.
    :param scale: an FP8 weight's float32 scales, or ``None``.
    :param scale_k: input columns per scale (block scales only).
    :param scale_n: output rows per scale (block scales only).
    :param glu: for a gated MLP's ``[gate | up]`` weight: store
        ``glu(gate) * up`` instead of the product, with the roundings of the
        product followed by the gated activation kernel (``[1, N / 2]``): the
        launch that forms the down projection's input is saved, and the down
        projection reads a plain row.
    :return: a new ``[1, N]`` (or ``[N]``; half as wide with ``glu``) tensor in
        ``x``'s dtype.
    :raises ValueError: for more than one row, mismatched shapes, an unknown
        activation or scales that do not fit the weight.
    """
    row = _row(x, weight, 2 if gate_act is not None else 1)
    proj = OneRowProjection(
        weight,
        bias,
        launch=launch,
        act=act,
        gate_act=gate_act,
        scale=scale,
        scale_k=scale_k,
        scale_n=scale_n,
        dtype=x.dtype,
        glu=glu,
    )
    y, _ = proj(row)
    return y if x.dim() == 2 else y.view(-1)


def norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    launch: tuple[int, int, int] | None = None,
    act: str | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    glu: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Project the RMS-normalised row ``x (+ residual)`` in one launch: a pre-norm layer's first projection.

    Computes what :func:`~backplane.kernels.elementwise.add_rms_norm`
    (or ``rms_norm`` without a residual) followed by :func:`gemv` computes,
    with the same roundings of the sum and of the normalised row, without
    storing the normalised row. Every program reduces the whole row for its
    RMS; the first also stores the new residual stream.

    With ``rotary``, the first ``rows`` outputs (an attention layer's query
    and key heads) are also rotated as
    :func:`~backplane.kernels.elementwise.rotary_` rotates them, with
    the same roundings in bfloat16 (in float32 the compiler may fuse the
    rotation's products into FMAs, one rounding fewer): the launch that would
    rotate them is saved.

    :param x: ``[1, K]`` (or ``[K]``), unit stride: a layer's output, or the embeddings.
    :param residual: the residual stream, the shape and dtype of ``x``; ``None``
        when the stream starts at ``x``.
    :param norm_weight: ``[K]``, contiguous, ``x``'s dtype.
    :param eps: added to the mean square.
    :param zero_centered: the norm weight stores ``w - 1`` (see
        :func:`backplane.models.fused.rms_norm`).
    :param weight: ``[N, K]``, as for :func:`gemv`.
    :param bias: as for :func:`gemv`.
    :param launch: as for :func:`gemv`.
    :param act: as for :func:`gemv` (not with ``rotary``).
    :param rotary: ``(cos, sin, rows)``: the token's ``h`` cosines and sines
        (unit stride, ``x``'s dtype) and how many leading outputs are rotated,
        in heads of ``2h`` channels whose pairs are ``(i, i + h)``; see
        :func:`rotary_fits`.
    :param glu: as for :func:`gemv` (a pre-norm MLP's gate/up projection).
    :return: ``(output, residual stream)``: the ``[1, N]`` (or ``[N]``)
        projection and ``x + residual`` as a new tensor (``x`` itself when
        ``residual`` is ``None``).
    :raises ValueError: as :func:`gemv`, or for a residual or norm weight that
        does not match ``x``, a row wider than
        :data:`~backplane.kernels.elementwise.MAX_ROW`, or a rotary
        epilogue the launch cannot hold.
    """
    row = _row(x, weight)
    if norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_gemv: norm weight {norm_weight.dtype} is not x's {x.dtype}")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1
    ):
        raise ValueError(
            f"norm_gemv: residual {tuple(residual.shape)} {residual.dtype} does not match "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    cos = sin = None
    rot = None
    if rotary is not None:
        cos, sin, rows = rotary
        half = cos.numel()
        if (
            sin.numel() != half
            or cos.dtype != x.dtype
            or sin.dtype != x.dtype
            or (half > 1 and (cos.stride(-1) != 1 or sin.stride(-1) != 1))
        ):
            raise ValueError("norm_gemv: cos/sin must be one token's unit-stride rows in x's dtype")
        rot = (rows, half)
    proj = OneRowProjection(
        weight,
        bias,
        launch=launch,
        act=act,
        norm=(norm_weight, eps, zero_centered),
        rotary=rot,
        glu=glu,
    )
    y, res_out = proj(row.view(1, -1), residual, cos, sin)
    if res_out is None:
        res_out = x
    elif x.dim() == 1:
        res_out = res_out.view(-1)
    return (y if x.dim() == 2 else y.view(-1)), res_out


def _row(x: torch.Tensor, weight: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """``x`` as one ``[1, parts * K]`` row, checked against the ``[N, K]`` weight."""
    if not (x.dim() == 1 or (x.dim() == 2 and x.shape[0] == 1)) or x.stride(-1) != 1:
        raise ValueError(f"gemv takes one unit-stride row, got shape {tuple(x.shape)}")
    row = x.view(1, -1)
    if row.shape[1] != parts * weight.shape[1] or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"gemv: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    return row


def _split_shape(n: int, k: int, launch: tuple[int, int, int]) -> tuple[int, int, int]:
    """``(row blocks, K per split, splits)`` of a launch; splits shrink so none is empty."""
    block_n, block_k, split_k = launch
    k_per_split = cdiv(cdiv(k, split_k), block_k) * block_k
    return cdiv(n, block_n), k_per_split, cdiv(k, k_per_split)
