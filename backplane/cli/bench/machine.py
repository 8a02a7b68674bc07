"""The machine a benchmark ran on: device, CPU and the versions the figures depend on."""

from __future__ import annotations

import contextlib
import os
import platform
from typing import Any


def _package_version(dist: str, module: str) -> str | None:
    """The installed version of ``dist``, else its module's ``__version__``.

    :param dist: the distribution's name (``flashinfer-python``).
    :param module: the module it installs (``flashinfer``), for builds without metadata.
    :return: the version, ``"unknown"`` if the module has none, ``None`` if it is not installed.
    """
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    try:
        mod = __import__(module)
    except Exception:
        return None
    return str(getattr(mod, "__version__", "unknown"))


def machine_info(device: Any) -> dict[str, Any]:
    """Describe the machine and the software versions that the figures depend on.

    :param device: the ``torch.device`` measured.
    :return: GPU name and memory (``None`` on CPU), CPU, versions of python,
        numpy, torch (and its CUDA), triton, flashinfer, transformers and backplane.
    """
    import torch

    from backplane import __version__

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "device": str(device),
        "gpu": None,
        "gpu_memory_gib": None,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": _package_version("numpy", "numpy"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _package_version("triton", "triton"),
        "flashinfer": _package_version("flashinfer-python", "flashinfer"),
        "transformers": _package_version("transformers", "transformers"),
        "backplane": __version__,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return info
