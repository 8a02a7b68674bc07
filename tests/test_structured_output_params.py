"""StructuredOutputsParams: one constraint, checked when built, accepted by SamplingParams."""

from __future__ import annotations

import json

import pytest

import backplane
from backplane.core.errors import InvalidFieldError
from backplane.engine.sampling import SamplingParams, StructuredOutputsParams


def test_each_kind_is_accepted_and_named() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = {
        "json": StructuredOutputsParams(json=schema),
        "regex": StructuredOutputsParams(regex=r"\d+"),
        "choice": StructuredOutputsParams(choice=["yes", "no"]),
        "grammar": StructuredOutputsParams(grammar='root ::= "a"'),
        "json_object": StructuredOutputsParams(json_object=True),
    }
    for kind, params in cases.items():
        assert params.kind == kind
    assert cases["choice"].choice == ("yes", "no")
    assert cases["json"].schema == schema


def test_a_schema_as_a_string_equals_the_dict() -> None:
    schema = {"type": "object", "required": ["b", "a"]}
    as_text = StructuredOutputsParams(json=json.dumps(schema, indent=2))
    as_dict = StructuredOutputsParams(json=schema)
    assert as_text == as_dict
    assert hash(as_text) == hash(as_dict)
    assert as_text.schema == schema


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"regex": "a", "choice": ["a"]},
        {"json_object": False},
        {"regex": ""},
        {"choice": []},
        {"choice": ["a", 1]},
        {"grammar": "  "},
        {"json": "{not json"},
        {"json": "[1, 2]"},
        {"json": 3},
    ],
)
def test_not_one_valid_constraint_is_refused(fields: dict) -> None:
    with pytest.raises(InvalidFieldError) as err:
        StructuredOutputsParams(**fields)
    assert err.value.field == "structured_outputs"
    with pytest.raises(InvalidFieldError) as err:
        SamplingParams(structured_outputs=fields)
    assert err.value.field == "structured_outputs"


def test_sampling_params_takes_a_dict_or_the_object() -> None:
    from_dict = SamplingParams(structured_outputs={"regex": "[ab]+", "json": None})
    assert isinstance(from_dict.structured_outputs, StructuredOutputsParams)
    assert from_dict.structured_outputs.regex == "[ab]+"
    obj = StructuredOutputsParams(choice=["x"])
    assert SamplingParams(structured_outputs=obj).structured_outputs is obj
    assert SamplingParams().structured_outputs is None


def test_unknown_keys_and_wrong_types_are_refused_with_the_field() -> None:
    with pytest.raises(InvalidFieldError, match="unknown key 'regexp'"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(InvalidFieldError, match="not str"):
        SamplingParams(structured_outputs="json")


def test_exported_from_the_package_root() -> None:
    assert backplane.StructuredOutputsParams is StructuredOutputsParams
    assert "StructuredOutputsParams" in backplane.__all__
