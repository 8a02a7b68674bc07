"""One Triton kernel per fused elementwise function of :mod:`backplane.models.fused`.

* :func:`rms_norm` and :func:`add_rms_norm` — RMS normalisation of rows, the
  latter adding the residual first and writing both the normed rows and the
  new residual stream in the same kernel;
* :func:`gated_rms_norm` — RMS normalisation gated by ``silu(gate)``, in groups;
* :func:`act_and_mul` and :func:`activation` — gated (over a ``[gate | up]``
  projection output) and plain activations;
* :func:`rotary_` and :func:`rotary_interleaved` — the rotary embedding, in
  place over strided ``[T, heads, head_dim]`` views (the queries and keys of a
  fused projection output in one launch), or de-interleaving into a new tensor.

Every kernel repeats the rounding steps of the torch function it stands for:
float32 arithmetic, with a rounding to the activations' dtype wherever the
torch function produces a tensor of that dtype, and no fused multiply-adds
(every launch passes ``enable_fp_fusion=False``). Where the torch function
reduces (the mean square of a norm) the summation order differs, so results
agree to the last bit of the activations' dtype, not always bit for bit.

In the Triton interpreter (CPU tests) the casts to bfloat16 truncate, so the
kernels round to bfloat16 themselves there; the device kernels cast.

Under ``torch.compile`` each function is a ``torch.library`` custom op
(``backplane_models::*``), opaque to the tracer; eager calls launch directly,
without the op dispatch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from backplane.core.launch import KernelLauncher, cdiv, dependent_launch, int_key, next_pow2
from backplane.kernels.availability import interpreting

#: activation names the kernels compute (the keys of :data:`ACT_CODES`)
ACT_CODES: dict[str, int] = {"silu": 0, "relu": 1, "relu2": 2, "gelu": 3, "gelu_tanh": 4}

#: widest row (norms: the normalised size or group) one program handles
MAX_ROW = 32768

#: dtypes the kernels read and write
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: kernels run in the Triton interpreter (CPU tensors)
INTERPRET = interpreting()
# Torch's elementwise CUDA kernels call the CUDA math library (libdevice) for
# exp/erf/tanh; the interpreter has no libdevice and uses numpy's functions.
_EXACT_MATH = not INTERPRET
_LAUNCH = {"enable_fp_fusion": False}


@functools.cache
def _pdl(device: int | None) -> dict[str, bool]:
    """The ``PDL`` constant (and launch option) of a launch on ``device``: a programmatic
    dependent launch where the device takes one (see
    :func:`~backplane.core.launch.dependent_launch`), so that a decode graph's chain of
    projections, norms and rotations overlaps each kernel's start with the one before."""
    on = not INTERPRET and device is not None and dependent_launch(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))


# -- device helpers --------------------------------------------------------------------------


@triton.jit
def _round(x, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """Round float32 ``x`` to ``DT``'s precision (round to nearest even); return float32."""
    if DT == tl.float32:
        y = x
    elif INTERPRET and DT == tl.bfloat16:
        # The interpreter's float32 -> bfloat16 cast truncates: round on the bits.
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(DT).to(tl.float32)
    return y


@triton.jit
def _exp(x, EXACT: tl.constexpr):
    if EXACT:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _silu(x, EXACT: tl.constexpr):
    # torch: x / (1 + exp(-x)), an IEEE division
    return tl.math.div_rn(x, 1.0 + _exp(-x, EXACT))


@triton.jit
def _act(x, ACT: tl.constexpr, EXACT: tl.constexpr):
    """The activation in float32 (before the rounding to the tensor dtype)."""
    if ACT == 0:
        y = _silu(x, EXACT)
    elif ACT == 1:
        y = tl.where(x > 0, x, 0.0)
    elif ACT == 2:
        r = tl.where(x > 0, x, 0.0)
        y = r * r
    elif ACT == 3:
        # torch: x * 0.5 * (1 + erf(x * M_SQRT1_2))
        if EXACT:
            e = libdevice.erf(x * 0.7071067811865476)
        else:
            e = tl.math.erf(x * 0.7071067811865476)
        y = x * 0.5 * (1.0 + e)
    else:
        # torch: 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))
        inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
        if EXACT:
            th = libdevice.tanh(inner)
        else:
            th = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        y = 0.5 * x * (1.0 + th)
    return y


@triton.jit
def _after_previous(PDL: tl.constexpr):
    """With ``PDL`` (a programmatic dependent launch), let the next kernel's programs be
    scheduled now (a projection then loads its first weight tiles while this kernel runs)
    and wait until the kernel before is done: every read and write comes after this."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _inv_rms(x, n, eps):
    """``1 / sqrt(mean(x^2) + eps)`` of a float32 row (masked lanes hold zeros)."""
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.sum(x * x, axis=0) / n + eps))


# -- kernels --------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_inner,
    dim,
    sx0,
    sx1,
    sr0,
    sr1,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    _after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    i0 = row // n_inner
    i1 = row % n_inner
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + i0 * sx0 + i1 * sx1 + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + i0 * sr0 + i1 * sr1 + offs, mask=mask, other=0.0).to(tl.float32)
        # the residual stream is the sum in the activations' dtype
        x = _round(x + r, x_ptr.dtype.element_ty, INTERPRET)
        tl.store(res_out_ptr + row * dim + offs, x.to(x_ptr.dtype.element_ty), mask=mask)
    normed = x * _inv_rms(x, dim, eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        out = normed * (1.0 + w)
    else:
        out = w * _round(normed, x_ptr.dtype.element_ty, INTERPRET)
    out = _round(out, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + row * dim + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    out_ptr,
    n_inner,
    n_groups,
    group,
    sx0,
    sx1,
    sz0,
    sz1,
    eps,
    NORM_BEFORE_GATE: tl.constexpr,
    ROUND_SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    EXACT: tl.constexpr,
    PDL: tl.constexpr,
):
    _after_previous(PDL)
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_groups
    col = (pid % n_groups) * group + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < group
    i0 = row // n_inner
    i1 = row % n_inner
    x = tl.load(x_ptr + i0 * sx0 + i1 * sx1 + col, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + i0 * sz0 + i1 * sz1 + col, mask=mask, other=0.0).to(tl.float32)
    gate = _silu(z, EXACT)
    if not NORM_BEFORE_GATE:
        x = x * gate
    normed = _round(x * _inv_rms(x, group, eps), x_ptr.dtype.element_ty, INTERPRET)
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    scaled = w * normed
    if ROUND_SCALED:
        # weight and input share a dtype: the scaled value is a tensor of it
        scaled = _round(scaled, x_ptr.dtype.element_ty, INTERPRET)
    if NORM_BEFORE_GATE:
        out = _round(scaled * gate, out_ptr.dtype.element_ty, INTERPRET)
    else:
        out = _round(scaled, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + row * n_groups * group + col, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_kernel(
    x_ptr,
    out_ptr,
    n_cols,
    sx,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    EXACT: tl.constexpr,
    PDL: tl.constexpr,
):
    _after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(x_ptr + row * sx + offs, mask=mask, other=0.0).to(tl.float32)
    y = _round(_act(g, ACT, EXACT), x_ptr.dtype.element_ty, INTERPRET)
    if GATED:
        u = tl.load(x_ptr + row * sx + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        y = _round(y * u, x_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + row * n_cols + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(x1, x2, c, s, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """Rotate pairs ``(x1, x2)`` by ``(cos, sin)`` with torch's roundings to ``DT``:
    ``x1_sin = x1 * sin; x1 = x1 * cos - x2 * sin; x2 = x2 * cos + x1_sin``."""
    x1_sin = _round(x1 * s, DT, INTERPRET)
    o1 = _round(_round(x1 * c, DT, INTERPRET) - _round(x2 * s, DT, INTERPRET), DT, INTERPRET)
    o2 = _round(_round(x2 * c, DT, INTERPRET) + x1_sin, DT, INTERPRET)
    return o1, o2


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_heads,
    half,
    n_tail,
    sxt,
    sxh,
    sct,
    sst,
    sot,
    soh,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    _after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    hmask = heads < n_heads
    rmask = r < half
    mask = hmask[:, None] & rmask[None, :]
    c = tl.load(cos_ptr + t * sct + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * sst + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
    src = x_ptr + t * sxt + heads[:, None] * sxh
    if INTERLEAVED:
        first = 2 * r
        second = 2 * r + 1
    else:
        first = r
        second = r + half
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1, x2, c, s, x_ptr.dtype.element_ty, INTERPRET)
    dst = out_ptr + t * sot + heads[:, None] * soh
    tl.store(dst + r[None, :], o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half + r[None, :], o2.to(out_ptr.dtype.element_ty), mask=mask)
    if BLOCK_TAIL > 0:
        tail = tl.arange(0, BLOCK_TAIL)
        tmask = hmask[:, None] & (tail < n_tail)[None, :]
        v = tl.load(src + 2 * half + tail[None, :], mask=tmask, other=0.0)
        tl.store(dst + 2 * half + tail[None, :], v, mask=tmask)


@triton.jit
def _head_norm_rotary_kernel(
    x_ptr,
    w1_ptr,
    w2_ptr,
    cos_ptr,
    sin_ptr,
    n_first,
    n_heads,
    half,
    sxt,
    sxh,
    sct,
    sst,
    eps,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    _after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    hmask = heads < n_heads
    rmask = r < half
    mask = hmask[:, None] & rmask[None, :]
    src = x_ptr + t * sxt + heads[:, None] * sxh
    x1 = tl.load(src + r[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + r[None, :], mask=mask, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    # the rms_norm kernel's arithmetic, per head (the mean square over both halves)
    inv = tl.math.div_rn(
        1.0, tl.math.sqrt_rn((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * half) + eps)
    )
    first = (heads < n_first)[:, None]
    wa1 = tl.load(w1_ptr + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
    wa2 = tl.load(w1_ptr + half + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
    wb1 = tl.load(w2_ptr + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
    wb2 = tl.load(w2_ptr + half + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
    g1 = tl.where(first, wa1, wb1)
    g2 = tl.where(first, wa2, wb2)
    n1 = x1 * inv[:, None]
    n2 = x2 * inv[:, None]
    if ZERO_CENTERED:
        y1 = _round(n1 * (1.0 + g1), dt, INTERPRET)
        y2 = _round(n2 * (1.0 + g2), dt, INTERPRET)
    else:
        y1 = _round(g1 * _round(n1, dt, INTERPRET), dt, INTERPRET)
        y2 = _round(g2 * _round(n2, dt, INTERPRET), dt, INTERPRET)
    # then the rotary kernel's
    c = tl.load(cos_ptr + t * sct + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * sst + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
    o1, o2 = _rotate(y1, y2, c, s, dt, INTERPRET)
    tl.store(src + r[None, :], o1.to(dt), mask=mask)
    tl.store(src + half + r[None, :], o2.to(dt), mask=mask)


# -- launchers ------------------------------------------------------------------------------
_RMS_NORM = KernelLauncher(_rms_norm_kernel)
_GATED_RMS_NORM = KernelLauncher(_gated_rms_norm_kernel)
_ACT = KernelLauncher(_act_kernel)
_ROTARY = KernelLauncher(_rotary_kernel)
_HEAD_NORM_ROTARY = KernelLauncher(_head_norm_rotary_kernel)

# The ``out`` buffers they take must be new contiguous tensors of the result's
# shape and dtype (tests hand in poisoned ones).


def _rows3(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[A, B, D]`` with unit stride in ``D`` (a copy only when no such view exists)."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    return x.flatten(0, -3)


def _rows2(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[R, D]`` with unit stride in ``D`` (a copy only when no such view exists)."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        x = x.contiguous()
    return x.reshape(1, -1) if x.dim() == 1 else x.flatten(0, -2)


def _norm_out_dtype(x: torch.Tensor, weight: torch.Tensor, zero_centered: bool) -> torch.dtype:
    return x.dtype if zero_centered else torch.promote_types(weight.dtype, x.dtype)


def _launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    out: torch.Tensor,
    res_out: torch.Tensor | None,
) -> None:
    if out.numel() == 0:
        return
    if (
        x.dim() == 2
        and x.stride(1) == 1
        and (residual is None or (residual.dim() == 2 and residual.stride(1) == 1))
    ):
        # The models' [tokens, hidden] rows: a key of their own, cheaper than
        # one derived argument by argument (every decode step norms like this).
        r = x if residual is None else residual
        ro = out if res_out is None else res_out
        dim = x.shape[1]
        args = (x, r, weight, out, ro, 1, dim, x.stride(0), 0, r.stride(0), 0, float(eps))
        if (
            not (x.data_ptr() | r.data_ptr() | weight.data_ptr() | out.data_ptr() | ro.data_ptr())
            & 15
        ):
            device = x.device.index
            key = (
                dim,
                x.dtype,
                r.dtype,
                weight.dtype,
                out.dtype,
                ro.dtype,
                int_key(args[7]),
                int_key(args[9]),
                residual is not None,
                bool(zero_centered),
            )
            hit = _RMS_NORM.lookup(key, device)
            if hit is not None:
                hit.launch(x.shape[0], 1, 1, device, *args)
                return
            block = next_pow2(dim)
            _RMS_NORM(
                key,
                (x.shape[0],),
                args,
                device,
                HAS_RESIDUAL=residual is not None,
                ZERO_CENTERED=bool(zero_centered),
                BLOCK=block,
                INTERPRET=INTERPRET,
                num_warps=_warps(block),
                **_LAUNCH,
                **_pdl(device),
            )
            return
    x3 = _rows3(x)
    r3 = _rows3(residual) if residual is not None else x3
    dim = x3.shape[-1]
    block = next_pow2(dim)
    _RMS_NORM.launch(
        (x3.shape[0] * x3.shape[1],),
        (
            x3,
            r3,
            weight,
            out,
            res_out if res_out is not None else out,
            x3.shape[1],
            dim,
            x3.stride(0),
            x3.stride(1),
            r3.stride(0),
            r3.stride(1),
            float(eps),
        ),
        x3.device.index,
        HAS_RESIDUAL=residual is not None,
        ZERO_CENTERED=bool(zero_centered),
        BLOCK=block,
        INTERPRET=INTERPRET,
        num_warps=_warps(block),
        **_LAUNCH,
        **_pdl(x3.device.index),
    )


def _rms_norm_eager(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if out is None:
        dtype = _norm_out_dtype(x, weight, zero_centered)
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _launch_rms_norm(x, None, weight, eps, zero_centered, out, None)
    return out


def _add_rms_norm_eager(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    out: torch.Tensor | None = None,
    res_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        dtype = _norm_out_dtype(x, weight, zero_centered)
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if res_out is None:
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, residual, weight, eps, zero_centered, out, res_out)
    return out, res_out


def _gated_rms_norm_eager(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    mid = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        dtype = x.dtype if norm_before_gate else mid
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if out.numel() == 0:
        return out
    x3, z3 = _rows3(x), _rows3(gate)
    dim = x3.shape[-1]
    block = next_pow2(group_size)
    n_groups = dim // group_size
    _GATED_RMS_NORM.launch(
        (x3.shape[0] * x3.shape[1] * n_groups,),
        (
            x3,
            z3,
            weight,
            out,
            x3.shape[1],
            n_groups,
            group_size,
            x3.stride(0),
            x3.stride(1),
            z3.stride(0),
            z3.stride(1),
            float(eps),
        ),
        x3.device.index,
        NORM_BEFORE_GATE=bool(norm_before_gate),
        ROUND_SCALED=mid == x.dtype,
        BLOCK=block,
        INTERPRET=INTERPRET,
        EXACT=_EXACT_MATH,
        num_warps=_warps(block),
        **_LAUNCH,
        **_pdl(x3.device.index),
    )
    return out


def _act_eager(
    x: torch.Tensor, act: str, gated: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    n_cols = x.shape[-1] // 2 if gated else x.shape[-1]
    if out is None:
        out = torch.empty((*x.shape[:-1], n_cols), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = _rows2(x)
    block = min(next_pow2(n_cols), 1024)
    _ACT.launch(
        (x2.shape[0], cdiv(n_cols, block)),
        (
            x2,
            out,
            n_cols,
            x2.stride(0),
        ),
        x2.device.index,
        ACT=ACT_CODES[act],
        GATED=bool(gated),
        BLOCK=block,
        INTERPRET=INTERPRET,
        EXACT=_EXACT_MATH,
        num_warps=max(1, min(4, block // 256)),
        **_LAUNCH,
        **_pdl(x2.device.index),
    )
    return out


def _rotary_tiles(heads: int, half: int) -> tuple[int, int, int]:
    """``(BLOCK_H, BLOCK_R, warps)`` of a rotary launch: heads of ``2 * half`` channels, up to
    4096 pairs a program."""
    block_r = next_pow2(half)
    block_h = min(next_pow2(heads), max(1, 4096 // block_r))
    return block_h, block_r, max(1, min(8, block_h * block_r // 512))


def _launch_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, interleaved: bool
) -> None:
    t, heads, dim = x.shape
    half = cos.shape[-1]
    if t == 0 or heads == 0 or half == 0:
        if interleaved and out.numel():
            out.copy_(x)
        return
    block_h, block_r, warps = _rotary_tiles(heads, half)
    n_tail = dim - 2 * half if interleaved else 0
    _ROTARY.launch(
        (t, cdiv(heads, block_h)),
        (
            x,
            cos,
            sin,
            out,
            heads,
            half,
            n_tail,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            sin.stride(0),
            out.stride(0),
            out.stride(1),
        ),
        x.device.index,
        INTERLEAVED=bool(interleaved),
        BLOCK_H=block_h,
        BLOCK_R=block_r,
        BLOCK_TAIL=next_pow2(n_tail) if n_tail > 0 else 0,
        INTERPRET=INTERPRET,
        num_warps=warps,
        **_LAUNCH,
        **_pdl(x.device.index),
    )


def _head_norm_rotary_eager_(
    x: torch.Tensor,
    n_first: int,
    first_weight: torch.Tensor,
    second_weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    t, heads, dim = x.shape
    half = dim // 2
    if t == 0 or heads == 0:
        return
    block_h, block_r, warps = _rotary_tiles(heads, half)
    _HEAD_NORM_ROTARY.launch(
        (t, cdiv(heads, block_h)),
        (
            x,
            first_weight,
            second_weight,
            cos,
            sin,
            n_first,
            heads,
            half,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            sin.stride(0),
            float(eps),
        ),
        x.device.index,
        ZERO_CENTERED=bool(zero_centered),
        BLOCK_H=block_h,
        BLOCK_R=block_r,
        INTERPRET=INTERPRET,
        num_warps=warps,
        **_LAUNCH,
        # Measured slower as a dependent launch: Qwen3-8B at batch 1 on an H200,
        # 4.715 -> 4.794 ms per token.
        PDL=False,
    )


def _rotary_eager_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    _launch_rotary(x, cos, sin, x, interleaved=False)


def _rotary_interleaved_eager(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rotary(x, cos, sin, out, interleaved=True)
    return out


# -- the custom ops (what torch.compile sees) -------------------------------------------------


@torch.library.custom_op("backplane_models::rms_norm", mutates_args=())
def _rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> torch.Tensor:
    return _rms_norm_eager(x, weight, eps, zero_centered)


@_rms_norm_op.register_fake
def _(x, weight, eps, zero_centered):
    return x.new_empty(x.shape, dtype=_norm_out_dtype(x, weight, zero_centered))


@torch.library.custom_op("backplane_models::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _add_rms_norm_eager(x, residual, weight, eps, zero_centered)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, zero_centered):
    out = x.new_empty(x.shape, dtype=_norm_out_dtype(x, weight, zero_centered))
    return out, x.new_empty(x.shape)


@torch.library.custom_op("backplane_models::gated_rms_norm", mutates_args=())
def _gated_rms_norm_op(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
) -> torch.Tensor:
    return _gated_rms_norm_eager(x, gate, weight, eps, group_size, norm_before_gate)


@_gated_rms_norm_op.register_fake
def _(x, gate, weight, eps, group_size, norm_before_gate):
    dtype = x.dtype if norm_before_gate else torch.promote_types(weight.dtype, x.dtype)
    return x.new_empty(x.shape, dtype=dtype)


@torch.library.custom_op("backplane_models::act", mutates_args=())
def _act_op(x: torch.Tensor, act: str, gated: bool) -> torch.Tensor:
    return _act_eager(x, act, gated)


@_act_op.register_fake
def _(x, act, gated):
    n_cols = x.shape[-1] // 2 if gated else x.shape[-1]
    return x.new_empty((*x.shape[:-1], n_cols))


@torch.library.custom_op("backplane_models::rotary_", mutates_args=("x",))
def _rotary_op_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    _rotary_eager_(x, cos, sin)


@_rotary_op_.register_fake
def _(x, cos, sin):
    return None


@torch.library.custom_op("backplane_models::head_norm_rotary_", mutates_args=("x",))
def _head_norm_rotary_op_(
    x: torch.Tensor,
    n_first: int,
    first_weight: torch.Tensor,
    second_weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    _head_norm_rotary_eager_(x, n_first, first_weight, second_weight, eps, zero_centered, cos, sin)


@_head_norm_rotary_op_.register_fake
def _(x, n_first, first_weight, second_weight, eps, zero_centered, cos, sin):
    return None


@torch.library.custom_op("backplane_models::rotary_interleaved", mutates_args=())
def _rotary_interleaved_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rotary_interleaved_eager(x, cos, sin)


@_rotary_interleaved_op.register_fake
def _(x, cos, sin):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# -- the public functions ---------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x`` in one kernel (see :func:`~backplane.models.fused.rms_norm`).

    :param x: ``[..., D]``, the last dimension of unit stride (else copied).
    :param weight: ``[D]`` contiguous.
    :param eps: added to the mean square.
    :param zero_centered: scale by ``1 + weight`` in float32.
    :return: a new contiguous tensor, in ``x.dtype`` (zero-centred) or the
        promotion of ``weight.dtype`` and ``x.dtype``.
    """
    if torch.compiler.is_compiling():
        return _rms_norm_op(x, weight, eps, zero_centered)
    return _rms_norm_eager(x, weight, eps, zero_centered)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + x`` and its RMS norm, both written by one kernel.

    :param x: ``[..., D]``.
    :param residual: ``[..., D]``, the dtype of ``x``.
    :param weight: ``[D]`` contiguous.
    :param eps: added to the mean square.
    :param zero_centered: see :func:`rms_norm`.
    :return: ``(normed, new residual)``, new contiguous tensors.
    """
    if torch.compiler.is_compiling():
        return _add_rms_norm_op(x, residual, weight, eps, zero_centered)
    return _add_rms_norm_eager(x, residual, weight, eps, zero_centered)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
) -> torch.Tensor:
    """RMS norm gated by ``silu(gate)`` over groups of ``group_size`` channels, in one kernel.

    :param x: ``[..., D]``, ``D`` a multiple of ``group_size``.
    :param gate: the shape of ``x``.
    :param weight: ``[D]`` contiguous.
    :param eps: added to each group's mean square.
    :param group_size: channels normalised together.
    :param norm_before_gate: ``norm(x) * silu(gate)`` (else ``norm(x * silu(gate))``).
    :return: a new contiguous tensor (see :class:`~backplane.models.norm.GatedRMSNorm` for its dtype).
    """
    if torch.compiler.is_compiling():
        return _gated_rms_norm_op(x, gate, weight, eps, group_size, norm_before_gate)
    return _gated_rms_norm_eager(x, gate, weight, eps, group_size, norm_before_gate)


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` over ``[..., 2I]`` (the gate channels first), in one kernel.

    :param x: ``[..., 2I]``.
    :param act: a key of :data:`ACT_CODES`.
    :return: a new contiguous ``[..., I]`` tensor.
    """
    if torch.compiler.is_compiling():
        return _act_op(x, act, True)
    return _act_eager(x, act, True)


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """``act(x)`` in one kernel.

    :param x: any shape.
    :param act: a key of :data:`ACT_CODES`.
    :return: a new contiguous tensor.
    """
    if torch.compiler.is_compiling():
        return _act_op(x, act, False)
    return _act_eager(x, act, False)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(i, i + h)`` of ``x`` in place, in one kernel.

    :param x: ``[T, H, D]``, the last dimension of unit stride (any other strides).
    :param cos: ``[T, 1, h]`` (or ``[T, h]``), unit stride in ``h``, ``x.dtype``.
    :param sin: like ``cos``.
    :return: ``x``.
    """
    if torch.compiler.is_compiling():
        _rotary_op_(x, cos, sin)
    else:
        _rotary_eager_(x, cos, sin)
    return x


def head_norm_rotary_(
    x: torch.Tensor,
    n_first: int,
    first_weight: torch.Tensor,
    second_weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """RMS-normalise every head of ``x`` and rotate its channel pairs ``(i, i + D/2)``, in
    place, in one kernel: what :func:`rms_norm` and :func:`rotary_` do one after the other
    to a Qwen3 layer's queries and keys, rounded the same way.

    :param x: ``[T, H, D]``, the last dimension of unit stride (any other strides): the
        query heads then the key heads of a fused projection output.
    :param n_first: heads normalised with ``first_weight`` (the queries); the rest take
        ``second_weight``.
    :param first_weight: ``[D]`` contiguous, in ``x.dtype`` (unless ``zero_centered``).
    :param second_weight: like ``first_weight``.
    :param eps: added to the mean square.
    :param zero_centered: scale by ``1 + weight`` in float32.
    :param cos: ``[T, 1, D/2]`` (or ``[T, D/2]``), unit stride in the last dimension, ``x.dtype``.
    :param sin: like ``cos``.
    :return: ``x``.
    """
    if torch.compiler.is_compiling():
        _head_norm_rotary_op_(x, n_first, first_weight, second_weight, eps, zero_centered, cos, sin)
    else:
        _head_norm_rotary_eager_(
            x, n_first, first_weight, second_weight, eps, zero_centered, cos, sin
        )
    return x


def rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(2i, 2i + 1)`` of ``x`` into a new de-interleaved tensor, in one kernel.

    :param x: ``[T, H, D]``, the last dimension of unit stride (not modified).
    :param cos: ``[T, 1, h]`` (or ``[T, h]``), unit stride in ``h``, ``x.dtype``.
    :param sin: like ``cos``.
    :return: a new contiguous ``[T, H, D]`` tensor.
    """
    if torch.compiler.is_compiling():
        return _rotary_interleaved_op(x, cos, sin)
    return _rotary_interleaved_eager(x, cos, sin)
