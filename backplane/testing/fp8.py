"""What the conformance kit's FP8 KV-cache cases share: the rounding and the tolerance.

A backend that declares ``supports_fp8_kv_cache`` stores ``x / scale`` in
``float8_e4m3fn``, rounded to nearest-even and saturated at +-448 (e4m3fn has
no infinity), exactly as :func:`to_fp8` does; the kit compares its output with
a float64 reference over the rows as the cache holds them, dequantised.
"""

from __future__ import annotations

import torch

#: ``(atol, rtol)`` of an FP8-cache case against the float64 reference over the
#: keys and values as the cache holds them (dequantised): room for kernels that
#: scale in another order or attend to the step's own keys before rounding.
FP8_KV_TOLERANCE = (2e-2, 2e-2)


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` rounded to e4m3, saturated at its largest value.

    :param x: the rows (any float dtype).
    :param scale: the layer's scale.
    :return: a ``float8_e4m3fn`` tensor of ``x``'s shape.
    """
    limit = torch.finfo(torch.float8_e4m3fn).max
    return (x.double() / scale).clamp(-limit, limit).to(torch.float8_e4m3fn)


def dequantised(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` as an FP8 cache holds it, read back: ``to_fp8(x, scale) * scale`` in float64.

    :param x: the rows.
    :param scale: the layer's scale.
    :return: a float64 tensor of ``x``'s shape.
    """
    return to_fp8(x, scale).double() * scale
