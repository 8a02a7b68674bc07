"""The Python API: :class:`LLM` (offline and streaming generation over the engine).

The modules: ``llm`` (:class:`LLM`), ``async_llm`` (:class:`AsyncLLM`: one engine
loop for many concurrent callers), ``outputs`` (:class:`RequestOutput`,
:class:`CompletionOutput`, :class:`RequestMetrics`), ``output_processor``
(incremental detokenising and stop handling: tokens to outputs), ``stop`` (stop-string
limits and matching), ``chat`` (chat templates), ``prompts`` (prompts, parameters and
request ids checked before queueing), ``guard`` (one thread at a time in an ``LLM``),
``data_parallel`` (the devices of ``AsyncLLM``'s engine replicas) and ``balancing``
(which replica runs a request).
"""

from __future__ import annotations

from backplane.api.async_llm import (
    AsyncLLM,
    AsyncRequestStream,
    EngineDeadError,
    EngineOverloadedError,
    EngineSnapshot,
    RequestStream,
)
from backplane.api.llm import LLM, ConcurrentUseError, Prompt
from backplane.api.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = [
    "AsyncLLM",
    "AsyncRequestStream",
    "CompletionOutput",
    "ConcurrentUseError",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineSnapshot",
    "LLM",
    "Prompt",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
]
