"""FP8 (e4m3) activation quantisation of ``[M, K]`` rows in one kernel.

An FP8 projection with several input rows quantises them before
``torch._scaled_mm``: one float32 scale per row (dynamic, per token) or one
given scale (a checkpoint's static ``input_scale``). As a chain of eager torch
ops that is eight passes over ``[M, K]`` float32 temporaries, several times
the FP8 product's own read of its input at thousands of rows per step.

:func:`quantize_per_token` reads each row block once for its absolute maximum
(held in registers where the row fits, :data:`MAX_SINGLE` elements, else
read a second time from the cache in :data:`CHUNK`-column pieces) and writes
the e4m3 values and the scale. :func:`quantize_static` does the same with one
given scale. Both equal the torch reference
(:func:`backplane.models.quant.fp8.quantize_per_token_eager`,
:func:`~backplane.models.quant.fp8.to_fp8`) bit for bit:

* ``scale = max(amax * (1 / 448), MIN_SCALE)`` in float32 (the reciprocal
  rounded to float32, as torch's CUDA division by a number does it), ``amax``
  of the row in float32 (NaN when the row holds one, as ``torch.amax``);
* ``q = e4m3(clamp(x / scale, -448, 448))``, the quotient a correctly rounded
  float32 division (``div_rn``: Triton's ``/`` is an approximate one on
  CUDA), NaN kept through the clamp, rounded to the nearest e4m3 value, ties
  to even.

Programs of the interpreter run on CPU tensors (``TRITON_INTERPRET=1``);
on CUDA the e4m3 conversion needs compute capability 8.9 or higher (as
``torch._scaled_mm``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backplane.core.launch import KernelLauncher, cdiv, next_pow2
from backplane.kernels.availability import interpreting

__all__ = ["CHUNK", "DTYPES", "FP8_MAX", "MAX_SINGLE", "quantize_per_token", "quantize_static"]

#: activation dtypes the kernel reads
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: the largest finite e4m3 value
FP8_MAX = 448.0

#: ``1 / FP8_MAX``; a scale is the row's maximum times it (rounded to float32)
INV_FP8_MAX: tl.constexpr = tl.constexpr(1.0 / FP8_MAX)

#: the smallest per-row scale (an all-zero row divides by it); the same float32
#: value as :data:`backplane.models.quant.fp8.MIN_SCALE`
MIN_SCALE = 1e-12

#: the longest row (in elements, rounded up to a power of two) held in registers
MAX_SINGLE = 8192

#: columns per piece of a longer row, read twice (for the maximum, then to quantise)
CHUNK = 4096

#: elements one program holds at short rows (several rows per program)
_TILE = 4096

_FP8 = torch.float8_e4m3fn

#: kernels run in the Triton interpreter (CPU tensors)
_INTERPRET = interpreting()


@triton.jit
def _max_nan(a, b):
    # torch.amax propagates NaN; tl.max would drop it
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _e4m3_bits(y):
    """The e4m3 encoding of float32 ``y`` (within +-448, or NaN) rounded to nearest, ties to even.

    For the interpreter only, whose float32 -> e4m3 cast drops the carry when
    the mantissa rounds up into the next power of two (124.3 becomes 64) and
    turns NaN into 384.
    """
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    a = mag.to(tl.float32, bitcast=True)
    # normal e4m3 values keep 3 of float32's 23 mantissa bits; the carry may reach the exponent
    rounded = (mag + (0x7FFFF + ((mag >> 20) & 1))) >> 20
    normal = rounded - ((127 - 7) << 3)
    # below 2**-6 the spacing is 2**-9: adding 1.5 * 2**14 (whose float32 spacing that is)
    # rounds to it, and the low mantissa bits of the sum count the steps
    small = ((a + 24576.0).to(tl.uint32, bitcast=True) - 0x46C00000) & 0xF
    code = tl.where(a < 0.015625, small, normal)
    code = tl.where(a != a, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _quantize(x, scale, INTERPRET: tl.constexpr):
    y = tl.math.div_rn(x, scale)
    y = tl.clamp(y, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if INTERPRET:
        q = _e4m3_bits(y).to(tl.float8e4nv, bitcast=True)
    else:
        q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return q


@triton.jit
def _act_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    m,
    k,
    stride_x,
    stride_q,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE: tl.constexpr,
    STATIC: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < m
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + rows[:, None] * stride_x
    q_row = q_ptr + rows[:, None] * stride_q
    if STATIC:
        scale = tl.load(s_ptr).to(tl.float32)
        for start in range(0, k, BLOCK_K):
            c = start + cols
            mask = row_ok[:, None] & (c[None, :] < k)
            x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + c[None, :], _quantize(x, scale, INTERPRET), mask=mask)
    elif SINGLE:
        mask = row_ok[:, None] & (cols[None, :] < k)
        x = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.reduce(tl.abs(x), 1, _max_nan)
        scale = tl.maximum(amax * INV_FP8_MAX, 1e-12, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_row + cols[None, :], _quantize(x, scale[:, None], INTERPRET), mask=mask)
        tl.store(s_ptr + rows, scale, mask=row_ok)
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            c = start + cols
            mask = row_ok[:, None] & (c[None, :] < k)
            x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = _max_nan(amax, tl.reduce(tl.abs(x), 1, _max_nan))
        scale = tl.maximum(amax * INV_FP8_MAX, 1e-12, propagate_nan=tl.PropagateNan.ALL)
        for start in range(0, k, BLOCK_K):
            c = start + cols
            mask = row_ok[:, None] & (c[None, :] < k)
            x = tl.load(x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + c[None, :], _quantize(x, scale[:, None], INTERPRET), mask=mask)
        tl.store(s_ptr + rows, scale, mask=row_ok)


_LAUNCHER = KernelLauncher(_act_quant_kernel)


def _shape(k: int) -> tuple[int, int, bool, int]:
    """``(BLOCK_M, BLOCK_K, SINGLE, num_warps)`` for rows of ``k`` elements."""
    width = next_pow2(max(k, 1))
    if width <= MAX_SINGLE:
        block_m = max(1, _TILE // width)
        return block_m, width, True, max(1, min(16, block_m * width // 512))
    return 1, CHUNK, False, 8


def _rows(x: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Check ``x`` and ``out`` and give the rows as the kernel reads them and the output."""
    if x.dim() != 2:
        raise ValueError(
            f"FP8 activation quantisation takes [M, K] rows, not shape {tuple(x.shape)}"
        )
    if x.dtype not in DTYPES:
        raise TypeError(
            f"FP8 activation quantisation reads {', '.join(map(str, DTYPES))}, not {x.dtype}; "
            "convert the activations first"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=_FP8, device=x.device)
    elif out.shape != x.shape or out.dtype != _FP8 or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(
            f"out must be a {_FP8} tensor of shape {tuple(x.shape)} on {x.device} with unit "
            f"column stride, not {out.dtype} {tuple(out.shape)} on {out.device} "
            f"(strides {out.stride()})"
        )
    return x, out


def _launch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, static: bool) -> None:
    m, k = x.shape
    if m == 0 or k == 0:
        return
    block_m, block_k, single, warps = _shape(k)
    _LAUNCHER.launch(
        (cdiv(m, block_m),),
        (x, q, s, m, k, x.stride(0), q.stride(0)),
        x.device.index or 0,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        SINGLE=single,
        STATIC=static,
        INTERPRET=_INTERPRET,
        num_warps=warps,
        enable_fp_fusion=False,
    )


def quantize_per_token(
    x: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each row of ``x`` to e4m3 with a float32 scale of its own, in one kernel.

    Under ``torch.compile`` it is one custom op (``out`` is not taken there).

    :param x: ``[M, K]`` float32, bfloat16 or float16 on a CUDA device (or the
        CPU in the Triton interpreter), columns of unit stride (else copied).
    :param out: where to write the e4m3 values, ``[M, K]`` of unit column
        stride; ``None`` allocates it.
    :return: ``(q [M, K] e4m3, scale [M, 1] float32)``, ``x ~= q * scale``,
        bit for bit the torch reference's (see the module docstring).
    :raises ValueError: ``x`` is not two-dimensional, or ``out`` does not fit it.
    :raises TypeError: ``x`` has another dtype.
    """
    if out is None and torch.compiler.is_compiling():
        return _per_token_op(x)
    return _per_token_eager(x, out)


def _per_token_eager(
    x: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel launch of :func:`quantize_per_token`, outside ``torch.compile``."""
    x, q = _rows(x, out)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    # Rows of no columns have no maximum (torch.amax raises); their scale is that of a
    # row of zeros.
    if x.shape[1] == 0:
        scale.fill_(MIN_SCALE)
    _launch(x, q, scale, static=False)
    return q, scale


def quantize_static(
    x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantise ``x`` to e4m3 with one given scale, in one kernel.

    Under ``torch.compile`` it is one custom op (``out`` is not taken there).

    :param x: ``[M, K]`` as for :func:`quantize_per_token`.
    :param scale: one float value (any shape of one element) on ``x``'s device,
        the divisor (a checkpoint's ``input_scale``).
    :param out: as for :func:`quantize_per_token`.
    :return: ``q [M, K]`` e4m3, bit for bit
        :func:`~backplane.models.quant.fp8.to_fp8` of ``x`` and ``scale``.
    :raises ValueError: as for :func:`quantize_per_token`, or ``scale`` holds
        more than one value.
    :raises TypeError: as for :func:`quantize_per_token`.
    """
    if out is None and torch.compiler.is_compiling():
        return _static_op(x, scale)
    return _static_eager(x, scale, out)


def _static_eager(
    x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel launch of :func:`quantize_static`, outside ``torch.compile``."""
    if scale.numel() != 1:
        raise ValueError(
            f"a static FP8 activation scale is one value, not shape {tuple(scale.shape)}; "
            "use quantize_per_token for one scale per row"
        )
    x, q = _rows(x, out)
    _launch(x, q, scale.reshape(1).to(torch.float32), static=True)
    return q


# -- the custom ops (what torch.compile sees) -------------------------------------------------


@torch.library.custom_op("backplane_models::fp8_act_quant", mutates_args=())
def _per_token_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = _per_token_eager(x)
    return q, scale


@_per_token_op.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=_FP8), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@torch.library.custom_op("backplane_models::fp8_act_quant_static", mutates_args=())
def _static_op(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _static_eager(x, scale)


@_static_op.register_fake
def _(x, scale):
    return x.new_empty(x.shape, dtype=_FP8)
