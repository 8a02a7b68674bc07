"""An FP8 projection: :class:`Fp8Projection`, and :func:`convert_linear` turning a
:class:`~backplane.models.linear.Linear` into one.

A converted projection keeps its ``weight`` parameter in e4m3 and gains a
float32 ``weight_scale`` parameter in row form (see
:mod:`backplane.models.quant.fp8`), so checkpoint names, merged row slices and
``.to()`` work as for any parameter. Its product runs:

* on CUDA devices of compute capability 8.9 and up (Ada, Hopper), for one
  scale per weight row: the activations quantised per token (or with the
  checkpoint's static ``input_scale``) and ``torch._scaled_mm`` with row-wise
  scales, in the activations' dtype;
* elsewhere (the CPU, older GPUs, block scales, shapes ``_scaled_mm`` does not
  take): the weight dequantised to the activations' dtype and the ordinary
  :func:`~backplane.models.linear.dense` product. This path's results equal
  those of a full-precision model holding the dequantised weights.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from backplane.models.linear import Linear, dense
from backplane.models.quant.fp8 import (
    FP8_DTYPE,
    dequantize_rows,
    quantize_per_token,
    quantize_weight,
    to_fp8,
)

logger = logging.getLogger(__name__)

#: devices (``str(device)``) that ran ``torch._scaled_mm``, or failed it once
_SCALED_MM: dict[str, bool] = {}


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether FP8 matrix products can run on ``device`` (CUDA, capability 8.9 or higher).

    :param device: a tensor's device.
    :return: ``True`` where :func:`torch._scaled_mm` is tried.
    """
    key = str(device)
    known = _SCALED_MM.get(key)
    if known is None:
        known = (
            device.type == "cuda"
            and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9)
        )
        _SCALED_MM[key] = known
    return known


class Fp8Projection:
    """How an FP8 :class:`~backplane.models.linear.Linear` computes its product.

    Held as the projection's ``quant`` attribute; the tensors stay on the
    module (``weight``, ``weight_scale``, and ``input_scale`` for static
    activation scales).

    :param block_k: input columns per weight scale (the weight's width for one
        scale per row).
    :param static: the activations use the module's ``input_scale``.
    """

    def __init__(self, block_k: int, static: bool = False) -> None:
        self.block_k = int(block_k)
        self.static = bool(static)

    def apply(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + bias`` for the FP8 weight of ``linear``.

        :param linear: the converted projection.
        :param x: ``[..., in_features]`` in a float dtype.
        :return: ``[..., out_features]`` in ``x``'s dtype.
        """
        w, scales = linear.weight, linear.weight_scale
        if scales.shape[1] == 1 and self._fast(x, w):
            try:
                return self._scaled_mm(linear, x)
            except RuntimeError as exc:
                # e.g. a torch build whose _scaled_mm lacks row-wise scales on this GPU
                logger.warning(
                    "torch._scaled_mm failed on %s (%s); FP8 projections dequantise their "
                    "weights there from now on",
                    x.device,
                    exc,
                )
                _SCALED_MM[str(x.device)] = False
        return dense(x, dequantize_rows(w, scales, self.block_k, x.dtype), linear.bias)

    def _fast(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        out, cols = w.shape
        return (
            x.dtype in (torch.bfloat16, torch.float16)
            and out % 16 == 0
            and cols % 16 == 0
            and scaled_mm_supported(x.device)
        )

    def _scaled_mm(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.static:
            scale_a = linear.input_scale.float().reshape(1, 1).expand(rows.shape[0], 1)
            qx = to_fp8(rows, scale_a)
        else:
            qx, scale_a = quantize_per_token(rows)
        y = torch._scaled_mm(
            qx,
            linear.weight.t(),
            scale_a=scale_a.contiguous(),
            scale_b=linear.weight_scale.reshape(1, -1),
            bias=linear.bias,
            out_dtype=x.dtype,
        )
        return y.view(*x.shape[:-1], y.shape[-1])


def convert_linear(linear: Linear, block_k: int | None, *, static: bool = False) -> None:
    """Give ``linear`` an (uninitialised) FP8 weight and row-form scales, to be loaded.

    :param linear: a full-precision projection (its weight is replaced).
    :param block_k: input columns per scale, ``None`` for one scale per row.
    :param static: the activations use a static ``input_scale`` (a buffer,
        set while loading).
    """
    out, cols = linear.weight.shape
    device = linear.weight.device
    k = cols if block_k is None else int(block_k)
    linear.weight = nn.Parameter(
        torch.empty(out, cols, dtype=FP8_DTYPE, device=device), requires_grad=False
    )
    linear.weight_scale = nn.Parameter(
        torch.ones(out, -(-cols // k), dtype=torch.float32, device=device), requires_grad=False
    )
    if static:
        linear.register_buffer("input_scale", torch.ones(1, dtype=torch.float32, device=device))
    linear.quant = Fp8Projection(k, static=static)


def quantize_linear(linear: Linear) -> None:
    """Quantise a loaded full-precision projection in place: e4m3 weight, one scale per row.

    The activations are quantised dynamically, per token, where the device
    multiplies in FP8.

    :param linear: the projection, its weight loaded.
    """
    with torch.no_grad():
        q, scale = quantize_weight(linear.weight, "channel")
        convert_linear(linear, None)
        linear.weight.copy_(q)
        linear.weight_scale.copy_(scale)
