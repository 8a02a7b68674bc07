"""The options the ``backplane bench`` commands share: one parser each, the same errors everywhere."""

from __future__ import annotations

import argparse

import pytest

from backplane.cli import build_parser
from backplane.cli.bench.options import csv_list, csv_or_none, family_backend, int_list


def test_int_list_parses_integers_and_none_only_where_allowed() -> None:
    assert int_list("1,8")(" 1, 8,,16 ") == [1, 8, 16]
    assert int_list("64,128", allow_none=True)("None") == []
    with pytest.raises(argparse.ArgumentTypeError, match=r"such as 1,8, got 'none'"):
        int_list("1,8")("none")
    with pytest.raises(argparse.ArgumentTypeError, match=r"such as 64,128 \(or none\)"):
        int_list("64,128", allow_none=True)("64,x")


def test_csv_lists() -> None:
    assert csv_list("a, b,,c") == ["a", "b", "c"]
    assert csv_or_none(" none ") == [] and csv_or_none("eager") == ["eager"]


@pytest.mark.parametrize("text", ["ssm", "=triton", "ssm=", " = "])
def test_family_backend_refuses_a_half_pair(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="FAMILY=NAME"):
        family_backend(text)


def test_family_backend_pair() -> None:
    assert family_backend(" ssm = triton ") == ("ssm", "triton")


@pytest.mark.parametrize(
    ("argv", "dest", "value"),
    [
        (["bench", "latency", "--batch-sizes", "2,4"], "batch_sizes", [2, 4]),
        (["bench", "latency", "--backend", "ssm=torch"], "backend", [("ssm", "torch")]),
        (["bench", "latency", "--json", "x.json"], "json", "x.json"),
        (["bench", "throughput", "--decode-batch-sizes", "none"], "decode_batch_sizes", []),
        (["bench", "throughput", "--json", "t.json"], "json", "t.json"),
        (["bench", "serve", "--json"], "json", True),
        (["bench", "cpu", "--json"], "json", True),
    ],
)
def test_every_benchmark_parses_the_shared_options(argv: list[str], dest: str, value) -> None:
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value
    assert callable(args.func)


def test_bad_integer_list_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "throughput", "--decode-batch-sizes", "8,x"])
    assert exc.value.code == 2
    assert "--decode-batch-sizes" in capsys.readouterr().err
