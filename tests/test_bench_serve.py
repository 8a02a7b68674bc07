"""``backplane bench serve``: the seeded request mix, the summary, and a sweep against a server."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from backplane.cli.bench.serve import RequestResult, make_requests, summarize


def test_request_mix_is_seeded_and_within_ranges():
    a = make_requests(50, input_len=20, output_len=10, range_ratio=0.5, seed=3)
    b = make_requests(50, input_len=20, output_len=10, range_ratio=0.5, seed=3)
    c = make_requests(50, input_len=20, output_len=10, range_ratio=0.5, seed=4)
    assert a == b and a != c
    assert all(10 <= len(r.prompt_token_ids) <= 30 and 5 <= r.output_len <= 15 for r in a)
    assert all(10 <= t < 1000 for r in a for t in r.prompt_token_ids)
    assert len({len(r.prompt_token_ids) for r in a}) > 5  # a mix, not one length


def test_summary_percentiles_and_failures():
    ok = [
        RequestResult(True, ttft=0.1 * i, itls=[0.01, 0.02], e2e=1.0, output_tokens=3)
        for i in range(1, 11)
    ]
    bad = [RequestResult(False, error="HTTP 503: busy")]
    row = summarize(math.inf, ok + bad, duration=2.0)
    assert row["rate"] == "inf" and row["completed"] == 10 and row["failed"] == 1
    assert row["ttft_ms_p50"] == pytest.approx(550.0)
    assert row["itl_ms_p50"] == pytest.approx(15.0)
    assert row["output_token_throughput"] == pytest.approx(15.0)
    assert row["errors"] == ["HTTP 503: busy"]


def test_sweep_against_a_running_server(tmp_path, capsys):
    for module in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
        pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[dev]')")
    from server_helpers import running_server

    from backplane.cli import main

    out = tmp_path / "sweep"
    with running_server(["tiny-llama", "--device", "cpu", "--max-num-seqs", "8"]) as url:
        code = main(
            [
                "bench",
                "serve",
                "--url",
                url,
                "--rates",
                "20,inf",
                "--num-requests",
                "6",
                "--input-len",
                "8",
                "--output-len",
                "4",
                "--token-id-range",
                "10,200",
                "--output",
                str(out),
            ]
        )
    assert code == 0
    printed = capsys.readouterr().out
    assert "TTFT p50" in printed and "wrote" in printed
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert result["model"] == "tiny-llama"
    assert [r["rate"] for r in result["rates"]] == [20.0, "inf"]
    for row in result["rates"]:
        assert row["completed"] == 6 and row["failed"] == 0, row["errors"]
        assert row["ttft_ms_p50"] > 0 and row["e2e_ms_p99"] >= row["e2e_ms_p50"]
        assert row["output_token_throughput"] > 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "sweep.png").stat().st_size > 1000


def test_unreachable_server_is_a_clear_error(capsys):
    pytest.importorskip("httpx")
    from server_helpers import free_port

    from backplane.cli import main

    code = main(
        ["bench", "serve", "--url", f"http://127.0.0.1:{free_port()}", "--num-requests", "1"]
    )
    assert code == 2
    assert "cannot reach a server" in capsys.readouterr().err
