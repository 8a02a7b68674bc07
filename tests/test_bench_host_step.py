"""CPU tests of ``benchmarks/host_step.py``: its timers still reach the engine's components,
and the garbage collector's pauses are counted only while the run is timed."""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "host_step.py"


@pytest.fixture(scope="module")
def host_step() -> Any:
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("host_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gc_pauses_count_full_passes_apart_and_only_while_on(host_step):
    pauses = host_step.GCPauses()
    gc.callbacks.append(pauses)
    try:
        gc.collect()  # off: not counted
        assert pauses.num_full == 0 and pauses.full == 0.0
        pauses.on = True
        gc.collect()
        gc.collect(0)
    finally:
        gc.callbacks.remove(pauses)
    assert pauses.num_full == 1 and pauses.full > 0.0 and pauses.young > 0.0
    summary = pauses.summary(4)
    assert summary["full_passes"] == 1 and summary["steps"] == 4
    assert summary["full"] == pytest.approx(1e3 * pauses.full / 4)


@pytest.mark.parametrize("path", ["llm", "async"])
def test_a_tiny_run_times_every_component(host_step, path, caplog):
    argv = ["--path", path, "--requests", "12", "--max-num-seqs", "8", "--output-len", "6"]
    argv += ["--prompt-len", "16", "--kv-memory", "32MiB", "--min-seqs", "4", "--json"]
    with caplog.at_level(logging.INFO):
        assert host_step.main(argv) == 0
    record = json.loads(caplog.records[-1].getMessage())
    assert record["path"] == path
    decode = record["per_step_ms"]["decode"]
    parts = ["schedule", "prepare_inputs", "step_rows", "commit", "collect", "outputs"]
    if path == "async":
        parts.append("readers")
    assert all(decode[p] > 0.0 for p in parts), decode
    assert record["gc_ms"]["steps"] >= decode["steps"]
