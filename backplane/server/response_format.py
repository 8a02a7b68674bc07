"""The body fields that ask for structured output: OpenAI's ``response_format`` and vLLM's
``structured_outputs``, as one :class:`~backplane.engine.sampling.StructuredOutputsParams`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backplane.core.errors import InvalidFieldError
from backplane.engine.sampling import StructuredOutputsParams, as_structured_outputs

_FORMATS = "'text', 'json_object' or 'json_schema'"


def structured_outputs_of(
    response_format: Any, structured_outputs: Any
) -> StructuredOutputsParams | None:
    """The constraint a request body asks for, checked for shape (not compiled yet).

    :param response_format: ``{"type": "text" | "json_object" | "json_schema", ...}``
        with ``json_schema: {"name", "schema", "strict", "description"}``, or ``None``.
    :param structured_outputs: vLLM's ``{"json" | "regex" | "choice" | "grammar" |
        "json_object": ...}``, or ``None``.
    :return: the constraint, or ``None`` when the body asks for none.
    :raises InvalidFieldError: naming ``response_format`` or ``structured_outputs``:
        a wrong shape, an unknown type, or both fields set.
    """
    from_format = _from_response_format(response_format)
    from_vllm = as_structured_outputs(structured_outputs)
    if from_format is not None and from_vllm is not None:
        raise InvalidFieldError(
            "response_format and structured_outputs both ask for a constraint on the output; "
            "send only one of them",
            field="structured_outputs",
        )
    return from_format if from_format is not None else from_vllm


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or "type" not in value:
        raise InvalidFieldError(
            f"response_format must be an object with a type ({_FORMATS})", field="response_format"
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise InvalidFieldError(
            f"response_format.type {kind!r} is not supported; use {_FORMATS}",
            field="response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping) or spec.get("schema") is None:
        raise InvalidFieldError(
            "response_format of type 'json_schema' needs json_schema: "
            '{"name": ..., "schema": {...}} with the JSON schema under "schema"',
            field="response_format",
        )
    try:
        return StructuredOutputsParams(json=spec["schema"])
    except InvalidFieldError as exc:
        raise InvalidFieldError(
            str(exc).replace("structured_outputs", "response_format.json_schema", 1),
            field="response_format",
        ) from None
