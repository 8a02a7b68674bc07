"""Whether the Triton kernels can run here, answered without importing ``triton``.

The kernel modules read :func:`interpreting` too, so it lives apart from the
package's ``__init__`` (which imports those modules on demand).
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["interpreting", "unavailable_reason"]


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
