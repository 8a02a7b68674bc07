"""CPU tests of ``backplane bench latency --speculative-config``.

Tiny presets, a few tokens: the command runs and prints the speculative
figures, and those figures agree with references computed apart from the
engine: the ``ngram`` counts with a prompt-lookup replay over the tokens that
decoding without speculation gives, the ratios with the rows they divide.
Never a timing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from bench_helpers import cpu_latency

from backplane.cli import main
from backplane.cli.bench.latency.settings import Settings, check_settings
from backplane.cli.bench.latency.speculation import rewrite_prompts
from backplane.core.errors import ConfigError

PROMPT_LEN = 24
NEW_TOKENS = 16
BATCHES = (1, 2)
K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}


def _bench(out: Path, weights: Path, shape: str, spec: dict[str, Any], *extra: str) -> dict:
    result, report = cpu_latency(
        shape,
        out,
        weights,
        batches=BATCHES,
        prompt_len=PROMPT_LEN,
        new_tokens=NEW_TOKENS,
        extra=("--speculative-config", json.dumps(spec), *extra),
    )
    return {"json": result, "report": report, "weights": weights}


@pytest.fixture(scope="module")
def ngram_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ngram run of tiny-llama on the rewrite workload."""
    tmp = tmp_path_factory.mktemp("spec-bench")
    return _bench(tmp / "ngram.json", tmp / "weights", "tiny-llama", NGRAM, "--workload", "rewrite")


def _configs(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["label"]: c for c in result["shapes"][0]["configs"]}


def _prompt_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup written apart from the engine's: longest suffix first, latest match,
    and what followed the match copied on, token by token, past the sequence's end."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                text = list(tokens)
                for i in range(k):
                    text.append(text[start + n + i])
                return text[length:]
    return []


def _replay(
    prompts: list[list[int]], outputs: list[list[int]], spec: dict[str, Any]
) -> dict[str, int]:
    """The verifying steps, drafts and accepted tokens greedy ngram decoding of one batch
    must count, with asynchronous scheduling (the engine's default).

    After each step the drafts must leave room for the verified token within
    ``max_tokens``; the target keeps the drafts up to the first one that differs
    from its own greedy token (the output, which speculation does not change).
    A step with drafts runs synchronously; while a step without drafts is in
    flight, the next step looks for drafts only when some request's committed
    tokens (all but its last) already continue an earlier match.
    """
    k = spec["num_speculative_tokens"]
    lo, hi = spec.get("prompt_lookup_min", 1), spec.get("prompt_lookup_max", 4)
    counts = {"verify_steps": 0, "draft_tokens": 0, "accepted_tokens": 0}
    done = [1] * len(prompts)  # the prompts' step gives the first tokens, with no draft
    in_flight = True  # that step ran asynchronously
    while True:
        live = [i for i, out in enumerate(outputs) if done[i] < len(out)]
        if not live:
            return counts
        look = not in_flight or any(
            _prompt_lookup(prompts[i] + outputs[i][: done[i] - 1], lo, hi, 1) for i in live
        )
        drafted = False
        for i in live:
            output, room = outputs[i], len(outputs[i]) - done[i] - 1
            tokens = prompts[i] + output[: done[i]]
            draft = _prompt_lookup(tokens, lo, hi, min(k, room)) if look and room > 0 else []
            accepted = 0
            while accepted < len(draft) and draft[accepted] == output[done[i] + accepted]:
                accepted += 1
            if draft:
                drafted = True
                counts["verify_steps"] += 1
                counts["draft_tokens"] += len(draft)
                counts["accepted_tokens"] += accepted
            done[i] += accepted + 1
        in_flight = not drafted


def _greedy_tokens(folder: str, prompts: list[list[int]]) -> list[list[int]]:
    """Tokens of decoding without speculation, from an engine of the run's settings."""
    from backplane import LLM, SamplingParams

    llm = LLM(
        folder,
        device="cpu",
        dtype="float32",
        max_num_seqs=len(prompts),
        max_model_len=PROMPT_LEN + NEW_TOKENS,
        enable_prefix_caching=False,
        backends={"attention": "torch"},
    )
    try:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        )
        return [list(o.token_ids) for o in outs]
    finally:
        llm.shutdown()


def test_ngram_rows_stand_beside_the_run_without_speculation(ngram_run):
    configs = _configs(ngram_run["json"])
    base = configs["backplane torch, eager"]
    spec = configs[f"backplane torch, eager, ngram k={K}"]
    floor = configs["memory floor"]
    assert spec["status"] == "ok" and base["status"] == "ok"
    assert spec["speculative_config"]["method"] == "ngram"
    assert spec["engine_settings"]["speculative_config"] == NGRAM
    assert "speculative_config" not in base["engine_settings"]
    for b in BATCHES:
        row = next(r for r in spec["batches"] if r["batch"] == b)
        base_row = next(r for r in base["batches"] if r["batch"] == b)
        floor_row = next(r for r in floor["batches"] if r["batch"] == b)
        assert row["tokens_per_request"] == [NEW_TOKENS] * b
        ms = row["ms_per_token"]
        assert math.isfinite(ms) and ms > 0
        assert row["baseline_ms_per_token"] == base_row["ms_per_token"]
        assert row["speedup"] == pytest.approx(base_row["ms_per_token"] / ms)
        # the floor of decoding without speculation, the same row the baseline divides by
        assert row["x_floor"] == pytest.approx(ms / floor_row["ms_per_token"])
        assert "speculation" not in base_row


def test_ngram_acceptance_matches_a_replay_of_prompt_lookup(ngram_run):
    result = ngram_run["json"]
    spec = _configs(result)[f"backplane torch, eager, ngram k={K}"]
    vocab = result["shapes"][0]["config"]["vocab_size"]
    folder = str(ngram_run["weights"] / "tiny-llama-float32")
    drafted_somewhere = False
    for b in BATCHES:
        prompts = rewrite_prompts(result["settings"]["seed"], b, PROMPT_LEN, vocab)
        outputs = _greedy_tokens(folder, prompts)
        expected = _replay(prompts, outputs, NGRAM)
        row = next(r for r in spec["batches"] if r["batch"] == b)
        figures = row["speculation"]
        assert {key: figures[key] for key in expected} == expected
        drafted_somewhere |= expected["draft_tokens"] > 0
        assert figures["acceptance_rate"] == pytest.approx(
            expected["accepted_tokens"] / expected["draft_tokens"]
        )
        assert figures["mean_accepted_length"] == pytest.approx(
            1 + expected["accepted_tokens"] / expected["verify_steps"]
        )
    # otherwise the comparison above would hold for any engine that never drafts
    assert drafted_somewhere


def test_report_prints_the_speculative_figures(ngram_run):
    report = ngram_run["report"]
    assert "speculative decoding: effective ms per generated token" in report
    table = report.split("speculative decoding:")[1]
    header = table.splitlines()[1]
    for column in ("b=1 ms", "x floor", "speedup", "accept", "mean len"):
        assert column in header
    line = next(
        x for x in table.splitlines() if x.startswith(f"backplane torch, eager, ngram k={K}")
    )
    row = next(
        r
        for r in _configs(ngram_run["json"])[f"backplane torch, eager, ngram k={K}"]["batches"]
        if r["batch"] == 1
    )
    assert f"{row['ms_per_token']:.3f}" in line
    assert f"{row['speedup']:.2f}x" in line


def test_run_records_the_workload_and_configuration(ngram_run):
    run = ngram_run["json"]["shapes"][0]["run"]
    assert run["workload"] == "rewrite"
    assert run["speculative_config"] == NGRAM


def test_rewrite_prompts_repeat_a_document():
    prompts = rewrite_prompts(0, 3, 11, 50)
    assert len(prompts) == 3 and all(len(p) == 11 for p in prompts)
    doc = 6  # the first half, rounded up
    for p in prompts:
        assert all(0 <= t < 50 for t in p)
        assert p[doc:] == p[: 11 - doc]
    assert prompts[0] != prompts[1]
    assert rewrite_prompts(0, 3, 11, 50) == prompts


def test_mtp_on_a_shape_with_mtp_layers(tmp_path):
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    result = _bench(tmp_path / "mtp.json", tmp_path / "weights", "tiny-qwen3-next", spec)["json"]
    configs = _configs(result)
    row_of = {
        label: {r["batch"]: r for r in configs[label]["batches"]}
        for label in ("backplane torch, eager", "backplane torch, eager, mtp k=2")
    }
    for b in BATCHES:
        row = row_of["backplane torch, eager, mtp k=2"][b]
        assert row["status"] == "ok", row.get("reason")
        figures = row["speculation"]
        steps, drafted, accepted = (
            figures["verify_steps"],
            figures["draft_tokens"],
            figures["accepted_tokens"],
        )
        # MTP drafts at every decode step that has room for a draft: each request's
        # NEW_TOKENS - 1 decode tokens come from verifying steps (1 + accepted each)
        # and at most one last step without room
        assert b * (NEW_TOKENS - 2) <= steps + accepted <= b * (NEW_TOKENS - 1)
        assert steps <= drafted <= 2 * steps and 0 <= accepted <= drafted
        if drafted:
            assert figures["acceptance_rate"] == pytest.approx(accepted / drafted)
            assert figures["mean_accepted_length"] == pytest.approx(1 + accepted / steps)
        base = row_of["backplane torch, eager"][b]
        assert row["speedup"] == pytest.approx(base["ms_per_token"] / row["ms_per_token"])


def test_mtp_weights_are_saved_under_their_checkpoint_names(tmp_path):
    from safetensors import safe_open

    from backplane.cli.bench.latency.shapes import shape_config
    from backplane.cli.bench.latency.weights import save_random_weights

    config = shape_config("tiny-qwen3-next")
    info = save_random_weights("tiny-qwen3-next", config, tmp_path, __import__("torch").float32)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as fh:
        keys = set(fh.keys())
        mtp_numel = sum(
            math.prod(fh.get_slice(k).get_shape()) for k in keys if k.startswith("mtp.")
        )
        all_numel = sum(math.prod(fh.get_slice(k).get_shape()) for k in keys)
    assert {"mtp.fc.weight", "mtp.norm.weight"} <= keys
    # the floor's sizes are the target's: the MTP layers are left out
    assert info.params == all_numel - mtp_numel


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{method", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "is not known"),
        ('{"method": "ngram"}', "needs 'num_speculative_tokens'"),
    ],
)
def test_bad_speculative_config_is_a_clear_error(value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "latency", "--device", "cpu", "--speculative-config", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and message in err


def test_mtp_on_a_shape_without_mtp_layers_is_refused():
    settings = Settings(
        shapes=["tiny-llama"],
        prompt_len=8,
        new_tokens=4,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )
    with pytest.raises(ConfigError, match="declares none"):
        check_settings(settings)
    settings.speculative_config = {"method": "mtp", "num_speculative_tokens": 1}
    settings.shapes = ["qwen3-next-1b-mtp"]
    check_settings(settings)
    settings.workload = "poetry"
    with pytest.raises(ConfigError, match="--workload 'poetry'"):
        check_settings(settings)


def test_help_documents_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "latency", "--help"])
    out = capsys.readouterr().out
    assert "--speculative-config JSON" in out
    assert "--workload {random,rewrite}" in out
    assert "acceptance rate" in out
