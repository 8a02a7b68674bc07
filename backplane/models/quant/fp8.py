"""The FP8 (e4m3) number format: quantising, dequantising and scale layouts.

A quantised weight ``W [out, in]`` is stored as ``q = W / s`` rounded to
``float8_e4m3fn`` with float32 scales ``s`` (``W ~= q * s``). Checkpoints
store scales per tensor (one value), per output channel (``[out, 1]``) or per
``bn x bk`` block (``[ceil(out / bn), ceil(in / bk)]``, DeepSeek-V3's
``weight_scale_inv``, which despite its name multiplies). The model keeps every
granularity in one *row form*, ``[out, ceil(in / bk)]``: one scale per output
row and input block of ``bk`` columns (``bk = in`` for tensor and channel
scales). Row form survives merging projections (q/k/v of different scales
stacked in one matrix) and block rows that straddle two merged parts.
"""

from __future__ import annotations

from types import ModuleType

import torch

from backplane import kernels

#: the storage dtype of FP8 weights, activations and caches
FP8_DTYPE = torch.float8_e4m3fn
#: the largest finite e4m3 value
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
#: ``1 / FP8_MAX``, rounded to float32 where it multiplies a float32 maximum
INV_FP8_MAX = 1.0 / FP8_MAX
#: the smallest scale used, so that an all-zero row or block does not divide by zero
MIN_SCALE = 1e-12


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round ``x / scale`` to e4m3, saturating at +-448.

    :param x: the values (any float dtype).
    :param scale: broadcastable to ``x``.
    :return: ``x / scale`` in :data:`FP8_DTYPE`.
    """
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight(
    weight: torch.Tensor, granularity: str, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight matrix as a checkpoint stores it.

    :param weight: ``[out, in]``.
    :param granularity: ``"tensor"``, ``"channel"`` or ``"block"``.
    :param block: ``(bn, bk)`` rows and columns of a block (``"block"`` only).
    :return: ``(q, scale)``: ``q`` in e4m3 and the float32 scale in checkpoint
        form (``[1]``, ``[out, 1]`` or ``[ceil(out / bn), ceil(in / bk)]``).
    :raises ValueError: an unknown granularity.
    """
    w = weight.float()
    if granularity == "tensor":
        scale = (w.abs().amax() / FP8_MAX).clamp(min=MIN_SCALE).reshape(1)
        return to_fp8(w, scale), scale
    if granularity == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        return to_fp8(w, scale), scale
    if granularity == "block":
        bn, bk = block
        out, cols = w.shape
        nb, kb = -(-out // bn), -(-cols // bk)
        padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
        padded[:out, :cols] = w
        blocks = padded.view(nb, bn, kb, bk)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
        q = to_fp8(blocks, scale[:, None, :, None]).view(nb * bn, kb * bk)[:out, :cols]
        return q.contiguous(), scale
    raise ValueError(
        f"unknown FP8 weight granularity {granularity!r}; use tensor, channel or block"
    )


def row_scales(
    scale: torch.Tensor, rows: int, cols: int, granularity: str, block: tuple[int, int]
) -> torch.Tensor:
    """Turn a checkpoint's weight scale into row form (see the module docstring).

    :param scale: the checkpoint's scale of a ``[rows, cols]`` weight.
    :param rows: the weight's output rows.
    :param cols: the weight's input columns.
    :param granularity: ``"tensor"``, ``"channel"`` or ``"block"``.
    :param block: ``(bn, bk)`` for ``"block"``.
    :return: float32 ``[rows, ceil(cols / bk)]`` (``[rows, 1]`` for tensor and channel).
    :raises ValueError: the scale's shape does not fit the weight.
    """
    s = scale.float()
    if granularity == "block":
        bn, bk = block
        want = (-(-rows // bn), -(-cols // bk))
        if tuple(s.shape) != want:
            raise ValueError(
                f"block scale of shape {tuple(s.shape)} does not fit a [{rows}, {cols}] weight "
                f"in {bn}x{bk} blocks (expected {want})"
            )
        return s.repeat_interleave(bn, dim=0)[:rows].contiguous()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(rows, 1).contiguous()
    if s.numel() == rows:
        return s.reshape(rows, 1).contiguous()
    raise ValueError(
        f"scale of shape {tuple(s.shape)} fits neither one value nor one per row of a "
        f"[{rows}, {cols}] weight"
    )


def dequantize_rows(
    q: torch.Tensor, scales: torch.Tensor, block_k: int, dtype: torch.dtype
) -> torch.Tensor:
    """``q * s`` for a weight with row-form scales.

    :param q: ``[out, in]`` e4m3 values.
    :param scales: ``[out, ceil(in / block_k)]`` float32.
    :param block_k: input columns per scale.
    :param dtype: the result's dtype.
    :return: ``[out, in]`` in ``dtype``.
    """
    cols = q.shape[1]
    s = scales if scales.shape[1] == 1 else scales.repeat_interleave(block_k, dim=1)[:, :cols]
    return (q.float() * s).to(dtype)


#: activation dtypes the quantisation kernel reads
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: CUDA devices (``str(device)``) and the activation quantisation kernels' module there, or
#: ``None`` where they do not run (the module is held so that a compiled caller needs no import)
_KERNEL: dict[str, ModuleType | None] = {}


def _kernel(x: torch.Tensor) -> ModuleType | None:
    """:mod:`backplane.kernels.act_quant` where it quantises ``x``: a CUDA tensor of a dtype it
    reads, Triton installed, compute capability 8.9 or higher (e4m3 conversions); else ``None``.
    """
    if not x.is_cuda or x.dtype not in _KERNEL_DTYPES or x.dim() == 0 or x.shape[-1] == 0:
        return None
    key = str(x.device)
    if key not in _KERNEL:
        runs = kernels.unavailable_reason(x.device) is None
        runs = runs and torch.cuda.get_device_capability(x.device) >= (8, 9)
        _KERNEL[key] = kernels.load_act_quant() if runs else None
    return _KERNEL[key]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantisation, one scale per row.

    On CUDA (compute capability 8.9 and up, Triton installed) one kernel
    (:func:`backplane.kernels.act_quant.quantize_per_token`) writes both
    results, bit for bit those of :func:`quantize_per_token_eager`, which
    runs everywhere else.

    :param x: ``[..., K]``.
    :return: ``(q [..., K] e4m3, scale [..., 1] float32)`` with ``x ~= q * scale``.
    """
    kernel = _kernel(x)
    if kernel is not None:
        q, scale = kernel.quantize_per_token(x.reshape(-1, x.shape[-1]))
        return q.view(x.shape), scale.view(*x.shape[:-1], 1)
    return quantize_per_token_eager(x)


def quantize_per_token_eager(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_per_token` in torch operations (the reference of the kernel).

    :param x: ``[..., K]``.
    :return: ``(q [..., K] e4m3, scale [..., 1] float32)`` with ``x ~= q * scale``.
    """
    # times the float32 reciprocal, not divided: torch's CUDA division by a Python
    # number multiplies by its reciprocal while the CPU divides, and the kernel's
    # scales are to equal this on every device
    scale = (x.float().abs().amax(dim=-1, keepdim=True) * INV_FP8_MAX).clamp(min=MIN_SCALE)
    return to_fp8(x, scale), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static activation quantisation: :func:`to_fp8` with one scale for every value.

    On CUDA (as for :func:`quantize_per_token`) one kernel
    (:func:`backplane.kernels.act_quant.quantize_static`) writes ``q``, bit for
    bit :func:`to_fp8`'s, which runs everywhere else.

    :param x: ``[..., K]``.
    :param scale: one value (any shape of one element), e.g. a checkpoint's ``input_scale``.
    :return: ``q [..., K]`` e4m3 with ``x ~= q * scale``.
    """
    kernel = _kernel(x) if scale.numel() == 1 and scale.device == x.device else None
    if kernel is not None:
        q = kernel.quantize_static(x.reshape(-1, x.shape[-1]), scale)
        return q.view(x.shape)
    return to_fp8(x, scale.float().reshape(1))


def quantize_per_block(x: torch.Tensor, block_k: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantisation, one scale per row and ``block_k`` columns.

    :param x: ``[M, K]``.
    :param block_k: columns per scale.
    :return: ``(q [M, K] e4m3, scale [M, ceil(K / block_k)] float32)`` with
        ``x ~= q * scale`` blockwise.
    """
    rows, cols = x.shape
    kb = -(-cols // block_k)
    padded = torch.zeros(rows, kb * block_k, dtype=torch.float32, device=x.device)
    padded[:, :cols] = x.float()
    blocks = padded.view(rows, kb, block_k)
    scale = (blocks.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = to_fp8(blocks, scale[..., None]).view(rows, kb * block_k)[:, :cols]
    return q.contiguous(), scale
