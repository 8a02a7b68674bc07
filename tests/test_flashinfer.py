"""FlashInfer plugin: registration, availability reasons, shape limits and the host-side logic.

These tests run everywhere. Without flashinfer or CUDA they check that every
FlashInfer backend is listed and unavailable with a clear reason; the host-side
pieces (CUDA-graph bucket padding, prefill sub-batches, the torch decode step of
the delta backend, the SSM backend's delegation, ``backplane warmup``) run on
the CPU. Kernel tests are in ``test_flashinfer_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from backplane.core.errors import BackendUnavailableError
from backplane.core.families import (
    AttentionLayerSpec,
    DeltaLayerSpec,
    MLALayerSpec,
    SSMLayerSpec,
)
from backplane.core.forward_context import forward_context
from backplane.core.hookspecs import FAMILIES
from backplane.core.metadata import StepMode
from backplane.core.packing import build_batch_metadata
from backplane.core.registry import get_registry
from backplane.engine.selection import load_backend, select_backend
from backplane.plugins import flashinfer as fi_plugin

FLASHINFER_READY = fi_plugin.availability()[0]


def _spec(family: str):
    return get_registry().get(family, "flashinfer")


# -- registration and availability --------------------------------------------------


def test_plugin_import_is_cheap() -> None:
    """Importing the plugin module imports neither torch nor flashinfer."""
    code = (
        "import sys; import backplane.plugins.flashinfer; "
        "print('torch' in sys.modules, 'flashinfer' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["False", "False"], res.stdout + res.stderr


@pytest.mark.parametrize("family", FAMILIES)
def test_listed_for_every_family(family: str) -> None:
    """Every family has a flashinfer backend from the flashinfer plugin, ranked above torch."""
    spec = _spec(family)
    assert spec.plugin == "flashinfer"
    assert spec.description
    torch_spec = get_registry().get(family, "torch")
    assert spec.priority > torch_spec.priority
    triton = [s for s in get_registry().backends(family) if s.name == "triton"]
    if triton:
        assert spec.priority > triton[0].priority


@pytest.mark.skipif(FLASHINFER_READY, reason="flashinfer and CUDA are usable here")
@pytest.mark.parametrize("family", FAMILIES)
def test_unavailable_here_with_reason(family: str) -> None:
    """Without flashinfer or CUDA: unavailable, the reason says which, selection explains."""
    ok, reason = _spec(family).availability()
    assert not ok
    assert "flashinfer" in reason or "CUDA" in reason, reason
    with pytest.raises(BackendUnavailableError, match="flashinfer"):
        select_backend(family, "flashinfer")
    assert select_backend(family, "auto").name != "flashinfer"


@pytest.mark.parametrize(
    ("capability", "family", "expected"),
    [
        ((9, 0), "attention", None),
        ((8, 0), "attention", None),
        ((7, 5), "attention", "compute capability >= 8.0"),
        ((9, 0), "delta", None),
        ((8, 6), "delta", "Hopper"),
        ((10, 0), "delta", "Hopper"),
        ((8, 0), "mla", None),
        ((8, 0), "ssm", None),
    ],
)
def test_availability_by_compute_capability(
    monkeypatch: pytest.MonkeyPatch, capability, family: str, expected: str | None
) -> None:
    """With flashinfer and CUDA present, compute capability decides (GDN prefill: sm90 only)."""
    monkeypatch.setattr(fi_plugin, "module_missing", lambda name: None)
    monkeypatch.setattr(fi_plugin, "cuda_reason", lambda: None)
    monkeypatch.setattr(fi_plugin, "_capability", lambda: capability)
    hook = {
        "attention": fi_plugin.backplane_attention_backends,
        "mla": fi_plugin.backplane_mla_backends,
        "ssm": fi_plugin.backplane_ssm_backends,
        "delta": fi_plugin.backplane_delta_backends,
    }[family]
    ok, reason = hook()[0].availability()
    if expected is None:
        assert ok and reason == ""
    else:
        assert not ok and expected in reason, reason


def test_missing_package_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing flashinfer package is reported before anything else, with the install hint."""
    monkeypatch.setattr(
        fi_plugin, "module_missing", lambda name: f"python package '{name}' is not installed"
    )
    ok, reason = fi_plugin.availability()
    assert not ok
    assert "flashinfer" in reason and "pip install" in reason


# -- per-layer shape limits -------------------------------------------------------------


def test_attention_shape_limits() -> None:
    """Head dims 64/128/256 in half precision run; others say why."""
    from backplane.backends.flashinfer.attention import FlashInferAttentionBackend

    ok = FlashInferAttentionBackend.supports
    assert ok(AttentionLayerSpec(0, 8, 2, 128), torch.bfloat16) == (True, "")
    assert ok(AttentionLayerSpec(0, 8, 8, 64, sliding_window=4), torch.float16)[0]
    good, reason = ok(AttentionLayerSpec(0, 4, 2, 16), torch.bfloat16)
    assert not good and "head_dim" in reason
    good, reason = ok(AttentionLayerSpec(0, 4, 2, 128), torch.float32)
    assert not good and "float32" in reason


def test_mla_shape_limits() -> None:
    """MLA runs with latent 512 + rope 64 only."""
    from backplane.backends.flashinfer.mla import FlashInferMLABackend

    good = MLALayerSpec(0, 16, 512, 128, 64, 128, 0.1)
    assert FlashInferMLABackend.supports(good, torch.bfloat16) == (True, "")
    ok, reason = FlashInferMLABackend.supports(
        MLALayerSpec(0, 4, 32, 16, 8, 16, 0.2), torch.bfloat16
    )
    assert not ok and "512" in reason and "64" in reason


def test_delta_shape_limits() -> None:
    """GDN prefill needs head dim 128 and value heads a multiple of key heads."""
    from backplane.backends.flashinfer.delta import FlashInferDeltaBackend

    sup = FlashInferDeltaBackend.supports
    assert sup(DeltaLayerSpec(0, 16, 32, 128, 128), torch.bfloat16) == (True, "")
    ok, reason = sup(DeltaLayerSpec(0, 2, 4, 16, 16), torch.bfloat16)
    assert not ok and "128" in reason
    ok, reason = sup(DeltaLayerSpec(0, 4, 2, 128, 128), torch.bfloat16)
    assert not ok and "multiple" in reason


def test_ssm_shape_limits() -> None:
    """Mamba2 decode needs head_dim % 64 == 0 and d_state % 32 == 0 (FlashInfer's sm90 tiles)."""
    from backplane.backends.flashinfer.ssm import FlashInferSSMBackend

    sup = FlashInferSSMBackend.supports
    assert sup(SSMLayerSpec(0, 128, 64, 128, 8), torch.bfloat16) == (True, "")
    ok, reason = sup(SSMLayerSpec(0, 8, 16, 16, 2), torch.bfloat16)
    assert not ok and "head_dim" in reason and "d_state" in reason
    ok, reason = sup(SSMLayerSpec(0, 8, 64, 16, 2), torch.bfloat16)
    assert not ok and "16" in reason


def test_unsupported_layer_error_is_raised_at_forward() -> None:
    """Forward on an unsupported shape raises a BackendUnavailableError (also a ValueError)."""
    from backplane.backends.flashinfer.attention import FlashInferAttentionBackend

    backend = FlashInferAttentionBackend()
    x = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    cache = torch.zeros(2, 2, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match="head_dim") as info:
        backend.forward(x, x[:, :2], x[:, :2], cache, AttentionLayerSpec(0, 4, 2, 16))
    assert isinstance(info.value, ValueError)


def test_cache_spec_refuses_unsupported_layers_naming_the_backend() -> None:
    """Describing caches checks the layer, so an engine can fall back before loading weights.

    The error carries its family (what the engine's ``auto`` fallback goes by) and the
    message names ``<family> backend 'flashinfer'`` and the limit.
    """
    from backplane.backends.flashinfer.attention import FlashInferAttentionBackend
    from backplane.backends.flashinfer.delta import FlashInferDeltaBackend
    from backplane.backends.flashinfer.mla import FlashInferMLABackend
    from backplane.backends.flashinfer.ssm import FlashInferSSMBackend
    from backplane.backends.torch.ssm import TorchSSMBackend

    bf16 = torch.bfloat16
    cases = [
        (
            FlashInferAttentionBackend(),
            AttentionLayerSpec(0, 4, 2, 16),
            dict(num_pages=4, page_size=4),
        ),
        (
            FlashInferMLABackend(),
            MLALayerSpec(0, 4, 32, 16, 8, 16, 0.2),
            dict(num_pages=4, page_size=4),
        ),
        (
            FlashInferSSMBackend(fallback=TorchSSMBackend()),
            SSMLayerSpec(0, 8, 16, 16, 2),
            dict(num_slots=3),
        ),
        (FlashInferDeltaBackend(), DeltaLayerSpec(0, 2, 4, 16, 16), dict(num_slots=3)),
    ]
    for backend, layer, kw in cases:
        with pytest.raises(BackendUnavailableError) as info:
            backend.cache_spec(layer, dtype=bf16, **kw)
        assert f"{backend.family} backend 'flashinfer'" in str(info.value)
        assert (info.value.family, info.value.backend) == (backend.family, "flashinfer")
    good = FlashInferDeltaBackend().cache_spec(
        DeltaLayerSpec(0, 2, 4, 128, 128), num_slots=3, dtype=bf16
    )
    assert good["delta_state"].shape == (3, 4, 128, 128)


def test_cpu_batch_is_refused_clearly() -> None:
    """Planning a CPU batch says the backend needs CUDA."""
    from backplane.backends.flashinfer.attention import FlashInferAttentionBackend

    batch = build_batch_metadata([3], [0], [[1]], 4)
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        FlashInferAttentionBackend().plan(batch)


# -- host-side logic ------------------------------------------------------------------------


def test_graph_bucket_padding() -> None:
    """A decode batch padded to its bucket: padding sequences own scratch page 0, masked rows."""
    from backplane.backends.flashinfer._common import GraphBucketBuffers

    tables = [[7, 3], [5], [2, 9, 4]]
    cached = [5, 2, 9]
    batch = build_batch_metadata([1, 1, 1], cached, tables, 4, padded_num_tokens=5)
    bufs = GraphBucketBuffers.allocate(5, 16, torch.device("cpu"))
    a = bufs.host_arrays(batch)
    # Independent expectation: real sequences keep their pages, padding gets one page 0 each.
    assert a["kv_indptr"].tolist() == [0, 2, 3, 6, 7, 8]
    assert a["kv_indices"].tolist() == [7, 3, 5, 2, 9, 4, 0, 0]
    seq_lens = [c + 1 for c in cached]
    assert a["kv_last_page_len"].tolist() == [(s - 1) % 4 + 1 for s in seq_lens] + [1, 1]
    assert a["kv_lens"].tolist() == seq_lens + [1, 1]
    assert a["positions"].tolist() == cached + [0, 0]
    assert a["pad_mask"].tolist() == [False, False, False, True, True]
    bufs.fill(a) if torch.cuda.is_available() else None


def test_graph_bucket_without_padding_sequences() -> None:
    """A batch already padded with (scratch) sequences to the bucket needs no extra entries."""
    from backplane.backends.flashinfer._common import GraphBucketBuffers

    batch = build_batch_metadata([1, 1], [3, 6], [[4], [0, 0]], 4)
    a = GraphBucketBuffers.allocate(2, 8, torch.device("cpu")).host_arrays(batch)
    assert a["kv_indptr"].tolist() == [0, 1, 3]
    assert a["kv_indices"].tolist() == [4, 0, 0]
    assert a["pad_mask"].tolist() == [False, False]
    assert a["positions"].tolist() == [3, 6]


def test_graph_buckets_follow_the_step_mode() -> None:
    """Only steps the runner made decode-graph steps use a bucket, whatever their shape."""
    from backplane.backends.flashinfer._common import bucket_capacity, graph_bucket

    def decode(n, padded=None, pages=None, mode=StepMode()):
        tables = pages if pages is not None else [[i + 1] for i in range(n)]
        return build_batch_metadata(
            [1] * n, [2] * n, tables, 4, padded_num_tokens=padded, mode=mode
        )

    assert graph_bucket(decode(4)) is None  # graph-shaped but eager: eager wrappers
    assert graph_bucket(decode(3, pages=[[0]] * 3)) is None  # scratch pages, still eager
    assert graph_bucket(decode(4, mode=StepMode.decode_graph(4))) == 4
    assert graph_bucket(decode(3, padded=4, mode=StepMode.decode_graph(4))) == 4
    assert graph_bucket(decode(3, padded=4, mode=StepMode.piecewise(4))) is None
    mixed = build_batch_metadata([2, 1], [0, 3], [[1], [2]], 4)
    assert graph_bucket(mixed) is None
    with pytest.raises(ValueError, match="decode graph of bucket 4"):
        graph_bucket(dataclasses.replace(mixed, mode=StepMode.decode_graph(4)))
    # one sequence of 3 pages: block table 3 wide, 6 pages in all -> 4 x 3 entries
    wide = build_batch_metadata([1] * 4, [9, 2, 2, 2], [[1, 2, 3], [4], [5], [6]], 4)
    assert bucket_capacity(wide, 4) == 12
    # the graph runner's capture batch: every sequence at the full block-table width
    full = build_batch_metadata([1] * 2, [9, 2], [[1, 2, 3], [4]], 4, block_table_width=8)
    assert bucket_capacity(full, 2) == 16


def test_graph_bucket_grows_until_fixed_for_capture() -> None:
    """A bucket grows for a wider batch (dropping its wrappers) but never once fixed."""
    from backplane.backends.flashinfer._common import ensure_bucket, fix_bucket

    cpu = torch.device("cpu")
    prepared: dict = {}
    wrappers = {(2, "key"): object(), (4, "key"): object()}
    small = build_batch_metadata([1, 1], [2, 3], [[1], [2]], 4)
    buf = ensure_bucket(prepared, wrappers, small, 2, cpu)
    assert prepared[2] is buf and len(buf.kv_indices) >= 2
    assert ensure_bucket(prepared, wrappers, small, 2, cpu) is buf  # reused
    big = build_batch_metadata([1, 1], [30, 30], [list(range(1, 9)), list(range(9, 17))], 4)
    grown = ensure_bucket(prepared, wrappers, big, 2, cpu)
    assert grown is not buf and len(grown.kv_indices) >= 16
    assert (2, "key") not in wrappers and (4, "key") in wrappers
    assert fix_bucket(prepared, wrappers, big, 2, cpu) is grown and grown.fixed
    huge = build_batch_metadata([1, 1], [60, 60], [list(range(1, 17)), list(range(17, 33))], 4)
    with pytest.raises(ValueError, match="prepare_capture"):
        ensure_bucket(prepared, wrappers, huge, 2, cpu)


def test_graph_bucket_rejects_wrong_batches() -> None:
    """Mixed batches and batches larger than the bucket or its page capacity are refused."""
    from backplane.backends.flashinfer._common import GraphBucketBuffers

    bufs = GraphBucketBuffers.allocate(2, 3, torch.device("cpu"))
    mixed = build_batch_metadata([3, 1], [0, 4], [[1], [2, 3]], 4)
    with pytest.raises(ValueError, match="decode-only"):
        bufs.host_arrays(mixed)
    too_many = build_batch_metadata([1, 1, 1], [1, 1, 1], [[1], [2], [3]], 4)
    with pytest.raises(ValueError, match="at most 2"):
        bufs.host_arrays(too_many)
    too_long = build_batch_metadata([1, 1], [12, 1], [[1, 2, 3, 4], [5]], 4)
    with pytest.raises(ValueError, match="pages"):
        bufs.host_arrays(too_long)


def test_slice_prefill_views() -> None:
    """The prefill part of a mixed batch: right counts, host slices, device views."""
    from backplane.backends.flashinfer._common import slice_prefill

    batch = build_batch_metadata(
        [4, 3, 1, 1],
        [0, 5, 6, 2],
        [[3, 8], [1, 6], [2, 4], [5]],
        4,
        state_slots=[4, 1, 3, 2],
        padded_num_tokens=12,
    )
    sub = slice_prefill(batch)
    assert (sub.num_prefill_seqs, sub.num_decode_seqs) == (2, 0)
    assert sub.num_tokens == sub.padded_num_tokens == 7
    assert sub.host.state_slots.tolist() == [4, 1]
    assert sub.host.page_indices.tolist() == [3, 1, 6]
    assert sub.max_seq_len == 8 and sub.max_query_len == 4
    assert sub.positions.data_ptr() == batch.positions.data_ptr()
    assert sub.state_slots.tolist() == [4, 1]
    assert sub.query_start_loc.tolist() == [0, 4, 7]
    import dataclasses

    from backplane.core.metadata import HostBatch

    lengths = {"query_start_loc": 3, "page_indptr": 3, "page_indices": 3}
    lengths.update(dict.fromkeys(("positions", "slot_mapping", "token_seq_ids"), 7))
    for f in dataclasses.fields(HostBatch):
        host, dev = getattr(sub.host, f.name), getattr(sub, f.name)
        assert len(host) == lengths.get(f.name, 2), f.name
        assert dev.tolist() == host.tolist() == getattr(batch.host, f.name)[: len(host)].tolist()


def _naive_delta_decode(q, k, v, g, beta, state, slots, scale):
    """float64, per sequence and head: S = e^g S; S += beta k (v - k^T S); o = (scale q)^T S."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    state = state.double().clone()
    hv, hk = v.shape[1], q.shape[1]
    out = torch.zeros(v.shape, dtype=torch.float64)
    for i, slot in enumerate(slots):
        for h in range(hv):
            kh = h // (hv // hk)
            qi = q[i, kh] / q[i, kh].norm().clamp_min(1e-12)
            ki = k[i, kh] / k[i, kh].norm().clamp_min(1e-12)
            s = state[slot, h] * torch.exp(g[i, h])
            s = s + beta[i, h] * torch.outer(ki, v[i, h] - ki @ s)
            state[slot, h] = s
            out[i, h] = (scale * qi) @ s
    return out, state


def test_delta_torch_decode_step_matches_reference() -> None:
    """The delta backend's torch decode step (used when fla is absent) vs a float64 loop."""
    from backplane.backends.flashinfer.delta import FlashInferDeltaBackend
    from backplane.testing.checks import check_out_contract

    gen = torch.Generator().manual_seed(0)
    n, hk, hv, dk, dv, slots_total = 3, 2, 4, 8, 6, 6
    slots = [4, 1, 3]
    batch = build_batch_metadata(
        [1, 1, 1], [5, 2, 7], [[1, 2], [3], [4, 5]], 4, state_slots=slots, padded_num_tokens=4
    )
    q = torch.randn(4, hk, dk, generator=gen)
    k = torch.randn(4, hk, dk, generator=gen)
    v = torch.randn(4, hv, dv, generator=gen)
    g = -torch.rand(4, hv, generator=gen)
    beta = torch.rand(4, hv, generator=gen)
    state = torch.randn(slots_total, hv, dk, dv, generator=gen)
    expected_out, expected_state = _naive_delta_decode(
        q[:n], k[:n], v[:n], g[:n], beta[:n], state, slots, 0.3
    )
    backend = FlashInferDeltaBackend(decode_impl="torch")

    def run(out):
        with forward_context(batch, {"delta": backend.plan(batch)}):
            return torch.ops.backplane_flashinfer.delta(
                q, k, v, g, beta, state, backend.handle, 0.3, True, 1, out
            )

    start = state.clone()
    full = check_out_contract(run, [state], n)
    torch.testing.assert_close(full[:n].double(), expected_out, atol=1e-5, rtol=1e-5)
    # check_out_contract leaves the state as the second run wrote it: one step from `start`.
    torch.testing.assert_close(state.double(), expected_state, atol=1e-5, rtol=1e-5)
    untouched = [s for s in range(slots_total) if s not in slots]
    assert torch.equal(state[untouched], start[untouched])


def test_ssm_prefill_delegates_to_fallback() -> None:
    """Prefill-only batches run entirely on the fallback backend, under the out contract."""
    from backplane.backends.flashinfer.ssm import FlashInferSSMBackend
    from backplane.backends.torch.ssm import TorchSSMBackend
    from backplane.testing.checks import check_out_contract

    fallback = TorchSSMBackend()
    backend = FlashInferSSMBackend(fallback=TorchSSMBackend())
    assert backend.fallback_name == "torch"
    layer = SSMLayerSpec(0, nheads=2, head_dim=64, d_state=32, n_groups=1, chunk_size=4)
    batch = build_batch_metadata(
        [5, 3], [0, 0], [[1, 2], [3]], 4, state_slots=[2, 1], padded_num_tokens=10
    )
    gen = torch.Generator().manual_seed(1)
    t = 10
    args = (
        torch.randn(t, 2, 64, generator=gen),
        torch.randn(t, 2, generator=gen),
        -torch.rand(2, generator=gen) - 0.5,
        torch.randn(t, 1, 32, generator=gen),
        torch.randn(t, 1, 32, generator=gen),
        torch.randn(2, generator=gen),
        torch.randn(2, generator=gen),
        torch.randn(t, 2, 64, generator=gen),
    )
    state = torch.zeros(4, 2, 64, 32)
    ref_state = state.clone()
    with forward_context(batch, {"ssm": fallback.plan(batch)}):
        ref = fallback.scan(*args, ref_state, layer)

    def run(out):
        with forward_context(batch, {"ssm": backend.plan(batch)}):
            return backend.scan(*args, state, layer, out=out)

    full = check_out_contract(run, [state], 8)
    torch.testing.assert_close(full, ref)
    torch.testing.assert_close(state, ref_state)


# -- warmup ------------------------------------------------------------------------------


def test_warmup_command_is_registered() -> None:
    """``backplane warmup`` exists and documents the FlashInfer cache directory."""
    from backplane.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["warmup", "tiny-llama", "--backend", "attention=torch"])
    assert callable(args.func)
    sub = next(a for a in parser._actions if a.dest == "command")
    assert "FLASHINFER_WORKSPACE_BASE" in sub.choices["warmup"].description


def test_warmup_collects_shapes_and_runs_each_once() -> None:
    """Layer shapes come from the model built on meta; each distinct shape runs once."""
    from backplane.cli.warmup import _model_specs, warmup

    registry = get_registry()
    backends = {f: load_backend(select_backend(f, "torch", registry=registry)) for f in FAMILIES}
    specs, _ = _model_specs("tiny-nemotron-h", backends)
    assert len(specs["attention"]) == 1 and len(specs["ssm"]) == 1 and len(specs["conv"]) == 1
    results = warmup(specs, backends, dtype=torch.float32, device=torch.device("cpu"))
    assert [r.family for r in results] == ["attention", "ssm", "conv"]
    assert all(r.error is None for r in results), [r.error for r in results]


def test_warmup_reports_failures_per_shape() -> None:
    """A shape the backend cannot run is reported, the others still warm."""
    from backplane.backends.flashinfer.attention import FlashInferAttentionBackend
    from backplane.cli.warmup import warmup

    specs = {"attention": [AttentionLayerSpec(0, 4, 2, 16)]}
    results = warmup(
        specs, {"attention": FlashInferAttentionBackend()}, dtype=torch.bfloat16, device="cpu"
    )
    assert len(results) == 1 and results[0].error and "head_dim" in results[0].error


def test_numpy_host_arrays_are_int32() -> None:
    """Plans hand FlashInfer int32 host tensors (its index type)."""
    from backplane.backends.flashinfer._common import host_tensor

    t = host_tensor(np.arange(5, dtype=np.int64))
    assert t.dtype == torch.int32 and t.device.type == "cpu" and t.is_contiguous()


def test_warmup_command_with_explicit_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    """``backplane warmup --attention/--ssm/--delta`` runs each shape once and reports it."""
    from backplane.cli import main

    args = ["warmup", "--attention", "4:2:16:3", "--ssm", "2:8:8:1", "--delta", "2:4:8:8"]
    for family in FAMILIES:
        args += ["--backend", f"{family}=torch"]
    rc = main([*args, "--device", "cpu", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "sliding_window=3" in out and "conv_dim=32" in out and "num_v_heads=4" in out
    assert "4 shape(s) warmed" in out


def test_warmup_command_needs_something_to_warm() -> None:
    """Without a model or a shape, warmup is a user error (exit code 2)."""
    from backplane.cli import main

    assert main(["warmup", "--backend", "attention=torch", "--device", "cpu"]) == 2
