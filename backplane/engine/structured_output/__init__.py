"""Structured output: grammars that constrain what a request generates.

A grammar backend on xgrammar. :mod:`.vocabulary` describes the model's
tokenizer to it (once per engine), :mod:`.compiler` compiles each request's
:class:`~backplane.engine.sampling.StructuredOutputsParams` into a grammar
(cached, least recently used first out, and safe to call from any thread so
callers can compile off the engine loop), and :mod:`.manager` keeps one
matcher per request: it fills the step's token bitmask, which the sampler
applies on the device, and advances with every committed token.
"""

from backplane.engine.structured_output.compiler import GrammarCompiler
from backplane.engine.structured_output.manager import StructuredOutputManager
from backplane.engine.structured_output.vocabulary import tokenizer_info

__all__ = ["GrammarCompiler", "StructuredOutputManager", "tokenizer_info"]
