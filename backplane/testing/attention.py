"""Conformance tests for attention backends.

Subclass :class:`AttentionBackendTests` and provide a ``backend`` fixture::

    import pytest
    from backplane.testing.attention import AttentionBackendTests

    class TestMyAttention(AttentionBackendTests):
        @pytest.fixture
        def backend(self):
            return MyAttentionBackend()

Every batch of :func:`backplane.testing.batches.batch_cases` runs on every
device/dtype the backend declares; the output is compared with a naive float64
per-sequence, per-token, per-head reference (:func:`reference_attention`) and
the KV cache with the expected contents (new keys/values at their slots,
every other entry untouched). Grouped-query heads and sliding windows are
tested when the backend declares the ``gqa`` / ``sliding_window`` capability.
Class attributes set the shapes for backends with restrictions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from backplane.core import layouts
from backplane.core.families import AttentionLayerSpec
from backplane.core.forward_context import forward_context
from backplane.core.metadata import BatchMetadata
from backplane.testing.batches import BatchCase, batch_cases
from backplane.testing.checks import (
    assert_close_to_reference,
    check_out_contract,
    no_host_sync,
    record_custom_ops,
    run_opcheck,
)
from backplane.testing.plugin import BackendTestsBase, require_feature

_CASE_NAMES = [c.name for c in batch_cases()]


def reference_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cached_len: int,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Naive float64 causal attention of one sequence's new tokens.

    :param q: ``[L, H, D]`` queries of the sequence's ``L`` new tokens, which sit
        at positions ``cached_len .. cached_len + L - 1``.
    :param keys: ``[S, Hkv, D]`` keys of every position ``0 .. S-1`` of the sequence.
    :param values: ``[S, Hkv, Dv]`` values of every position.
    :param cached_len: tokens before the first query.
    :param scale: softmax scale.
    :param sliding_window: attend to at most this many most recent keys; 0 = all.
    :return: ``[L, H, Dv]`` in float64.
    """
    q, keys, values = q.double(), keys.double(), values.double()
    num_q, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    out = torch.zeros(num_q, num_heads, values.shape[-1], dtype=torch.float64)
    for j in range(num_q):
        pos = cached_len + j
        lo = max(0, pos - sliding_window + 1) if sliding_window > 0 else 0
        for h in range(num_heads):
            kv = h // group
            scores = keys[lo : pos + 1, kv] @ q[j, h] * scale
            probs = torch.softmax(scores, dim=0)
            out[j, h] = probs @ values[lo : pos + 1, kv]
    return out


@dataclass
class AttentionInputs:
    """One batch's inputs and the kit's view of them.

    :param q: ``[T, H, D]`` queries (padding rows NaN).
    :param k: ``[T, Hkv, D]`` new keys (padding rows NaN).
    :param v: ``[T, Hkv, D]`` new values (padding rows NaN).
    :param kv_cache: the cache before the step (random, with the cached prefix written).
    :param keys: per sequence ``[seq_len, Hkv, D]``: every key of the sequence.
    :param values: per sequence ``[seq_len, Hkv, D]``.
    :param expected_cache: the cache as it must be after the step.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    expected_cache: torch.Tensor


def _slots(case: BatchCase, seq: int, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) of each position of sequence ``seq``, from its page table."""
    table = case.page_tables[seq]
    pages = torch.tensor([table[p // case.page_size] for p in positions], dtype=torch.long)
    offsets = torch.tensor([p % case.page_size for p in positions], dtype=torch.long)
    return pages, offsets


def make_attention_inputs(
    case: BatchCase,
    layer: AttentionLayerSpec,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> AttentionInputs:
    """Random inputs and a prefilled shared-layout KV cache for ``case``.

    The whole cache starts random (so reading a foreign page shows), then the
    cached prefix of every sequence is written at the slots its page table
    gives; padding rows of ``q``/``k``/``v`` are NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    hkv, d = layer.num_kv_heads, layer.head_dim
    spec = layouts.paged_kv(case.num_pages, case.page_size, hkv, d, dtype)
    cache = torch.randn(spec.shape, generator=gen).to(dtype)
    padded = case.padded_num_tokens
    q = torch.full((padded, layer.num_heads, d), float("nan"), dtype=dtype)
    k = torch.full((padded, hkv, d), float("nan"), dtype=dtype)
    v = torch.full((padded, hkv, d), float("nan"), dtype=dtype)
    expected = cache.clone()
    keys, values = [], []
    start = 0
    for i, (ql, cl) in enumerate(zip(case.query_lens, case.cached_lens, strict=True)):
        total = ql + cl
        seq_k = torch.randn(total, hkv, d, generator=gen).to(dtype)
        seq_v = torch.randn(total, hkv, d, generator=gen).to(dtype)
        keys.append(seq_k)
        values.append(seq_v)
        q[start : start + ql] = torch.randn(ql, layer.num_heads, d, generator=gen).to(dtype)
        k[start : start + ql] = seq_k[cl:]
        v[start : start + ql] = seq_v[cl:]
        pages, offsets = _slots(case, i, range(cl))
        cache[pages, 0, offsets] = seq_k[:cl]
        cache[pages, 1, offsets] = seq_v[:cl]
        pages, offsets = _slots(case, i, range(total))
        expected[pages, 0, offsets] = seq_k
        expected[pages, 1, offsets] = seq_v
        start += ql
    return AttentionInputs(
        q=q.to(device),
        k=k.to(device),
        v=v.to(device),
        kv_cache=cache.to(device),
        keys=keys,
        values=values,
        expected_cache=expected,
    )


def reference_outputs(
    case: BatchCase, inputs: AttentionInputs, layer: AttentionLayerSpec
) -> torch.Tensor:
    """The float64 reference for the real tokens of ``case``: ``[num_tokens, H, D]``."""
    outs = []
    start = 0
    q = inputs.q.cpu()
    for i, (ql, cl) in enumerate(zip(case.query_lens, case.cached_lens, strict=True)):
        outs.append(
            reference_attention(
                q[start : start + ql],
                inputs.keys[i],
                inputs.values[i],
                cl,
                layer.softmax_scale,
                layer.sliding_window,
            )
        )
        start += ql
    return torch.cat(outs)


class AttentionBackendTests(BackendTestsBase):
    """The conformance suite of the attention family (see the module docstring)."""

    family: ClassVar[str] = "attention"
    #: Head dimension of every test layer (override for kernels with restrictions).
    head_dim: ClassVar[int] = 16
    #: Query heads of the plain multi-head tests.
    num_heads: ClassVar[int] = 2
    #: ``(num_heads, num_kv_heads)`` of the grouped-query tests (``gqa`` capability).
    gqa_shapes: ClassVar[tuple[tuple[int, int], ...]] = ((4, 2), (4, 1))
    #: Windows of the sliding-window tests (``sliding_window`` capability).
    sliding_windows: ClassVar[tuple[int, ...]] = (1, 3)
    #: Page size of every case, or ``None`` for the kit's mix of small pages.
    page_size: ClassVar[int | None] = None
    #: dtype of the tests that run in one dtype only (opcheck, custom scale, out validation).
    single_dtype: ClassVar[torch.dtype] = torch.float32

    # -- fixtures ------------------------------------------------------------------------------
    @pytest.fixture(params=_CASE_NAMES)
    def case(self, request: pytest.FixtureRequest) -> BatchCase:
        """One standard ragged batch."""
        return self.get_case(request.param)

    def get_case(self, name: str) -> BatchCase:
        """The standard case called ``name`` (with this class's page size)."""
        return {c.name: c for c in batch_cases(page_size=self.page_size)}[name]

    def layer(
        self, num_heads: int | None = None, num_kv_heads: int | None = None, **kw: Any
    ) -> AttentionLayerSpec:
        """The layer constants of a test (multi-head unless told otherwise)."""
        h = num_heads or self.num_heads
        return AttentionLayerSpec(
            layer_id=0, num_heads=h, num_kv_heads=num_kv_heads or h, head_dim=self.head_dim, **kw
        )

    # -- helpers -------------------------------------------------------------------------------
    def run_step(
        self,
        backend: Any,
        batch: BatchMetadata,
        inputs: AttentionInputs,
        layer: AttentionLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Plan and run one forward of ``backend`` on ``batch``."""
        plan = backend.plan(batch)
        with forward_context(batch, {self.family: plan}):
            return backend.forward(inputs.q, inputs.k, inputs.v, inputs.kv_cache, layer, out=out)

    def check_against_reference(
        self,
        backend: Any,
        case: BatchCase,
        layer: AttentionLayerSpec,
        dtype: torch.dtype,
        device: torch.device,
        table_width: int | None = None,
    ) -> None:
        """Run ``case`` and compare the output and the cache with the reference."""
        self.check_cache_spec(backend, case, layer, dtype)
        batch = case.metadata(device, table_width=table_width)
        inputs = make_attention_inputs(case, layer, dtype, device)
        out = self.run_step(backend, batch, inputs, layer)
        n = case.num_tokens
        assert out.shape == inputs.q.shape, (
            f"output shape {tuple(out.shape)} != {tuple(inputs.q.shape)}"
        )
        assert out.dtype == dtype
        assert_close_to_reference(
            out[:n], reference_outputs(case, inputs, layer), dtype, msg=f"case {case.name}"
        )
        assert torch.equal(inputs.kv_cache.cpu(), inputs.expected_cache), (
            f"case {case.name}: the KV cache after the step differs from the expected contents "
            "(new keys/values at slot_mapping, every other entry untouched)"
        )

    def check_cache_spec(
        self, backend: Any, case: BatchCase, layer: AttentionLayerSpec, dtype: torch.dtype
    ) -> None:
        """Skip unless the backend uses the shared paged-KV layout (the kit writes the cache)."""
        spec = backend.cache_spec(
            layer, num_pages=case.num_pages, page_size=case.page_size, dtype=dtype
        )
        shared = layouts.paged_kv(
            case.num_pages, case.page_size, layer.num_kv_heads, layer.head_dim, dtype
        )
        if spec.get("kv_cache") != shared:
            pytest.skip(
                f"backend cache spec {spec} is not the shared paged-KV layout the kit fills"
            )

    # -- tests ---------------------------------------------------------------------------------
    def test_matches_reference(
        self, backend: Any, case: BatchCase, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Output rows match the float64 reference; the cache holds exactly the new K/V."""
        self.check_against_reference(backend, case, self.layer(), dtype, device)

    @pytest.mark.parametrize("case_name", ["decode", "mixed"])
    def test_wide_block_table(
        self, backend: Any, case_name: str, dtype: torch.dtype, device: torch.device
    ) -> None:
        """A block table wider than needed (page-0 padded, as in persistent buffers) is fine."""
        case = self.get_case(case_name)
        width = max(len(t) for t in case.page_tables) + 3
        self.check_against_reference(backend, case, self.layer(), dtype, device, width)

    @pytest.mark.parametrize("case_name", ["mixed", "decode", "prefill"])
    def test_out_contract(
        self, backend: Any, case_name: str, dtype: torch.dtype, device: torch.device
    ) -> None:
        """NaN-poisoned out: rows written, tail exactly zero, empty sentinel, same cache."""
        case = self.get_case(case_name)
        layer = self.layer()
        batch = case.metadata(device)
        inputs = make_attention_inputs(case, layer, dtype, device, seed=1)
        full = check_out_contract(
            lambda out: self.run_step(backend, batch, inputs, layer, out=out),
            [inputs.kv_cache],
            case.num_tokens,
        )
        assert_close_to_reference(
            full[: case.num_tokens], reference_outputs(case, inputs, layer), dtype
        )

    def test_out_buffer_validation(self, backend: Any, device: torch.device) -> None:
        """An out buffer of the wrong shape or dtype is rejected, not silently used."""
        case = batch_cases(page_size=self.page_size)[0]
        layer = self.layer()
        batch = case.metadata(device)
        inputs = make_attention_inputs(case, layer, self.single_dtype, device)
        bad_shape = torch.empty(
            inputs.q.shape[0] + 1, *inputs.q.shape[1:], dtype=self.single_dtype, device=device
        )
        other = torch.float64 if self.single_dtype != torch.float64 else torch.float32
        bad_dtype = torch.empty(inputs.q.shape, dtype=other, device=device)
        for bad in (bad_shape, bad_dtype):
            with pytest.raises((ValueError, RuntimeError)):
                self.run_step(backend, batch, inputs, layer, out=bad)

    @pytest.mark.parametrize("shape", [0, 1], ids=["gqa", "mqa"])
    @pytest.mark.parametrize("case_name", ["mixed", "page_crossing"])
    def test_grouped_query_heads(
        self,
        backend: Any,
        backend_capabilities: Any,
        shape: int,
        case_name: str,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Grouped-query / multi-query heads (query head h reads KV head h // group)."""
        require_feature(backend_capabilities, "gqa")
        heads, kv_heads = self.gqa_shapes[shape]
        case = self.get_case(case_name)
        self.check_against_reference(backend, case, self.layer(heads, kv_heads), dtype, device)

    @pytest.mark.parametrize("window_index", [0, 1], ids=["w0", "w1"])
    @pytest.mark.parametrize("case_name", ["mixed", "page_crossing", "chunked_prefill"])
    def test_sliding_window(
        self,
        backend: Any,
        backend_capabilities: Any,
        window_index: int,
        case_name: str,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Sliding-window attention: at most ``window`` most recent keys per query."""
        require_feature(backend_capabilities, "sliding_window")
        window = self.sliding_windows[window_index]
        case = self.get_case(case_name)
        layer = self.layer(sliding_window=window)
        self.check_against_reference(backend, case, layer, dtype, device)

    def test_custom_scale(self, backend: Any, device: torch.device) -> None:
        """An explicit softmax scale is honoured (not replaced by head_dim ** -0.5)."""
        case = self.get_case("mixed")
        self.check_against_reference(
            backend, case, self.layer(scale=0.7), self.single_dtype, device
        )

    def test_opcheck(self, backend: Any, device: torch.device) -> None:
        """Every custom op forward calls passes torch.library.opcheck and is a dynamic op."""
        case = self.get_case("mixed")
        layer = self.layer()
        batch = case.metadata(device)
        inputs = make_attention_inputs(case, layer, self.single_dtype, device)
        out_buf = torch.empty_like(inputs.q)
        _, calls = record_custom_ops(
            lambda: self.run_step(backend, batch, inputs, layer, out=out_buf)
        )
        assert calls, "forward called no custom op; cached ops must be torch.library custom ops"
        dynamic = set(backend.dynamic_ops())
        for op, args, kwargs in calls:
            assert op in dynamic, (
                f"forward called {op} which dynamic_ops() does not list; the graph runner "
                "splits only at listed ops"
            )
            with forward_context(batch, {self.family: backend.plan(batch)}):
                run_opcheck(op, args, kwargs)
                # The plain form (no out) must pass too.
                if kwargs.get("out") is not None:
                    run_opcheck(op, args, {**kwargs, "out": None})

    @pytest.mark.gpu
    def test_no_host_sync(self, backend: Any, dtype: torch.dtype, device: torch.device) -> None:
        """The op never synchronises with the device (CUDA sync debug mode 'error')."""
        if device.type != "cuda":
            pytest.skip("host synchronisation is only observable on CUDA")
        case = self.get_case("mixed")
        layer = self.layer()
        batch = case.metadata(device)
        inputs = make_attention_inputs(case, layer, dtype, device)
        out = torch.empty_like(inputs.q)
        plan = backend.plan(batch)
        torch.cuda.synchronize()
        with forward_context(batch, {self.family: plan}), no_host_sync(device):
            backend.forward(inputs.q, inputs.k, inputs.v, inputs.kv_cache, layer, out=out)
        torch.cuda.synchronize()
        assert_close_to_reference(
            out[: case.num_tokens], reference_outputs(case, inputs, layer), dtype
        )
