"""The kernel room: Triton kernels for the fused elementwise work and one-row projections.

The package sits between :mod:`backplane.core` and the layers that call
kernels: it imports only ``backplane.core`` (launch helpers), and
:mod:`backplane.models` and :mod:`backplane.backends` may import it. The
kernels (:mod:`.elementwise`, :mod:`.gemv`) import ``triton``; this package
does not, so its callers import cleanly without it. :func:`unavailable_reason`
(from :mod:`.availability`) says whether the kernels can run on a device;
:func:`load` imports one of them by name (``load_gemv``, ``load_qgemv``,
``load_act_quant``, ``load_moe_gemv``, ``load_qgemv_packed``,
``load_qgemv_packed_q6k`` and ``load_fp8_few_rows`` are :func:`load` bound to one
module).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from backplane.kernels.availability import interpreting, unavailable_reason

__all__ = [
    "interpreting",
    "load",
    "load_act_quant",
    "load_fp8_few_rows",
    "load_gemv",
    "load_moe_gemv",
    "load_qgemv",
    "load_qgemv_packed",
    "load_qgemv_packed_q6k",
    "unavailable_reason",
]


#: the kernel modules :func:`load` imports, by name
MODULES = (
    "elementwise",
    "gemv",
    "qgemv",
    "qgemv_packed",
    "qgemv_packed_q6k",
    "act_quant",
    "moe_gemv",
    "fp8_few_rows",
)


@functools.cache
def load(name: str = "elementwise") -> ModuleType:
    """Import one kernel module (and ``triton``) once and return it.

    :param name: one of :data:`MODULES`: ``elementwise`` (the fused elementwise
        functions), ``gemv`` (one-row projections), ``qgemv`` (GGUF-quantised
        ones), ``qgemv_packed`` (Q4_K repacked for them), ``qgemv_packed_q6k``
        (Q6_K repacked for them), ``act_quant`` (FP8
        activation quantisation), ``moe_gemv`` (few-token MoE experts) or
        ``fp8_few_rows`` (FP8 products of a few rows).
    :return: the module.
    :raises ValueError: ``name`` is not a kernel module.
    :raises ImportError: when ``triton`` cannot be imported.
    """
    if name not in MODULES:
        raise ValueError(f"no kernel module {name!r}; the modules are: {', '.join(MODULES)}")
    return importlib.import_module(f"backplane.kernels.{name}")


#: :func:`load` of one module each, for the callers that use one
load_gemv = functools.partial(load, "gemv")
load_qgemv = functools.partial(load, "qgemv")
load_act_quant = functools.partial(load, "act_quant")
load_moe_gemv = functools.partial(load, "moe_gemv")
load_qgemv_packed = functools.partial(load, "qgemv_packed")
load_qgemv_packed_q6k = functools.partial(load, "qgemv_packed_q6k")
load_fp8_few_rows = functools.partial(load, "fp8_few_rows")
