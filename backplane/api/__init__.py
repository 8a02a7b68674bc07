"""The Python API: :class:`LLM` (offline and streaming generation over the engine).

The modules: ``llm`` (:class:`LLM`) and ``outputs`` (:class:`RequestOutput`,
:class:`CompletionOutput`, :class:`RequestMetrics`).
"""

from __future__ import annotations

from backplane.api.llm import LLM, ConcurrentUseError, Prompt
from backplane.api.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = [
    "CompletionOutput",
    "ConcurrentUseError",
    "LLM",
    "Prompt",
    "RequestMetrics",
    "RequestOutput",
]
