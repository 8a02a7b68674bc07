"""The graph model runner on CPU stand-ins: padding, dispatch and replay == eager per bucket.

Without CUDA the runner's "graphs" re-run the forward, but everything else is
the real thing: bucket choice, padding with scratch sequences, the piecewise
split and its out buffers, and the persistent input addresses replays rely on.
The same checks run with real CUDA graphs in ``test_graph_gpu.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from graph_helpers import generate_eager_and_graphed, graph_runner_for

from backplane.core.backend_spec import BackendSpec
from backplane.core.forward_context import forward_context, plan_step
from backplane.core.metadata import StepMode
from backplane.engine.config import CUDA_GRAPH_MODES
from backplane.engine.engine import Engine
from backplane.engine.worker.graph.mode import GraphMode, decide_graph_mode
from backplane.engine.worker.graph.runner import GraphModelRunner
from backplane.engine.worker.runner import EagerModelRunner, ModelRunner

PAGE = 4


@dataclass
class _Req:
    token_buffer: np.ndarray


@dataclass
class _Seq:
    request: _Req
    num_new_tokens: int
    num_cached_tokens: int
    page_ids: np.ndarray
    state_slot: int
    is_prefill_chunk_final: bool = True


def make_seqs(engine: Engine, rng: np.random.Generator, prefill: list[int], decode_ctx: list[int]):
    """Prefill sequences (new tokens, no context) then decode sequences (context lengths)."""
    lens = [(q, 0) for q in prefill] + [(1, c) for c in decode_ctx]
    free = rng.permutation(np.arange(1, engine.num_pages))  # page 0 is scratch
    seqs, used = [], 0
    for i, (q, c) in enumerate(lens):
        need = -(-(q + c) // engine.page_size)
        pages = free[used : used + need].astype(np.int32)
        used += need
        tokens = rng.integers(0, engine.vocab_size, size=q + c + 1).astype(np.int32)
        seqs.append(_Seq(_Req(tokens), q, c, pages, state_slot=i + 1))
    return seqs


def fill_caches_(engine: Engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in engine.caches.values():
        for t in layer.values():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype) * 0.5)


def snapshot(engine: Engine) -> dict:
    return {(k, n): t.clone() for k, d in engine.caches.items() for n, t in d.items()}


def restore_(engine: Engine, snap: dict) -> None:
    for (k, n), t in snap.items():
        engine.caches[k][n].copy_(t)


def run_eager(engine: Engine, seqs) -> torch.Tensor:
    inputs = engine.input_batch.prepare(seqs)
    with forward_context(inputs.metadata, plan_step(engine.backends, inputs.metadata)):
        return engine.model(inputs.input_ids, inputs.positions)[: inputs.num_tokens].clone()


def run_runner(engine: Engine, runner: GraphModelRunner, seqs):
    inputs = runner.prepare_inputs(seqs)
    with forward_context(inputs.metadata, plan_step(engine.backends, inputs.metadata)):
        hidden = runner.run(inputs)
    return inputs, hidden[: sum(s.num_new_tokens for s in seqs)].clone()


TORCH_BACKENDS = {"attention": "torch", "ssm": "torch", "mla": "torch", "delta": "torch"}


def build_runner(
    model: str,
    device: str,
    *,
    max_model_len: int,
    num_kv_pages: int,
    mode: GraphMode,
    **buckets,
) -> tuple[Engine, GraphModelRunner]:
    """An eager engine on torch backends and a graph runner over its model (not captured yet)."""
    engine = Engine(
        model=model,
        device=device,
        dtype="float32",
        max_num_seqs=8,
        max_num_tokens=64,
        max_model_len=max_model_len,
        page_size=PAGE,
        num_kv_pages=num_kv_pages,
        cuda_graphs="off",
        backends=TORCH_BACKENDS,
    )
    runner = graph_runner_for(engine, mode=mode, max_num_tokens=64, max_num_seqs=8, **buckets)
    return engine, runner


CPU_MODELS = ["tiny-llama", "tiny-nemotron-h", "tiny-qwen3-next"]
GPU_MODELS = ["tiny-llama", "tiny-nemotron-h", "tiny-deepseek-v3", "tiny-qwen3-next"]


@pytest.fixture(
    scope="module",
    params=[pytest.param(("cpu", m), id=f"cpu-{m}") for m in CPU_MODELS]
    + [pytest.param(("cuda", m), id=f"cuda-{m}", marks=pytest.mark.gpu) for m in GPU_MODELS],
)
def setup(request):
    device, model = request.param
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; torch.cuda.is_available() is False")
    engine, runner = build_runner(
        model,
        device,
        max_model_len=64,
        num_kv_pages=160,
        mode=GraphMode.FULL_AND_PIECEWISE,
        token_bucket_sizes=[16, 32],
        decode_bucket_sizes=[2, 4],
    )
    runner.capture()
    # a failed capture silently falls back to eager: here it must not happen
    assert runner.piecewise.failed == {} and runner.decode.failed == {}
    assert runner.piecewise.captured == set(runner.token_buckets)
    assert set(runner.decode.graphs) == set(runner.decode_buckets)
    yield engine, runner
    # Module-scoped: release graphs and caches before the next model's engine sizes itself.
    runner.release()
    engine.shutdown()


def _compare(engine, runner, seqs, seed):
    fill_caches_(engine, seed)
    before = snapshot(engine)
    inputs, got = run_runner(engine, runner, seqs)
    after_runner = snapshot(engine)
    restore_(engine, before)
    want = run_eager(engine, seqs)
    tol = 1e-5 if engine.device.type == "cpu" else 1e-4  # padded shapes may pick other GEMMs
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for key, t in snapshot(engine).items():
        # padding rows must not have touched live pages or slots (only page 0 / slot 0)
        a, b = after_runner[key], t
        torch.testing.assert_close(a[1:], b[1:], rtol=tol, atol=tol)
    return inputs


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_decode_batches_pad_to_a_decode_bucket(setup, n):
    engine, runner = setup
    rng = np.random.default_rng(n)
    seqs = make_seqs(engine, rng, [], list(rng.integers(1, 40, size=n)))
    inputs = _compare(engine, runner, seqs, seed=n)
    expected_bucket = min(b for b in runner.decode_buckets if b >= n)
    assert inputs.metadata.num_seqs == expected_bucket
    assert inputs.metadata.is_decode_only
    assert inputs.metadata.block_table.shape[1] == runner.max_pages


@pytest.mark.parametrize(
    ("prefill", "decode"), [([5], [3, 9]), ([12, 7], [2]), ([40], []), ([3], [])]
)
def test_mixed_and_prefill_batches_pad_to_a_token_bucket(setup, prefill, decode):
    engine, runner = setup
    rng = np.random.default_rng(len(prefill) * 10 + len(decode))
    seqs = make_seqs(engine, rng, prefill, decode)
    inputs = _compare(engine, runner, seqs, seed=7)
    total = sum(prefill) + len(decode)
    assert inputs.metadata.padded_num_tokens == min(b for b in runner.token_buckets if b >= total)
    assert inputs.metadata.num_tokens == total


def test_full_budget_prefill_has_a_bucket(setup):
    engine, runner = setup
    assert runner.token_buckets[-1] == 64
    seqs = make_seqs(engine, np.random.default_rng(3), [64], [])
    inputs = _compare(engine, runner, seqs, seed=3)
    assert inputs.metadata.padded_num_tokens == 64


def test_steps_without_a_captured_bucket_run_eagerly(setup):
    engine, runner = setup
    captured = set(runner.piecewise.captured)
    runner.piecewise.captured.discard(32)
    try:
        seqs = make_seqs(engine, np.random.default_rng(4), [20], [5])
        inputs = _compare(engine, runner, seqs, seed=4)
        assert inputs.metadata.padded_num_tokens == inputs.metadata.num_tokens == 21
    finally:
        runner.piecewise.captured = captured


def test_decode_inputs_keep_their_addresses_across_steps(setup):
    # captured decode graphs read every metadata tensor at its capture-time address
    engine, runner = setup
    rng = np.random.default_rng(0)
    a = runner.prepare_inputs(make_seqs(engine, rng, [], [3, 30, 17]))
    ptrs_a = {k: getattr(a.metadata, k).data_ptr() for k in vars(a.metadata.host)}
    ids_a, pos_a = a.input_ids.data_ptr(), a.positions.data_ptr()
    b = runner.prepare_inputs(make_seqs(engine, rng, [], [50, 1, 2, 9]))
    ptrs_b = {k: getattr(b.metadata, k).data_ptr() for k in vars(b.metadata.host)}
    assert b.input_ids.data_ptr() == ids_a and b.positions.data_ptr() == pos_a
    moved = {k for k in ptrs_a if ptrs_a[k] != ptrs_b[k] and k != "page_indices"}
    assert not moved, f"decode metadata moved between steps: {sorted(moved)}"


def test_piecewise_inputs_keep_their_addresses(setup):
    engine, runner = setup
    rng = np.random.default_rng(1)
    a = runner.prepare_inputs(make_seqs(engine, rng, [10], [4]))
    b = runner.prepare_inputs(make_seqs(engine, rng, [3, 4], [8, 2, 6]))
    assert a.metadata.padded_num_tokens == b.metadata.padded_num_tokens == 16
    assert a.input_ids.data_ptr() == b.input_ids.data_ptr()
    assert a.positions.data_ptr() == b.positions.data_ptr()


def _specs(*capabilities: frozenset[str]) -> dict[str, BackendSpec]:
    return {
        family: BackendSpec(family=family, name=f"b{i}", load="x:y", capabilities=caps)
        for i, (family, caps) in enumerate(zip(("attention", "ssm"), capabilities, strict=False))
    }


GRAPH_OK = frozenset({"cuda", "cuda_graph"})


def test_graph_mode_is_decided_once_from_config_device_and_backends(caplog):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    ok = _specs(GRAPH_OK, GRAPH_OK)
    assert decide_graph_mode(None, cuda, ok) is GraphMode.FULL_AND_PIECEWISE
    assert decide_graph_mode("decode", cuda, ok) is GraphMode.DECODE
    assert decide_graph_mode("off", cuda, ok) is GraphMode.OFF
    # graphs need CUDA: a mode asked for on the CPU is dropped, with a warning
    assert decide_graph_mode(None, cpu, ok) is GraphMode.OFF
    with caplog.at_level("WARNING"):
        assert decide_graph_mode("piecewise", cpu, ok) is GraphMode.OFF
    assert "not CUDA" in caplog.text
    caplog.clear()
    # one backend that does not declare cuda_graph turns graphs off, named in one line
    with caplog.at_level("WARNING"):
        mode = decide_graph_mode(None, cuda, _specs(GRAPH_OK, frozenset({"cuda"})))
    assert mode is GraphMode.OFF
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "ssm=b1" in lines[0] and "cuda_graph" in lines[0]
    with pytest.raises(ValueError, match="always"):
        decide_graph_mode("always", cuda, ok)
    assert GraphMode.FULL_AND_PIECEWISE.has_decode and GraphMode.FULL_AND_PIECEWISE.has_piecewise
    assert not GraphMode.PIECEWISE.has_decode and not GraphMode.DECODE.has_piecewise
    assert not GraphMode.OFF.captures and GraphMode.OFF == "off"
    # the configuration accepts exactly the modes the worker knows
    assert tuple(m.value for m in GraphMode) == CUDA_GRAPH_MODES


def test_engine_on_cpu_runs_eagerly_whatever_the_graph_setting():
    engine = Engine(
        model="tiny-llama",
        device="cpu",
        max_num_seqs=4,
        max_num_tokens=32,
        num_kv_pages=40,
        cuda_graphs="full_and_piecewise",
    )
    assert engine.executor.driver.graph_mode is GraphMode.OFF
    assert isinstance(engine.runner, EagerModelRunner)


@pytest.mark.gpu
@pytest.mark.parametrize("model", GPU_MODELS)
def test_generation_with_graphs_equals_eager(model):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; torch.cuda.is_available() is False")
    results = generate_eager_and_graphed(
        model, TORCH_BACKENDS, dtype="float32", prompt_lens=(3, 17, 40, 9, 28, 5), max_tokens=12
    )
    assert results["full_and_piecewise"] == results["off"]


TRITON_BACKENDS = {"attention": "triton", "ssm": "triton", "mla": "triton", "delta": "triton"}


@pytest.mark.gpu
@pytest.mark.parametrize("model", GPU_MODELS)
def test_generation_with_triton_graphs_equals_eager(model, monkeypatch):
    # The Triton decode merges its key splits through arrival counters that must
    # read zero at every launch, in replays as in eager steps; three splits force
    # that path at these short contexts.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; torch.cuda.is_available() is False")
    pytest.importorskip("triton", reason="triton is not installed")
    from backplane.backends.triton import attention_launch as tri

    monkeypatch.setitem(tri._FORCED_SPLITS, "value", 3)
    results = generate_eager_and_graphed(
        model, TRITON_BACKENDS, dtype="bfloat16", prompt_lens=(3, 17, 40, 9, 28, 5), max_tokens=12
    )
    assert results["full_and_piecewise"] == results["off"]


@pytest.mark.gpu
def test_fp8_weights_and_kv_cache_capture_every_bucket():
    # The attention op's arguments include the e4m3 cache planes, which each
    # recorded step holds through a weak reference: every dtype must have one.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; torch.cuda.is_available() is False")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs compute capability 8.9 or newer")
    pytest.importorskip("triton", reason="triton is not installed")
    results = generate_eager_and_graphed(
        "tiny-llama",
        {"attention": "triton"},
        dtype="bfloat16",
        prompt_lens=(3, 17, 40, 9),
        max_tokens=12,
        quantization="fp8",
        kv_cache_dtype="fp8",
    )
    assert results["full_and_piecewise"] == results["off"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype",
    [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32,
     torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool],
)  # fmt: skip
def test_weak_ref_aliases_a_tensor_of_every_dtype(dtype):
    from backplane.engine.worker.graph.capture import weak_ref

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; torch.cuda.is_available() is False")
    base = torch.randn(6, 10, device="cuda").mul(8).to(dtype)
    view = base[1:5, ::3]
    alias = weak_ref(view)
    assert alias.dtype == dtype and alias.shape == view.shape and alias.stride() == view.stride()
    assert alias.data_ptr() == view.data_ptr()
    assert torch.equal(alias.contiguous().view(torch.uint8), view.contiguous().view(torch.uint8))


def test_every_dynamic_op_of_the_model_is_cut_out(setup):
    # an op left inside a recorded graph would freeze one step's metadata
    from backplane.core.contract import intercept_cached_ops
    from backplane.engine.worker.graph.piecewise import EscapeCheck

    engine, runner = setup
    pw = runner.piecewise
    calls = []

    def count(op, args, kwargs):
        if op._opoverload in pw.ops:
            calls.append(op._opoverload)
        return op._init_fn(*args, **kwargs)

    with torch.inference_mode(), runner._piecewise_inputs(16) as args:
        with intercept_cached_ops(count), EscapeCheck(pw.ops):
            runner._forward(*args)
    assert calls and set(calls) <= pw.ops  # a model may use only some of a backend's ops
    if engine.device.type == "cuda":
        assert pw.recordings[16].ops == len(calls)
        assert len(pw.recordings[16].graphs) == len(calls) + 1


def test_the_step_mode_is_decided_once_and_run_dispatches_on_it(setup, monkeypatch):
    """prepare_inputs picks the mode and carries it on the inputs; run follows it."""
    engine, runner = setup
    assert isinstance(runner, ModelRunner) and isinstance(engine.runner, ModelRunner)
    rng = np.random.default_rng(5)
    decode = runner.prepare_inputs(make_seqs(engine, rng, [], [3, 9, 4]))
    assert decode.mode == StepMode.decode_graph(4)
    assert decode.metadata.mode is decode.mode  # what backends' plan read
    mixed = runner.prepare_inputs(make_seqs(engine, rng, [5], [3, 9]))
    assert mixed.mode == StepMode.piecewise(16)
    captured = set(runner.piecewise.captured)
    runner.piecewise.captured.discard(16)
    try:
        eager = runner.prepare_inputs(make_seqs(engine, rng, [5], [3]))
    finally:
        runner.piecewise.captured = captured
    assert eager.mode == StepMode() and eager.mode.is_eager

    calls = []
    # a decode graph returns the hidden states and the logits
    monkeypatch.setattr(runner.decode, "replay", lambda b: (calls.append(("decode", b)), None))
    monkeypatch.setattr(runner.piecewise, "run", lambda b, *a: calls.append(("piecewise", b)))
    monkeypatch.setattr(runner, "model", lambda ids, pos: calls.append(("eager", len(ids))))
    for inputs in (decode, mixed, eager):
        runner.run(inputs)
    assert calls == [("decode", 4), ("piecewise", 16), ("eager", 6)]


def test_backends_prepare_each_capture_before_its_plan(monkeypatch):
    """prepare_capture(mode, batch) comes once per bucket, with the capture batch, before plan."""
    engine = Engine(
        model="tiny-llama",
        device="cpu",
        max_num_seqs=2,
        max_num_tokens=16,
        max_model_len=32,
        page_size=PAGE,
        num_kv_pages=40,
        cuda_graphs="off",
        backends=TORCH_BACKENDS,
    )
    attention = engine.backends["attention"]
    events = []
    plan = attention.plan

    def record_capture(mode, batch):
        assert batch.mode == mode
        events.append(("capture", mode, batch.num_seqs, batch.block_table.shape[1]))

    def record_plan(batch):
        events.append(("plan", batch.mode))
        return plan(batch)

    monkeypatch.setattr(attention, "prepare_capture", record_capture)
    monkeypatch.setattr(attention, "plan", record_plan)
    runner = GraphModelRunner(
        engine.model,
        engine.backends,
        engine.input_batch,
        mode=GraphMode.FULL_AND_PIECEWISE,
        max_num_tokens=16,
        max_num_seqs=2,
        max_model_len=32,
        page_size=PAGE,
        token_bucket_sizes=[8],
        decode_bucket_sizes=[1, 2],
    )
    runner.capture()
    pw16, pw8 = StepMode.piecewise(16), StepMode.piecewise(8)
    d2, d1 = StepMode.decode_graph(2), StepMode.decode_graph(1)
    full = runner.max_pages
    assert events == [
        ("capture", pw16, 1, 4),
        ("plan", pw16),
        ("capture", pw8, 1, 2),
        ("plan", pw8),
        ("capture", d2, 2, full),  # the largest batch of the bucket: full-width tables
        ("plan", d2),
        ("capture", d1, 1, full),
        ("plan", d1),
    ]


def test_token_buckets_longer_than_the_model_are_captured():
    # a 64-token bucket with max_model_len 16 is captured with several scratch sequences
    engine, runner = build_runner(
        "tiny-llama",
        "cpu",
        max_model_len=16,
        num_kv_pages=64,
        mode=GraphMode.PIECEWISE,
        token_bucket_sizes=[8, 32, 64],
    )
    runner.capture()
    assert runner.piecewise.failed == {}
    assert runner.piecewise.captured == {8, 32, 64}
    seqs = make_seqs(engine, np.random.default_rng(5), [16, 16, 12], [7, 3])
    inputs = _compare(engine, runner, seqs, seed=5)
    assert inputs.metadata.padded_num_tokens == 64
