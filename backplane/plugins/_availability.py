"""Cheap availability checks shared by the in-tree plugins (no heavy imports at module load)."""

from __future__ import annotations

import importlib.util
import os


def module_missing(name: str) -> str | None:
    """Return a reason when ``name`` cannot be imported, without importing it."""
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"python package '{name}' is not installed"


def cuda_reason() -> str | None:
    """Return a reason when no CUDA device is usable (imports torch lazily)."""
    missing = module_missing("torch")
    if missing:
        return missing
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return None


def triton_interpret() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
