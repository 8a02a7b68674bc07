"""An FP8 projection: :class:`Fp8Projection`, and :func:`convert_linear` turning a
:class:`~backplane.models.linear.Linear` into one.

A converted projection keeps its ``weight`` parameter in e4m3 and gains a
float32 ``weight_scale`` parameter in row form (see
:mod:`backplane.models.quant.fp8`), so checkpoint names, merged row slices and
``.to()`` work as for any parameter. Its product runs:

* for one input row (batch-1 decode) with ``fused_ops = "triton"``, on CUDA
  devices of compute capability 8.9 and up (and in the Triton interpreter):
  the one-row kernel of :mod:`backplane.kernels.gemv`, which reads the
  weight one byte per element and dequantises it as it goes (any scale
  layout), the activations staying in their dtype. The
  :class:`~backplane.models.linear.Linear` builds it, with whatever rides
  along (a pre-norm and residual add, the rotary embedding of the queries
  and keys, an activation, a gated MLP's product) as for a full-precision
  weight, from the scales :meth:`Fp8Projection.one_row_scales` gives it;
* on CUDA devices of compute capability 8.9 and up (Ada, Hopper), for one
  scale per weight row: the activations quantised per token (or with the
  checkpoint's static ``input_scale``; one kernel of
  :mod:`backplane.kernels.act_quant` either way) and ``torch._scaled_mm`` with
  row-wise scales, in the activations' dtype; up to
  :data:`backplane.kernels.fp8_few_rows.MAX_ROWS` rows (see its
  :func:`~backplane.kernels.fp8_few_rows.supports`) the product runs
  :mod:`backplane.kernels.fp8_few_rows` instead (not under ``torch.compile``),
  which reads the weight with every multiprocessor where cuBLAS's wide tiles
  leave most idle;
* elsewhere (the CPU, older GPUs, block scales, shapes ``_scaled_mm`` does not
  take): the weight dequantised to the activations' dtype and the ordinary
  :func:`~backplane.models.linear.dense` product. This path's results equal
  those of a full-precision model holding the dequantised weights.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from backplane import kernels
from backplane.models.linear import Linear, ScaledWeight, dense
from backplane.models.quant.fp8 import (
    FP8_DTYPE,
    dequantize_rows,
    quantize_per_token,
    quantize_static,
    quantize_weight,
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


#: CUDA devices (``str(device)``) and whether the one-row kernel reads e4m3 there
_ONE_ROW: dict[str, bool] = {}

#: activation dtypes the one-row kernel projects
ONE_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: output rows per scale of a block-scaled checkpoint (DeepSeek-V3's 128x128 blocks)
SCALE_BLOCK_ROWS = 128


def one_row_supported(device: torch.device) -> bool:
    """Whether the one-row kernel reads e4m3 weights on ``device``.

    Triton's e4m3 type needs compute capability 8.9 or higher; on the CPU the
    kernel runs only in the Triton interpreter (the tests).

    :param device: the activations' device.
    :return: ``True`` where one-row products run the kernel.
    """
    if device.type != "cuda":
        return kernels.interpreting()
    key = str(device)
    known = _ONE_ROW.get(key)
    if known is None:
        known = _ONE_ROW[key] = torch.cuda.get_device_capability(device) >= (8, 9)
    return known


def block_form(scales: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Row-form block scales shrunk back to one row per :data:`SCALE_BLOCK_ROWS` output rows,
    where every block of rows holds the same scales (a checkpoint's square blocks).

    The one-row kernel reads a scale per row and chunk: the block form is
    :data:`SCALE_BLOCK_ROWS` times fewer bytes to read beside the weight. A
    row form whose rows differ within a block (projections of different
    blocks merged at rows that are no multiple of the block) stays as it is.
    Compares on the device (a synchronisation): call it once per weight, not
    while a CUDA graph is captured (there the row form is kept).

    :param scales: ``[out, ceil(in / block_k)]`` float32 row-form scales.
    :return: ``(scales, rows per scale)``: the block form and
        :data:`SCALE_BLOCK_ROWS`, or ``scales`` and 1.
    """
    rows = scales.shape[0]
    if rows <= 1 or (scales.is_cuda and torch.cuda.is_current_stream_capturing()):
        return scales, 1
    first = torch.arange(rows, device=scales.device) // SCALE_BLOCK_ROWS * SCALE_BLOCK_ROWS
    if not torch.equal(scales, scales[first]):
        return scales, 1
    return scales[::SCALE_BLOCK_ROWS].contiguous(), SCALE_BLOCK_ROWS


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

    def apply(self, linear: Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """``x @ W^T + bias`` for the FP8 weight of ``linear``, where the one-row kernel does not
        run it (:meth:`~backplane.models.linear.Linear.forward` tries that first).

        :param linear: the converted projection.
        :param x: ``[..., in_features]`` in a float dtype.
        :param bias: add ``linear.bias`` (if it has one).
        :return: ``[..., out_features]`` in ``x``'s dtype.
        """
        w, scales = linear.weight, linear.weight_scale
        b = linear.bias if bias else None
        if scales.shape[1] == 1 and self._fast(x, w):
            try:
                return self._scaled_mm(linear, x, b)
            except RuntimeError as exc:
                # e.g. a torch build whose _scaled_mm lacks row-wise scales on this GPU
                logger.warning(
                    "torch._scaled_mm failed on %s (%s); FP8 projections dequantise their "
                    "weights there from now on",
                    x.device,
                    exc,
                )
                _SCALED_MM[str(x.device)] = False
        return dense(x, dequantize_rows(w, scales, self.block_k, x.dtype), b)

    def one_row_key(self, linear: Linear, x: torch.Tensor) -> tuple | None:
        """What the one-row projections of ``linear`` are built from, or ``None`` where the
        kernel does not read e4m3 weights for ``x``.

        :param linear: the converted projection.
        :param x: a one-row input.
        :return: the weight's and scales' storage, the scales' version (a
            block-form copy is taken of them) and ``x``'s dtype.
        """
        if x.dtype not in ONE_ROW_DTYPES or not one_row_supported(x.device):
            return None
        scales = linear.weight_scale
        return (linear.weight.data_ptr(), scales.data_ptr(), scales._version, x.dtype)

    def one_row_scales(self, linear: Linear) -> ScaledWeight:
        """The scales of ``linear`` as the one-row kernel reads them: one per row, or block
        scales shrunk to one row per block where the checkpoint's blocks allow (see
        :func:`block_form`).

        :param linear: the converted projection.
        :return: the scales and their layout.
        """
        scales = linear.weight_scale
        if scales.shape[1] == 1:
            return ScaledWeight(scales, None, 1)
        scale, scale_n = block_form(scales)
        return ScaledWeight(scale, self.block_k, scale_n)

    def _fast(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        out, cols = w.shape
        return (
            x.dtype in (torch.bfloat16, torch.float16)
            and out % 16 == 0
            and cols % 16 == 0
            and scaled_mm_supported(x.device)
        )

    def _scaled_mm(
        self, linear: Linear, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.static:
            scale_a = linear.input_scale.float().reshape(1, 1).expand(rows.shape[0], 1)
            qx = quantize_static(rows, linear.input_scale)
        else:
            qx, scale_a = quantize_per_token(rows)
        few = _few_rows(x.device)
        if few is not None and few.supports(rows.shape[0], linear.weight):
            y = few.scaled_mm(qx, linear.weight, scale_a, linear.weight_scale, bias, x.dtype)
        else:
            y = torch._scaled_mm(
                qx,
                linear.weight.t(),
                scale_a=scale_a.contiguous(),
                scale_b=linear.weight_scale.reshape(1, -1),
                bias=bias,
                out_dtype=x.dtype,
            )
        return y.view(*x.shape[:-1], y.shape[-1])


#: CUDA devices (``str(device)``) and the few-row FP8 product's module, held so that a
#: caller need not import it again
_FEW_ROWS: dict[str, ModuleType] = {}


def _few_rows(device: torch.device) -> ModuleType | None:
    """:mod:`backplane.kernels.fp8_few_rows` for products on ``device``, or ``None`` while
    ``torch.compile`` traces (it takes ``torch._scaled_mm`` there)."""
    if torch.compiler.is_compiling():
        return None
    key = str(device)
    module = _FEW_ROWS.get(key)
    if module is None:
        module = _FEW_ROWS[key] = kernels.load_fp8_few_rows()
    return module


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
