"""What a caller hands the API: prompts, sampling parameters and request ids, checked and spread.

Everything here runs before anything is queued, so a refused call leaves no trace.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from backplane.core.errors import InvalidFieldError, RequestError
from backplane.engine.sampling import SamplingParams

__all__ = [
    "Prompt",
    "as_prompt_list",
    "check_sampling_params",
    "params_per_prompt",
    "check_unique_ids",
    "split_samples",
]

#: A prompt: text (needs the model's tokenizer), a list of token ids or an int32 array.
Prompt = str | Sequence[int] | np.ndarray


def as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt or a list of prompts -> a list of prompts.

    :param prompts: text, token ids, an int32 array (1-D: one prompt, 2-D: one per
        row) or a list of those.
    :return: the prompts.
    :raises RequestError: none given, or something that is not a prompt.
    """
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        if prompts.ndim == 1:
            return [prompts]
        if prompts.ndim == 2:
            return list(prompts)
        raise RequestError(f"a token-id array prompt must be 1-D, got shape {prompts.shape}")
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise RequestError("no prompts given")
        if isinstance(prompts[0], numbers.Integral):
            return [prompts]  # one prompt of token ids
        return list(prompts)
    raise RequestError(
        f"prompts must be a string, a list of token ids, an int32 array or a list of those; "
        f"got {type(prompts).__name__}"
    )


def check_sampling_params(sampling_params: Any) -> SamplingParams:
    """Refuse anything but a :class:`SamplingParams` where one is expected.

    :param sampling_params: what the caller passed.
    :return: it, unchanged.
    :raises InvalidFieldError: (``field="sampling_params"``) it is something else.
    """
    if not isinstance(sampling_params, SamplingParams):
        hint = (
            "; build one with SamplingParams(**fields)"
            if isinstance(sampling_params, Mapping)
            else ""
        )
        raise InvalidFieldError(
            f"sampling_params must be a SamplingParams (or None for the model's defaults), got "
            f"{type(sampling_params).__name__}{hint}",
            field="sampling_params",
        )
    return sampling_params


def params_per_prompt(sampling_params: Any, n: int) -> list[SamplingParams]:
    """One :class:`SamplingParams` per prompt: one set broadcast, or one given per prompt.

    :param sampling_params: a :class:`SamplingParams` or a list (any iterable) of ``n`` of them.
    :param n: the number of prompts.
    :return: ``n`` parameter sets.
    :raises InvalidFieldError: (``field="sampling_params"``) a wrong type or length.
    """
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, (Mapping, str, bytes)) or not isinstance(
        sampling_params, Iterable
    ):
        check_sampling_params(sampling_params)  # raises, naming the type
    given = list(sampling_params)
    if len(given) != n:
        raise InvalidFieldError(
            f"got {len(given)} SamplingParams for {n} prompts; pass one, or one per prompt",
            field="sampling_params",
        )
    return [check_sampling_params(sp) for sp in given]


def check_unique_ids(
    ids: Iterable[str], in_use: Callable[[str], bool], seen: set[str] | None = None
) -> None:
    """Refuse request ids given twice, or held by a request the engine still has.

    :param ids: engine request ids one call would queue.
    :param in_use: ``in_use(id)`` is true for an id the engine holds.
    :param seen: ids of the same call checked before (updated with ``ids``).
    :raises InvalidFieldError: (``field="request_id"``) naming the first such id, or one
        that is not a non-empty string.
    """
    seen = set() if seen is None else seen
    for rid in ids:
        if not isinstance(rid, str) or not rid:
            raise InvalidFieldError(
                f"request_id must be a non-empty string, got {type(rid).__name__} {rid!r}",
                field="request_id",
            )
        if rid in seen:
            raise InvalidFieldError(
                f"request id {rid!r} is given twice; pass a unique request id per prompt "
                "(nothing was queued)",
                field="request_id",
            )
        seen.add(rid)
        if in_use(rid):
            raise InvalidFieldError(
                f"request id {rid!r} is already in use (a request keeps its id until step() "
                "returned its final output, aborted ones too); pass a unique request_id "
                "(nothing was queued)",
                field="request_id",
            )


def split_samples(sp: SamplingParams) -> list[SamplingParams]:
    """One :class:`SamplingParams` per sample of an ``n > 1`` request (``n == 1``: itself).

    Sample ``j`` of a seeded request uses ``seed + j`` (wrapped to 64 bits), so the
    samples differ and each is reproducible. Only sample 0 computes
    ``prompt_logprobs`` (they are the prompt's, the same for every sample).

    :param sp: the request's parameters.
    :return: ``sp.n`` parameter sets with ``n == 1``.
    """
    if sp.n == 1:
        return [sp]
    out = []
    for j in range(sp.n):
        seed = None if sp.seed is None else (sp.seed + j) % 2**64
        plp = sp.prompt_logprobs if j == 0 else None
        out.append(dataclasses.replace(sp, n=1, seed=seed, prompt_logprobs=plp))
    return out
