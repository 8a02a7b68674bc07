"""CPU checks of ``backplane bench throughput`` and the request workload it shares with ``bench serve``.

End to end on the tiny presets with a few requests: the JSON carries every
field, every request produced exactly the tokens asked for, transformers ran
the same batch where it can and says why not where it cannot, and the
decode-only rows decoded every step. The length mix and the percentiles are
checked against independent computations. Never a timing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
from typing import Any

import numpy as np
import pytest

from backplane.cli import main
from backplane.cli.bench.throughput.model import Model
from backplane.cli.bench.throughput.reference import transformers_batch
from backplane.cli.bench.workload import (
    SHAREGPT_INPUT,
    SHAREGPT_OUTPUT,
    RequestResult,
    RequestSpec,
    arrival_offsets,
    sharegpt_like_requests,
    summarize,
)

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
NUM_PROMPTS = 6
INPUT_LEN = 8
OUTPUT_LEN = 5
DECODE_STEPS = 4
TINY_LLAMA_VOCAB = 320
TINY_LLAMA_MAX_LEN = 2048


def _run(argv: list[str]) -> tuple[int, str]:
    """Run ``backplane`` with ``argv``; return its exit code and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, out.getvalue()


def _finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run with fixed lengths at a rate and all at once, decode-only at batch 2, 3 and 16.

    The attention backend is named (torch), so the run is the same on every machine.
    """
    tmp = tmp_path_factory.mktemp("throughput")
    argv = [
        "bench",
        "throughput",
        "--model",
        "tiny-llama",
        "--device",
        "cpu",
        "--max-num-seqs",
        "8",
        # named, not auto: auto's choice depends on the machine (Triton wins on a CPU
        # under TRITON_INTERPRET=1), and the report must show the backend that was asked for
        "--backend",
        "attention=torch",
        "--num-prompts",
        str(NUM_PROMPTS),
        "--request-rate",
        "50,inf",
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--warmup-prompts",
        "2",
        "--decode-batch-sizes",
        "2,3,16",
        "--decode-prompt-len",
        "4",
        "--decode-steps",
        str(DECODE_STEPS),
        "--json",
        str(tmp / "t.json"),
        "--plot",
        str(tmp / "t.png"),
    ]
    if not HAS_TRANSFORMERS:
        argv.append("--no-transformers")
    rc, printed = _run(argv)
    assert rc == 0
    return {"json": json.loads((tmp / "t.json").read_text()), "printed": printed, "dir": tmp}


def test_result_has_every_section(fixed):
    res = fixed["json"]
    for key in ("machine", "model", "engine", "workload", "rates", "transformers", "decode"):
        assert key in res, key
    assert res["model"]["name"] == "tiny-llama" and res["model"]["params"] > 0
    assert res["engine"]["config"]["max_num_seqs"] == 8  # given: not raised to the decode batch
    assert res["engine"]["backends"]["attention"] == "torch"  # as --backend asked
    assert res["engine"]["config"]["enable_prefix_caching"] is False  # rates resend the prompts
    w = res["workload"]
    assert w["num_prompts"] == NUM_PROMPTS and w["mix"] == "fixed"
    assert w["request_rates"] == [50.0, "inf"]
    assert w["prompt_tokens"]["min"] == w["prompt_tokens"]["max"] == INPUT_LEN
    assert w["output_tokens"]["min"] == w["output_tokens"]["max"] == OUTPUT_LEN
    printed = fixed["printed"]
    assert "TTFT p50" in printed and "decode-only" in printed and "transformers" in printed
    assert "floor: skipped (the HBM floor needs a CUDA device" in printed


def test_every_request_produced_exactly_its_length(fixed):
    rows = fixed["json"]["rates"]
    assert [r["rate"] for r in rows] == [50.0, "inf"]
    for row in rows:
        assert row["completed"] == NUM_PROMPTS and row["failed"] == 0, row["errors"]
        assert row["exact_lengths"] is True
        detail = row["requests_detail"]
        assert len(detail) == NUM_PROMPTS
        for rec in detail:
            assert rec["prompt_len"] == INPUT_LEN
            assert rec["output_len"] == rec["output_tokens"] == OUTPUT_LEN
            assert rec["finish_reason"] == "length"
            assert 0 < rec["ttft_ms"] <= rec["e2e_ms"]
        assert row["output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
        assert row["prompt_tokens"] == NUM_PROMPTS * INPUT_LEN
        d = row["duration_s"]
        assert row["request_throughput"] == pytest.approx(NUM_PROMPTS / d)
        assert row["output_token_throughput"] == pytest.approx(NUM_PROMPTS * OUTPUT_LEN / d)
        assert row["total_token_throughput"] == pytest.approx(
            NUM_PROMPTS * (INPUT_LEN + OUTPUT_LEN) / d
        )
        for key in ("ttft", "itl", "e2e"):
            assert row[f"{key}_ms_p99"] >= row[f"{key}_ms_p50"] >= 0
        # the e2e percentiles are those of the per-request records
        e2e = [r["e2e_ms"] for r in detail]
        assert row["e2e_ms_p50"] == pytest.approx(float(np.percentile(e2e, 50)))
    finite = rows[0]["requests_detail"]
    assert finite[0]["arrival_s"] == 0 and finite[-1]["arrival_s"] > 0
    assert all(r["arrival_s"] == 0 for r in rows[1]["requests_detail"])


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_transformers_ran_the_same_batch(fixed):
    res = fixed["json"]
    hf = res["transformers"]
    assert hf["status"] == "ok", hf.get("reason")
    assert hf["batch"] == NUM_PROMPTS and hf["padded_prompt_len"] == INPUT_LEN
    assert hf["tokens_per_request"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert _finite_positive(hf["output_token_throughput"])
    inf_row = res["rates"][1]
    assert hf["backplane_ratio"] == pytest.approx(
        inf_row["output_token_throughput"] / hf["output_token_throughput"]
    )


def test_decode_only_rows(fixed):
    dec = fixed["json"]["decode"]
    assert dec["steps"] == DECODE_STEPS and dec["prompt_len"] == 4
    assert "CUDA" in dec["floor_skipped"]
    rows = {r["batch"]: r for r in dec["batches"]}
    assert sorted(rows) == [2, 3, 16]
    for b in (2, 3):
        row = rows[b]
        assert row["status"] == "ok", row.get("reason")
        assert row["tokens_per_request"] == [DECODE_STEPS] * b
        assert _finite_positive(row["ms_per_step"])
        assert row["tokens_per_s"] == pytest.approx(b / (row["ms_per_step"] / 1e3))
        assert "floor_ms_per_step" not in row
    assert rows[16]["status"] == "skipped" and "max_num_seqs is 8" in rows[16]["reason"]


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_is_written(fixed):
    assert (fixed["dir"] / "t.png").stat().st_size > 1000
    assert fixed["json"]["plot"] == {"path": str(fixed["dir"] / "t.png")}


def test_mix_at_a_rate_end_to_end(tmp_path):
    """The ShareGPT-like mix, seeded by --seed: per-request records in order, no transformers."""
    path = tmp_path / "mix.json"
    rc, printed = _run(
        [
            "bench",
            "throughput",
            "--model",
            "tiny-llama",
            "--device",
            "cpu",
            "--seed",
            "3",
            "--num-prompts",
            "6",
            "--request-rate",
            "100,inf",
            "--max-input-len",
            "64",
            "--max-output-len",
            "32",
            "--warmup-prompts",
            "0",
            "--decode-batch-sizes",
            "40",
            "--decode-prompt-len",
            "2",
            "--decode-steps",
            "2",
            "--json",
            str(path),
        ]
    )
    assert rc == 0
    res = json.loads(path.read_text())
    specs = sharegpt_like_requests(
        6,
        seed=3,
        max_input_len=64,
        max_output_len=32,
        max_total_len=min(2048, TINY_LLAMA_MAX_LEN),
        token_id_range=(0, TINY_LLAMA_VOCAB),
    )
    for row in res["rates"]:  # records in request order, at a rate and all at once
        detail = row["requests_detail"]
        assert [r["prompt_len"] for r in detail] == [len(s.prompt_token_ids) for s in specs]
        assert [r["output_len"] for r in detail] == [s.output_len for s in specs]
        assert all(r["output_tokens"] == r["output_len"] for r in detail)
    assert len({s.output_len for s in specs}) > 1  # so transformers cannot run one batch
    assert res["workload"]["mix"] == "sharegpt-like" and res["workload"]["seed"] == 3
    hf = res["transformers"]
    assert hf["status"] == "skipped" and "output lengths differ" in hf["reason"]
    assert "transformers: skipped" in printed
    # max_num_seqs was not given: the engine takes the largest decode batch
    assert res["engine"]["config"]["max_num_seqs"] == 40
    (row,) = res["decode"]["batches"]
    assert row["status"] == "ok" and row["tokens_per_request"] == [2] * 40


def test_bad_rate_is_a_user_error(capsys):
    assert main(["bench", "throughput", "--device", "cpu", "--request-rate", "0"]) == 2
    assert "--request-rate" in capsys.readouterr().err


# -- the workload ---------------------------------------------------------------------------------


def test_mix_is_deterministic_per_seed_and_differs_across_seeds():
    a = sharegpt_like_requests(64, seed=1)
    b = sharegpt_like_requests(64, seed=1)
    c = sharegpt_like_requests(64, seed=2)
    assert a == b
    assert [len(s.prompt_token_ids) for s in a] != [len(s.prompt_token_ids) for s in c]
    assert [s.output_len for s in a] != [s.output_len for s in c]
    assert len({len(s.prompt_token_ids) for s in a}) > 20  # a mix, not a few lengths


def test_mix_respects_its_limits_and_fixed_lengths():
    specs = sharegpt_like_requests(
        500,
        seed=0,
        max_input_len=300,
        max_output_len=200,
        max_total_len=400,
        token_id_range=(5, 50),
    )
    for s in specs:
        n = len(s.prompt_token_ids)
        assert 4 <= n <= 300 and 4 <= s.output_len <= 200 and n + s.output_len <= 400
        assert all(5 <= t < 50 for t in s.prompt_token_ids)
    fixed = sharegpt_like_requests(20, seed=0, input_len=17, output_len=9)
    assert {len(s.prompt_token_ids) for s in fixed} == {17} and {s.output_len for s in fixed} == {9}
    half = sharegpt_like_requests(50, seed=0, output_len=9)
    assert {s.output_len for s in half} == {9} and len({len(s.prompt_token_ids) for s in half}) > 5


def test_mix_follows_its_log_normal_laws():
    """Unclipped draws: median and log-spread as stated (no length limit reached)."""
    n = 20000
    specs = sharegpt_like_requests(
        n,
        seed=0,
        max_input_len=10**7,
        max_output_len=10**7,
        max_total_len=2 * 10**7,
        min_len=1,
        token_id_range=(0, 2),
    )
    ins = np.array([len(s.prompt_token_ids) for s in specs], dtype=np.float64)
    outs = np.array([s.output_len for s in specs], dtype=np.float64)
    for x, law in ((ins, SHAREGPT_INPUT), (outs, SHAREGPT_OUTPUT)):
        assert np.median(x) == pytest.approx(law.median, rel=0.05)
        assert np.log(x).std() == pytest.approx(law.sigma, rel=0.05)


def test_arrivals():
    assert arrival_offsets(5, math.inf, 0).tolist() == [0.0] * 5
    off = arrival_offsets(4000, 20.0, 1)
    assert off[0] == 0 and np.all(np.diff(off) >= 0)
    assert np.diff(off).mean() == pytest.approx(1 / 20.0, rel=0.05)
    assert arrival_offsets(10, 5.0, 2).tolist() == arrival_offsets(10, 5.0, 2).tolist()


def _linear_percentile(values: list[float], q: float) -> float:
    """The percentile by linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def test_summary_percentiles_match_numpy_and_a_plain_reference():
    rng = np.random.default_rng(7)
    results = [
        RequestResult(
            True,
            ttft=float(rng.uniform(0.01, 1)),
            itls=rng.uniform(0.001, 0.05, size=int(rng.integers(1, 9))).tolist(),
            e2e=float(rng.uniform(1, 3)),
            output_tokens=4,
            prompt_tokens=10,
        )
        for _ in range(37)
    ]
    row = summarize(2.0, results, duration=4.0)
    values = {
        "ttft": [r.ttft for r in results],
        "itl": [g for r in results for g in r.itls],
        "e2e": [r.e2e for r in results],
    }
    for key, vals in values.items():
        for q in (50, 99):
            got = row[f"{key}_ms_p{q}"]
            assert got == pytest.approx(float(np.percentile(vals, q)) * 1e3, rel=1e-12)
            assert got == pytest.approx(_linear_percentile(vals, q) * 1e3, rel=1e-12)
    assert row["output_token_throughput"] == pytest.approx(37 * 4 / 4.0)
    assert row["total_token_throughput"] == pytest.approx(37 * 14 / 4.0)
    # 1..100 s: p50 = 50.5 s, p99 = 99.01 s
    known = summarize(math.inf, [RequestResult(True, ttft=float(i)) for i in range(1, 101)], 1.0)
    assert known["ttft_ms_p50"] == pytest.approx(50_500.0)
    assert known["ttft_ms_p99"] == pytest.approx(99_010.0)


def test_transformers_is_skipped_with_a_reason_where_it_cannot_run():
    import torch

    folder = Model("x", "x", None, "/nonexistent")
    mixed = [RequestSpec([1, 2, 3], 4), RequestSpec([1, 2], 5)]
    same = [RequestSpec([1, 2, 3], 4), RequestSpec([1, 2], 4)]
    cpu, f32 = torch.device("cpu"), torch.float32
    r = transformers_batch(folder, same, [4.0], cpu, f32)
    assert r["status"] == "skipped" and "arrive at a rate" in r["reason"]
    r = transformers_batch(folder, mixed, [math.inf], cpu, f32)
    assert r["status"] == "skipped" and "output lengths differ" in r["reason"]
    gguf = Model("m.gguf", "m.gguf", None, None, "not a Hugging Face folder")
    r = transformers_batch(gguf, same, [math.inf], cpu, f32)
    assert r["status"] == "skipped" and r["reason"] == "not a Hugging Face folder"


def test_report_gives_the_engine_limits_a_recurrent_model_runs_with(tmp_path, monkeypatch):
    # a large GPU's default of 1,024 sequences is cut to 256 for a model with recurrent
    # state; the report must show what the engine ran, not the configuration's default
    from backplane.engine.config import RECURRENT_MAX_NUM_SEQS, EngineConfig

    monkeypatch.setattr(EngineConfig, "_default_limits", lambda self: (1024, 8192))
    out = tmp_path / "n.json"
    argv = ["bench", "throughput", "--model", "tiny-nemotron-h", "--device", "cpu"]
    argv += ["--num-prompts", "2", "--input-len", "4", "--output-len", "2"]
    argv += ["--decode-batch-sizes", "none", "--no-transformers", "--json", str(out)]
    rc, printed = _run(argv)
    assert rc == 0
    config = json.loads(out.read_text())["engine"]["config"]
    assert (config["max_num_seqs"], config["max_num_tokens"]) == (RECURRENT_MAX_NUM_SEQS, 8192)
    assert f"max_num_seqs {RECURRENT_MAX_NUM_SEQS}," in printed
