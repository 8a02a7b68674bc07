"""``backplane bench startup`` on the CPU: every phase printed, phases within the total, warm and cold."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from backplane.cli import build_parser, main
from backplane.cli.bench.startup.child import startup_result
from backplane.cli.bench.startup.run import cold_cache_env

#: the phases the command must report, as the command's documentation names them
REQUIRED_PHASES = (
    "import",
    "backend selection",
    "weight load",
    "memory profiling",
    "cache allocation",
    "graph capture",
    "kernel warm-up",
    "engine setup",
    "other",
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One warm + cold run of tiny-llama on the CPU, with the wall time around it."""
    tmp = tmp_path_factory.mktemp("startup")
    out = tmp / "startup.json"
    argv = [
        "bench", "startup", "--shapes", "tiny-llama", "--device", "cpu", "--cold",
        "--weights-dir", str(tmp / "weights"), "--json", str(out),
    ]  # fmt: skip
    stdout = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(stdout):
        rc = main(argv)
    wall = time.perf_counter() - start
    return {
        "rc": rc,
        "json": json.loads(out.read_text()),
        "text": stdout.getvalue(),
        "wall": wall,
    }


def test_command_succeeds_with_warm_and_cold_runs(run: dict[str, Any]) -> None:
    assert run["rc"] == 0, run["text"]
    (shape,) = run["json"]["shapes"]
    assert shape["shape"] == "tiny-llama"
    assert list(shape["runs"]) == ["warm", "cold"]
    for r in shape["runs"].values():
        assert r["status"] == "ok", r
        assert r["backends"] == {"attention": "torch"}
        assert r["graph_mode"] == "off"  # graphs need CUDA


def test_every_phase_is_reported_and_printed(run: dict[str, Any]) -> None:
    (shape,) = run["json"]["shapes"]
    lines = run["text"].splitlines()
    for state, r in shape["runs"].items():
        assert set(REQUIRED_PHASES) <= set(r["phases"]), (state, r["phases"])
    warm, cold = shape["runs"]["warm"], shape["runs"]["cold"]
    for name in REQUIRED_PHASES:
        row = [line for line in lines if line.strip().startswith(name + " ")]
        assert len(row) == 1, (name, run["text"])
        cells = row[0].split()[-2:]
        assert cells == [f"{warm['phases'][name]:.2f}", f"{cold['phases'][name]:.2f}"], row
    total = [line for line in lines if line.strip().startswith("total ")]
    assert total and total[0].split()[-2:] == [f"{warm['total']:.2f}", f"{cold['total']:.2f}"]


def test_phases_add_up_to_no_more_than_the_total(run: dict[str, Any]) -> None:
    (shape,) = run["json"]["shapes"]
    for r in shape["runs"].values():
        phases = r["phases"]
        assert all(v >= 0 for v in phases.values()), phases
        assert r["total"] > 0
        assert sum(phases.values()) <= r["total"] + 1e-6
        # the engine's own phases alone, without the remainder, stay within the total too
        assert sum(v for k, v in phases.items() if k != "other") <= r["total"] + 1e-6
        # real work was timed: a process import and a model load take time
        assert phases["import"] > 0.05 and phases["weight load"] > 0
        # a start-up measured inside the command cannot outlast the command
        assert r["total"] < run["wall"]


def test_cold_run_used_empty_caches_of_its_own(run: dict[str, Any]) -> None:
    (shape,) = run["json"]["shapes"]
    warm = shape["runs"]["warm"]["cache_dirs"]
    cold = shape["runs"]["cold"]["cache_dirs"]
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"):
        assert cold[var] and cold[var] != warm[var], var
        # the temporary directory is gone and this process never pointed at it
        assert not Path(cold[var]).exists()
        assert os.environ.get(var) != cold[var]
    roots = {str(Path(cold[v]).parent) for v in cold_cache_env("/x")}
    assert len(roots) == 1


def test_startup_result_keeps_phases_within_the_total() -> None:
    engine = {
        "phases": {"weight load": 2.0, "graph capture": 1.0, "other": 99.0},
        "details": {"capture decode batch 8 (first)": 0.5},
    }
    result = startup_result(spawned=10.0, imported=11.5, started=12.0, ready=16.0, engine=engine)
    # total = import 1.5 + engine 4.0; the engine's own "other" is recomputed, not added
    assert result["total"] == pytest.approx(5.5)
    assert result["phases"] == pytest.approx(
        {"import": 1.5, "weight load": 2.0, "graph capture": 1.0, "other": 1.0}
    )
    assert result["details"] == engine["details"]


def test_help_lists_startup_and_its_flags() -> None:
    parser = build_parser()
    bench = parser._subparsers._group_actions[0].choices["bench"]  # noqa: SLF001
    startup = bench._subparsers._group_actions[0].choices["startup"]  # noqa: SLF001
    text = startup.format_help()
    for flag in ("--shapes", "--weights-dir", "--attention", "--cuda-graphs", "--cold", "--json"):
        assert flag in text
    assert "kernel warm-up" in text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shapes", "no-such-shape"], "unknown shape"),
        (["--shapes", "tiny-llama", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["--shapes", "tiny-llama", "--timeout", "0"], "--timeout"),
    ],
)
def test_bad_settings_are_user_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "startup", "--device", "cpu", *flags]) == 2
    assert message in capsys.readouterr().err
