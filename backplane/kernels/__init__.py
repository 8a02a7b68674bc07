"""The kernel room: Triton kernels for the fused elementwise work and one-row projections.

The package sits between :mod:`backplane.core` and the layers that call
kernels: it imports only ``backplane.core`` (launch helpers), and
:mod:`backplane.models` and :mod:`backplane.backends` may import it. The
kernels (:mod:`.elementwise`, :mod:`.gemv`) import ``triton``; this package
does not, so its callers import cleanly without it. :func:`unavailable_reason`
(from :mod:`.availability`) says whether the kernels can run on a device;
:func:`load`, :func:`load_gemv`, :func:`load_qgemv`, :func:`load_act_quant`
(FP8 activation quantisation) and :func:`load_moe_gemv` (few-token MoE
experts) import them.
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
    "load_gemv",
    "load_moe_gemv",
    "load_qgemv",
    "unavailable_reason",
]


@functools.cache
def load() -> ModuleType:
    """Import the kernels (and ``triton``) once and return :mod:`.elementwise`.

    :return: the module.
    :raises ImportError: when ``triton`` cannot be imported.
    """
    return importlib.import_module("backplane.kernels.elementwise")


@functools.cache
def load_gemv() -> ModuleType:
    """Import the one-row projection kernel once and return :mod:`.gemv`.

    :return: the module.
    :raises ImportError: when ``triton`` cannot be imported.
    """
    return importlib.import_module("backplane.kernels.gemv")


@functools.cache
def load_qgemv() -> ModuleType:
    """Import the quantised one-row projection kernel once and return :mod:`.qgemv`.

    :return: the module.
    :raises ImportError: when ``triton`` cannot be imported.
    """
    return importlib.import_module("backplane.kernels.qgemv")


@functools.cache
def load_act_quant() -> ModuleType:
    """Import the FP8 activation quantisation kernel once and return :mod:`.act_quant`.

    :return: the module.
    :raises ImportError: when ``triton`` cannot be imported.
    """
    return importlib.import_module("backplane.kernels.act_quant")


@functools.cache
def load_moe_gemv() -> ModuleType:
    """Import the few-token MoE expert kernels once and return :mod:`.moe_gemv`.

    :return: the module.
    :raises ImportError: when ``triton`` cannot be imported.
    """
    return importlib.import_module("backplane.kernels.moe_gemv")
