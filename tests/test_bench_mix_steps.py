"""CPU tests of ``benchmarks/mix_steps.py``: the regimes its report is made of, and one tiny run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "mix_steps.py"


@pytest.fixture(scope="module")
def mix_steps() -> Any:
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("mix_steps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_steps_are_timed_to_the_next_schedule_and_grouped_by_regime(mix_steps):
    # (time s, tokens, prefill seqs, decode seqs); the last schedule only closes the one before
    log = [
        (0.000, 8192, 40, 0),
        (0.200, 300, 0, 300),
        (0.220, 290, 0, 290),
        (0.250, 5, 0, 5),
        (0.259, 4, 1, 3),
        (0.270, 1, 0, 1),
    ]
    rows = {(r["kind"], r["seqs_from"]): r for r in mix_steps.regimes(log)}
    assert set(rows) == {("mixed", 0), ("decode-only", 256), ("decode-only", 0)}
    big = rows[("decode-only", 256)]
    assert big["steps"] == 2 and big["seqs_to"] == 383
    assert big["ms_mean"] == pytest.approx((20 + 30) / 2)
    assert big["tokens_mean"] == pytest.approx(295)
    mixed = rows[("mixed", 0)]
    assert mixed["steps"] == 2
    assert mixed["ms_p50"] == pytest.approx((200 + 11) / 2)
    assert rows[("decode-only", 0)]["steps"] == 1
    assert rows[("decode-only", 0)]["ms_p50"] == pytest.approx(9)


def test_a_tiny_run_reports_every_output_token(mix_steps, tmp_path):
    args = mix_steps.build_parser().parse_args(
        ["--model", "tiny-llama", "--device", "cpu", "--num-prompts", "6", "--max-len", "12"]
    )
    result = mix_steps.run(args)
    assert result["output_tokens"] == sum(
        r.output_len
        for r in mix_steps.sharegpt_like_requests(
            6,
            seed=0,
            max_input_len=12,
            max_output_len=12,
            max_total_len=24,
            token_id_range=(10, 320),
        )
    )
    assert sum(r["steps"] for r in result["regimes"]) == result["steps"] - 1
    assert "tok/s" in mix_steps.format_report(result)
