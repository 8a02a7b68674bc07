"""The Python API: :class:`LLM` (offline and streaming generation over the engine).

The modules: ``llm`` (:class:`LLM`, its outputs and request metrics).
"""

from __future__ import annotations

from backplane.api.llm import LLM, Prompt, RequestMetrics, RequestOutput

__all__ = ["LLM", "Prompt", "RequestMetrics", "RequestOutput"]
