"""Drafting steps replayed from real CUDA graphs: the same drafts and tokens as eagerly.

Run with ``python -m pytest -m gpu tests/test_spec_graph_gpu.py`` (skipped without CUDA).
The CPU twin, tests/test_spec_graph.py, runs the same logic on eager stand-ins.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import run_requests
from model_run_helpers import torch_backends

from backplane.engine.engine import Engine
from backplane.engine.sampling import SamplingParams
from backplane.engine.spec_decode.draft import DraftModelProposer
from backplane.engine.spec_decode.mtp import MTPProposer
from backplane.engine.spec_decode.proposer import ProposalContext, ProposalRequest
from backplane.models.presets import VOCAB_SIZE, build_preset

pytestmark = pytest.mark.gpu

FAMILIES = ("attention", "ssm", "mla", "delta")
PAGE = 16
MAX_LEN = 128


def _req(rid: str, tokens: list[int], max_tokens: int) -> ProposalRequest:
    return ProposalRequest(
        request_id=rid,
        token_ids=np.asarray(tokens, dtype=np.int32),
        max_tokens=max_tokens,
        num_verified_tokens=len(tokens) - 1,
    )


def _draft(preset: str, k: int, graphs: bool) -> DraftModelProposer:
    backends = torch_backends(FAMILIES)
    draft = build_preset(preset, backends=backends, device="cuda").model
    return DraftModelProposer(
        draft,
        backends,
        num_speculative_tokens=k,
        target_vocab_size=VOCAB_SIZE,
        max_num_seqs=4,
        max_model_len=MAX_LEN,
        page_size=PAGE,
        cuda_graphs=graphs,
    )


def _mtp(preset: str, k: int, graphs: bool) -> MTPProposer:
    backends = torch_backends(FAMILIES)
    target = build_preset(preset, backends=backends, device="cuda", mtp=True).model
    return MTPProposer(
        target,
        backends,
        num_speculative_tokens=k,
        max_num_seqs=4,
        max_model_len=MAX_LEN,
        page_size=PAGE,
        cuda_graphs=graphs,
    )


def _drive(eager: Any, graphed: Any, k: int, hidden_size: int = 0) -> None:
    """Both proposers over the same requests (acceptance, rejection, a late joiner, one
    request short of ``k``); their drafts must agree at every step."""
    rng = np.random.default_rng(5)
    gen = torch.Generator(device="cuda").manual_seed(3)
    seqs = {"a": rng.integers(0, 256, 20).tolist(), "b": rng.integers(0, 256, 3).tolist()}
    for step in range(6):
        if step == 2:
            seqs["c"] = rng.integers(0, 256, 30).tolist()
        ids = list(seqs)
        limits = {r: (1 if r == "b" and step == 3 else k) for r in ids}
        ctx = None
        if hidden_size:
            rows = torch.randn(len(ids), hidden_size, device="cuda", generator=gen)
            ctx = ProposalContext(hidden_states=rows)
        want = eager.propose([_req(r, seqs[r], limits[r]) for r in ids], ctx)
        got = graphed.propose([_req(r, seqs[r], limits[r]) for r in ids], ctx)
        assert got == want, f"step {step}: graphed {got} eager {want} (limits {limits})"
        seqs["a"] = seqs["a"] + want[0] + [int(rng.integers(0, 256))]
        seqs["b"] = seqs["b"] + want[1][:1] + [(want[1][-1] + 1) % 256]
        if "c" in seqs:
            seqs["c"] = seqs["c"] + [(want[2][0] + 7) % 256]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-nemotron-h"])
def test_draft_model_steps_from_cuda_graphs_equal_eager(preset):
    k = 4
    eager, graphed = _draft(preset, k, False), _draft(preset, k, True)
    assert graphed.graphs is not None and graphed.graphs.cuda
    assert graphed.graphs.unsupported is None and graphed.graphs.failed == {}
    assert all(graphed.graphs.has(b) for b in graphed.graphs.buckets)
    _drive(eager, graphed, k)


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-deepseek-v3"])
def test_mtp_steps_from_cuda_graphs_equal_eager(preset):
    k = 3
    eager, graphed = _mtp(preset, k, False), _mtp(preset, k, True)
    assert graphed.graphs is not None and graphed.graphs.failed == {}
    _drive(eager, graphed, k, graphed.graphs.hidden_size)


ENGINE = dict(
    device="cuda",
    dtype="float32",
    max_num_seqs=4,
    max_num_tokens=64,
    max_model_len=MAX_LEN,
    kv_memory="256MiB",  # fixed: sized from free memory, tests sharing the GPU collide
)


def _generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return run_requests(engine, prompts, [params] * len(prompts))


# the chained draft steps need backends that plan nothing per decode-graph step
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    ("model", "spec"),
    [
        ("tiny-llama", {"method": "draft_model", "model": "tiny-llama"}),
        ("tiny-nemotron-h", {"method": "draft_model", "model": "tiny-nemotron-h"}),
        ("tiny-qwen3-next", {"method": "mtp"}),
        ("tiny-deepseek-v3", {"method": "mtp"}),
    ],
)
def test_speculation_with_graphs_generates_the_tokens_of_eager_decoding(model, spec, backend):
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    backends = {f: backend for f in FAMILIES}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, size=n).tolist() for n in (9, 3, 14)]
    plain = Engine(model=model, cuda_graphs="off", backends=backends, **ENGINE)
    want = _generate(plain, prompts, 16)
    plain.shutdown()
    graphed = Engine(
        model=model,
        cuda_graphs="full_and_piecewise",
        speculative_config={**spec, "num_speculative_tokens": 3},
        backends=backends,
        **ENGINE,
    )
    graphs = graphed.spec.proposer.graphs
    assert graphs is not None and graphs.unsupported is None and graphs.failed == {}
    replays = []
    run = graphs.run
    graphs.run = lambda *a, **kw: replays.append(len(a[0])) or run(*a, **kw)
    got = _generate(graphed, prompts, 16)
    assert replays
    assert graphed.spec.stats.verified_seqs > 0
    graphed.shutdown()
    assert got == want
