"""backplane: an LLM inference engine for hybrid models with plugin kernel backends.

The public surface for plugin authors is :data:`hookimpl`, :class:`BackendSpec`
and :class:`Speed` (a backend's measured figures); applications use :class:`LLM`
(offline), :class:`AsyncLLM` (many concurrent callers), :class:`SamplingParams` and
:class:`StructuredOutputsParams` (a JSON schema, regex, choice or grammar for the output).
"""

from __future__ import annotations

from typing import Any

from backplane.core.backend_spec import BackendSpec, Speed
from backplane.core.hookspecs import hookimpl
from backplane.core.openmp import prefer_passive_waiting

# OpenMP reads its wait policy once, when torch loads it: set it before anything imports torch
prefer_passive_waiting()

__version__ = "0.1.0"

__all__ = [
    "AsyncLLM",
    "BackendSpec",
    "LLM",
    "SamplingParams",
    "Speed",
    "StructuredOutputsParams",
    "__version__",
    "hookimpl",
]


def __getattr__(name: str) -> Any:
    # The engine pulls in torch; keep `import backplane` cheap for plugin discovery.
    if name == "LLM":
        from backplane.api import LLM

        return LLM
    if name == "AsyncLLM":
        from backplane.api.async_llm import AsyncLLM

        return AsyncLLM
    if name == "SamplingParams":
        from backplane.engine.sampling import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from backplane.engine.sampling import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'backplane' has no attribute {name!r}")
