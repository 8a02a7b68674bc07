"""Structured output on CUDA with the decode graph: constrained rows follow their grammar,
free rows in the same batches keep their graph-replayed tokens, and graphs on equal graphs off."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install -e '.[dev]')")

from backplane import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

PATTERN = r"[ab]{2,4}-\d{3}(x|yz)"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def _run(graphs: str) -> list:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    llm = LLM(
        "tiny-llama",
        device="cuda",
        dtype="float32",
        cuda_graphs=graphs,
        max_num_seqs=8,
        max_num_tokens=256,
        num_kv_pages=512,
    )
    prompts = ["hello", "zzz", "a b c", "{", "seven", "q"]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={"regex": PATTERN}),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=60, temperature=0.0, structured_outputs={"json": SCHEMA}),
        SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(
            max_tokens=20, temperature=1.0, seed=5, structured_outputs={"choice": ["yes", "no"]}
        ),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    ]
    try:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_grammar_rows_beside_graph_rows_follow_their_grammar_and_match_eager() -> None:
    with_graphs = _run("full_and_piecewise")
    eager = _run("off")
    assert re.fullmatch(PATTERN, with_graphs[0].text), with_graphs[0].text
    if with_graphs[2].finish_reason == "stop":
        value = json.loads(with_graphs[2].text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
    assert with_graphs[4].text in ("yes", "no")
    for a, b in zip(with_graphs, eager, strict=True):
        assert list(a.token_ids) == list(b.token_ids)
