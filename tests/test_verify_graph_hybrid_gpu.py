"""Verify graphs of hybrid models replayed as real CUDA graphs (the twin of the CPU tests).

Run with ``python -m pytest -m gpu tests/test_verify_graph_hybrid_gpu.py``. Over the torch
and the Triton SSM and delta backends, the ops on chained rows equal the float64
references of the chunks; a captured verify graph's rows chain their recurrent states
through scratch slots, so its hidden states, logits and per-position states equal the
eager chunks; and an engine that captures its own graphs generates with speculation
exactly what it generates without, its verification steps replaying verify graphs.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import run_requests
from test_verify_graph_hybrid import (
    MODELS,
    NGRAM,
    PAGE,
    _engine,
    _Foresight,
    _prompts,
    captured_runner,
    check_rows_equal_chunks,
)
from test_verify_graph_hybrid_ops import check_conv, check_delta, check_scan

from backplane.core.registry import get_registry
from backplane.engine.engine import Engine
from backplane.testing.plugin import load_backend

pytestmark = pytest.mark.gpu

#: the recurrent families' backends that chain rows; attention as ``auto`` chooses
NAMES = ("torch", "triton")
CASES = [(m, b) for m in MODELS for b in NAMES]


def _needs(name: str) -> dict[str, str]:
    """Skip without CUDA or without the backends; return the recurrent families' backends."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; torch.cuda.is_available() is False")
    if name == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    return {"ssm": name, "delta": name}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("check", "family"), [(check_conv, "ssm"), (check_scan, "ssm"), (check_delta, "delta")]
)
def test_ops_on_chained_rows_equal_the_chunks_on_cuda(check, family, name):
    _needs(name)
    spec = get_registry().get(family, name)
    ok, why = spec.is_available()
    if not ok:
        pytest.skip(why)
    check(load_backend(spec), device="cuda")


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{b}" for m, b in CASES])
def setup(request):
    model, name = request.param
    engine = _engine(model, "cuda", cuda_graphs="off", backends=_needs(name))
    runner = captured_runner(engine)
    yield engine, runner
    runner.release()
    engine.shutdown()


@pytest.mark.parametrize(
    ("new", "cached", "drafts"),
    [([4, 1, 3, 2], [5, 9, 13, 2], [3, 0, 2, 1]), ([3, 4, 4, 4], [4, 7, 1, 20], [2, 3, 3, 3])],
)
def test_captured_verify_graph_rows_equal_the_eager_chunks(setup, new, cached, drafts):
    engine, runner = setup
    check_rows_equal_chunks(engine, runner, new, cached, drafts, tol=2e-4, logits_tol=2e-3)


@pytest.mark.parametrize(("model", "name"), CASES, ids=[f"{m}-{b}" for m, b in CASES])
def test_engine_verifies_hybrids_in_its_captured_verify_graphs(model: str, name: str) -> None:
    backends = _needs(name)
    kw = dict(
        model=model,
        device="cuda",
        dtype="float32",
        max_num_seqs=4,
        max_num_tokens=64,
        page_size=PAGE,
        kv_memory="256MiB",  # fixed: sized from free memory, tests sharing the GPU collide
        backends=backends,
        cuda_graphs="decode",  # verify graphs are decode graphs; prefill runs eagerly
    )
    plain = Engine(**kw)
    prompts, params = _prompts(plain)
    want = run_requests(plain, prompts, params, check_invariants=False)
    plain.shutdown()
    spec = Engine(speculative_config=NGRAM, **kw)
    runner = spec.runner
    assert runner.verify is not None and runner.verify.failed == {}
    replays: list[int] = []
    replay = runner.verify.replay

    def counted(bucket: int):
        replays.append(bucket)
        return replay(bucket)

    runner.verify.replay = counted
    spec.spec.proposer = _Foresight(
        [p + w for p, w in zip(prompts, want, strict=True)], spec.vocab_size
    )
    got = run_requests(spec, prompts, params, check_invariants=False)
    stats = spec.spec.stats
    spec.shutdown()
    assert got == want
    assert len(replays) >= 5, "verification steps did not replay verify graphs"
    assert stats.draft_tokens // 2 < stats.accepted_tokens < stats.draft_tokens
