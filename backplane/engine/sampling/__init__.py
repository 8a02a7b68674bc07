"""Sampling: the parameters of a request and their one validation table, the batched
sampler, logits processing (penalties, ``min_tokens``) and logprobs.

Modules, bottom to top: :mod:`.params` (:class:`SamplingParams`,
:data:`FIELD_RULES`, :func:`check_field`, :func:`check_for_model`),
:mod:`.structured` (:class:`StructuredOutputsParams`),
:mod:`.rows` (what one step samples), :mod:`.logprobs`, :mod:`.processing`
and :mod:`.sampler` (:class:`Sampler`, the counter-based noise, the filters).
Every name is re-exported here.
"""

from backplane.engine.sampling.logprobs import (
    Logprob,
    LogprobsTensors,
    compute_logprobs,
    logprob_dicts,
)
from backplane.engine.sampling.params import (
    FIELD_RULES,
    FLOAT32_MAX,
    FLOAT32_TINY,
    MAX_LOGPROBS,
    MAX_N,
    MIN_TEMPERATURE,
    SamplingParams,
    as_params_list,
    check_field,
    check_for_model,
    seed_as_int64,
)
from backplane.engine.sampling.processing import (
    apply_processing,
    apply_token_bitmask,
    host_to_device,
)
from backplane.engine.sampling.rows import (
    GrammarBitmask,
    LogitsProcessing,
    PromptLogprobRows,
    SamplingRows,
    TokenPairs,
)
from backplane.engine.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingTensors,
    apply_filters,
    exponential_noise,
    param_arrays,
)
from backplane.engine.sampling.structured import StructuredOutputsParams, as_structured_outputs

__all__ = [
    "FIELD_RULES",
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "MAX_LOGPROBS",
    "MAX_N",
    "MIN_TEMPERATURE",
    "GrammarBitmask",
    "Logprob",
    "LogitsProcessing",
    "LogprobsTensors",
    "PromptLogprobRows",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingRows",
    "SamplingTensors",
    "StructuredOutputsParams",
    "TokenPairs",
    "apply_filters",
    "apply_processing",
    "apply_token_bitmask",
    "as_params_list",
    "as_structured_outputs",
    "check_field",
    "check_for_model",
    "compute_logprobs",
    "exponential_noise",
    "host_to_device",
    "logprob_dicts",
    "param_arrays",
    "seed_as_int64",
]
