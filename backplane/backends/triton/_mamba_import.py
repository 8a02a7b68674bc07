"""The one place that loads mamba-ssm's Triton kernels.

``import mamba_ssm`` runs the package ``__init__``, which imports the compiled
CUDA extension (``selective_scan_cuda``) and the model classes; a source or
wheel install without that extension fails there, although the Triton kernels
under ``mamba_ssm.ops.triton`` need none of it. So this module registers
*empty* package objects for ``mamba_ssm``, ``mamba_ssm.ops`` and
``mamba_ssm.utils`` (with their real ``__path__``) in ``sys.modules`` and then
imports only the Triton submodules; their own absolute imports
(``from mamba_ssm.ops.triton.ssd_bmm import ...``) resolve through those
packages. Afterwards every ``mamba_ssm`` entry this module added is removed
from ``sys.modules`` again (the loaded functions keep their modules alive), so
no other code in the process sees a half-initialised ``mamba_ssm``: a later
``import mamba_ssm`` behaves as if this module had never run. If ``mamba_ssm``
was already imported (a full install), that package is used as is.

Under ``TRITON_INTERPRET=1`` on a CPU-only torch, the kernels' launchers wrap
launches in ``torch.cuda.device(x.device.index)``, which fails for CPU tensors
(index ``None``); there, the loaded modules see a ``torch`` whose
``cuda.device(None)`` is a no-op context, and each autotuned kernel keeps only
its smallest config (autotuning benchmarks on a GPU driver the interpreter does
not have). On CUDA the modules are left as they are, and each autotuner is made
an :class:`~backplane.backends.triton._autotune.AheadAutotuner` (compiled
ahead at start-up, timed briefly; see that module).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

#: The Triton submodules the SSM backend uses.
TRITON_MODULES = (
    "mamba_ssm.ops.triton.selective_state_update",
    "mamba_ssm.ops.triton.ssd_combined",
)

#: The autotuned kernels of the packed prefill (:func:`load`'s ``prefill_autotuners``).
PREFILL_KERNELS = (
    "_chunk_cumsum_fwd_kernel",
    "_chunk_state_fwd_kernel",
    "_state_passing_fwd_kernel",
    "_bmm_chunk_fwd_kernel",
    "_chunk_scan_fwd_kernel",
    "_chunk_state_varlen_kernel",
)


class _CudaNoDevice:
    """``torch.cuda`` with ``device(None)`` turned into a no-op (CPU interpreter only)."""

    def __init__(self, cuda: Any) -> None:
        self._cuda = cuda

    def device(self, index: Any) -> Any:
        if index is None:
            return contextlib.nullcontext()
        return self._cuda.device(index)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cuda, name)


class _TorchForInterpreter:
    """Forwards to ``torch``, except for ``torch.cuda.device(None)`` (see the module docstring)."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self.cuda = _CudaNoDevice(torch.cuda)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def _stub_package(name: str, path: str) -> None:
    module = types.ModuleType(name)
    module.__path__ = [path]  # a package: submodules are found under path
    module.__package__ = name
    # A real spec keeps importlib.util.find_spec(name) working after the stub is registered.
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__spec__.submodule_search_locations = [path]
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, module)


def _block_volume(config: Any) -> int:
    volume = 1
    for key, value in config.kwargs.items():
        if key.startswith("BLOCK_SIZE") and isinstance(value, int):
            volume *= value
    return volume


def _autotuners() -> list[tuple[str, Any]]:
    """``(name, autotuner)`` of every autotuned kernel in the loaded mamba-ssm Triton modules."""
    from triton.runtime.autotuner import Autotuner

    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("mamba_ssm.ops.triton."):
            continue
        for attr, value in vars(module).items():
            if isinstance(value, Autotuner):
                found.append((attr, value))
    return found


def _adapt_for_cuda() -> None:
    """CUDA only: every autotuner compiles ahead at start-up and times briefly (``_autotune``)."""
    from backplane.backends.triton import _autotune

    for _, tuner in _autotuners():
        _autotune.adapt(tuner)


def _adapt_for_interpreter(torch: Any) -> None:
    """CPU interpreter only: no-op ``torch.cuda.device(None)``, one config per autotuner."""
    from triton.runtime.autotuner import Autotuner

    proxy = _TorchForInterpreter(torch)
    for name, module in list(sys.modules.items()):
        if not name.startswith("mamba_ssm.ops.triton."):
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = proxy
        for value in vars(module).values():
            if isinstance(value, Autotuner) and len(value.configs) > 1:
                value.configs = [min(value.configs, key=_block_volume)]


@functools.cache
def load() -> types.SimpleNamespace:
    """Import mamba-ssm's Triton kernels without running its package ``__init__``.

    :return: a namespace with ``selective_state_update`` (decode), the stages of
        the chunked scan's forward that the packed prefill composes
        (``chunk_cumsum_fwd``, ``chunk_state_fwd``, ``state_passing_fwd``,
        ``bmm_chunk_fwd``, ``chunk_scan_fwd``, ``chunk_state_varlen``) and
        ``mamba_chunk_scan_combined_fwd`` (the whole forward of
        ``mamba_chunk_scan_combined``, without its autograd wrapper);
        ``prefill_autotuners``: ``{name: autotuner}`` of :data:`PREFILL_KERNELS`.
    :raises ImportError: mamba-ssm (or einops, which its modules import) is missing.
    """
    stubbed = "mamba_ssm" not in sys.modules
    before = set(sys.modules)
    if stubbed:
        spec = importlib.util.find_spec("mamba_ssm")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("python package 'mamba_ssm' is not installed (pip install mamba-ssm)")
        root = list(spec.submodule_search_locations)[0]
        _stub_package("mamba_ssm", root)
        _stub_package("mamba_ssm.ops", os.path.join(root, "ops"))
        _stub_package("mamba_ssm.utils", os.path.join(root, "utils"))
    modules = [importlib.import_module(name) for name in TRITON_MODULES]
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    import torch

    if interpreting and not torch.cuda.is_available():
        _adapt_for_interpreter(torch)
    elif not interpreting and torch.cuda.is_available():
        _adapt_for_cuda()
    tuners = dict(_autotuners())
    if stubbed:
        for name in set(sys.modules) - before:
            if name == "mamba_ssm" or name.startswith("mamba_ssm."):
                del sys.modules[name]
    ssu, combined = modules
    return types.SimpleNamespace(
        selective_state_update=ssu.selective_state_update,
        chunk_cumsum_fwd=combined._chunk_cumsum_fwd,
        chunk_state_fwd=combined._chunk_state_fwd,
        state_passing_fwd=combined._state_passing_fwd,
        bmm_chunk_fwd=combined._bmm_chunk_fwd,
        chunk_scan_fwd=combined._chunk_scan_fwd,
        chunk_state_varlen=combined.chunk_state_varlen,
        mamba_chunk_scan_combined_fwd=combined._mamba_chunk_scan_combined_fwd,
        prefill_autotuners={name: tuners[name] for name in PREFILL_KERNELS if name in tuners},
    )
