"""``backplane bench startup`` on a GPU: graph capture, profiling and warm-up are timed,
and their parts stay within their phases.

Run with ``python -m pytest -m gpu tests/test_bench_startup_gpu.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from backplane.cli import main

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One warm start-up of tiny-llama on the GPU with CUDA graphs on, small limits."""
    tmp = tmp_path_factory.mktemp("startup-gpu")
    out = tmp / "startup.json"
    argv = [
        "bench", "startup", "--shapes", "tiny-llama", "--device", "cuda",
        "--max-num-seqs", "8", "--max-num-tokens", "256", "--max-model-len", "512",
        "--weights-dir", str(tmp / "weights"), "--json", str(out),
    ]  # fmt: skip
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(argv)
    assert rc == 0, stdout.getvalue()
    return json.loads(Path(out).read_text())


def _run(result: dict[str, Any]) -> dict[str, Any]:
    (shape,) = result["shapes"]
    run = shape["runs"]["warm"]
    assert run["status"] == "ok", run
    return run


def test_graph_phases_are_measured(result: dict[str, Any]) -> None:
    run = _run(result)
    assert run["graph_mode"] != "off"
    phases = run["phases"]
    # each of these does device work on CUDA: the profiling step, the captures, the warm-up steps
    for name in ("memory profiling", "graph capture", "kernel warm-up", "weight load"):
        assert phases[name] > 0, name
    assert sum(phases.values()) <= run["total"] + 1e-6


def test_details_break_the_phases_down(result: dict[str, Any]) -> None:
    run = _run(result)
    details, phases = run["details"], run["phases"]
    captures = {k: v for k, v in details.items() if k.startswith("capture ")}
    warm_ups = {k: v for k, v in details.items() if k.startswith("warm-up ")}
    assert any(k.startswith("capture piecewise bucket ") and "(first)" in k for k in captures)
    assert any(k.startswith("capture decode batch ") and "(first)" in k for k in captures)
    assert {"warm-up prefill", "warm-up decode", "warm-up mixed"} <= set(warm_ups)
    # the parts of a phase never exceed it (each is timed inside it, device synchronised)
    assert sum(captures.values()) <= phases["graph capture"] + 1e-3
    assert sum(warm_ups.values()) <= phases["kernel warm-up"] + 1e-3
