"""Triton kernels for the models' fused elementwise work and one-row projections.

The kernels (:mod:`.elementwise`, :mod:`.gemv`) import ``triton``; this package
does not, so the models import cleanly without it. :func:`unavailable_reason`
says whether the kernels can run on a device, :func:`load` and
:func:`load_gemv` import them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType

import torch


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``).

    The interpreter runs kernels on CPU tensors, which is how the kernels are
    tested without a GPU; it reads the variable when ``triton`` is first imported.

    :return: whether ``TRITON_INTERPRET`` is set to something other than ``0``.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason(device: torch.device | str) -> str | None:
    """Say why the Triton kernels cannot run on ``device``, or ``None`` when they can.

    They run on CUDA devices, and on the CPU only in the Triton interpreter.

    :param device: where the model's tensors live.
    :return: the reason, or ``None``.
    """
    dev = torch.device(device)
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available here"
        return None
    if dev.type == "cpu" and interpreting():
        return None
    return f"Triton kernels need a CUDA device, not {dev.type!r} (TRITON_INTERPRET=1 for CPU tests)"


@functools.cache
def load() -> ModuleType:
    """Import the kernels (and ``triton``) once and return :mod:`.elementwise`.

    :return: the module.
    :raises ImportError: when ``triton`` cannot be imported.
    """
    return importlib.import_module("backplane.models.kernels.elementwise")


@functools.cache
def load_gemv() -> ModuleType:
    """Import the one-row projection kernel once and return :mod:`.gemv`.

    :return: the module.
    :raises ImportError: when ``triton`` cannot be imported.
    """
    return importlib.import_module("backplane.models.kernels.gemv")
