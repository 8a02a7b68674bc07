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
tested when the backend declares the ``gqa`` / ``sliding_window`` capability,
and a quantised cache (``float8_e4m3fn`` with per-layer ``k_scale`` /
``v_scale``) when it sets ``supports_fp8_kv_cache``: the new rows must land
in the cache as ``key / k_scale`` rounded to e4m3 (bit for bit), and the output
must match the reference over the keys and values the cache holds within
:data:`~backplane.testing.fp8.FP8_KV_TOLERANCE`.
Class attributes set the shapes for backends with restrictions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import pytest
import torch

from backplane.core import layouts
from backplane.core.families import AttentionLayerSpec
from backplane.core.layouts import TensorSpec
from backplane.testing.batches import BatchCase
from backplane.testing.fp8 import FP8_KV_TOLERANCE, dequantised
from backplane.testing.fp8 import to_fp8 as _to_fp8
from backplane.testing.paged import PagedBackendTests
from backplane.testing.plugin import require_feature


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


class AttentionBackendTests(PagedBackendTests):
    """The conformance suite of the attention family (see the module docstring).

    The tests shared with MLA live in :class:`~backplane.testing.paged.PagedBackendTests`;
    grouped-query heads and sliding windows are attention's own.
    """

    family: ClassVar[str] = "attention"
    cache_name: ClassVar[str] = "kv_cache"
    cache_rows: ClassVar[str] = "new keys/values"
    custom_scale: ClassVar[float] = 0.7
    #: Head dimension of every test layer (override for kernels with restrictions).
    head_dim: ClassVar[int] = 16
    #: Query heads of the plain multi-head tests.
    num_heads: ClassVar[int] = 2
    #: ``(num_heads, num_kv_heads)`` of the grouped-query tests (``gqa`` capability).
    gqa_shapes: ClassVar[tuple[tuple[int, int], ...]] = ((4, 2), (4, 1))
    #: Windows of the sliding-window tests (``sliding_window`` capability).
    sliding_windows: ClassVar[tuple[int, ...]] = (1, 3)

    # -- the family's hooks --------------------------------------------------------------------
    def layer(
        self, num_heads: int | None = None, num_kv_heads: int | None = None, **kw: Any
    ) -> AttentionLayerSpec:
        """The layer constants of a test (multi-head unless told otherwise).

        :param num_heads: query heads (default :attr:`num_heads`).
        :param num_kv_heads: key/value heads (default: as many as query heads).
        :param kw: other :class:`~backplane.core.families.AttentionLayerSpec` fields.
        :return: the layer spec.
        """
        h = num_heads or self.num_heads
        return AttentionLayerSpec(
            layer_id=0, num_heads=h, num_kv_heads=num_kv_heads or h, head_dim=self.head_dim, **kw
        )

    #: See :func:`make_attention_inputs`.
    make_inputs = staticmethod(make_attention_inputs)

    def call_forward(
        self,
        backend: Any,
        inputs: AttentionInputs,
        layer: AttentionLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``backend.forward(q, k, v, kv_cache, layer, out=out)``."""
        return backend.forward(inputs.q, inputs.k, inputs.v, inputs.kv_cache, layer, out=out)

    #: See :func:`reference_outputs`.
    reference = staticmethod(reference_outputs)

    def out_shape(self, case: BatchCase, layer: AttentionLayerSpec) -> tuple[int, ...]:
        """``[padded tokens, num_heads, head_dim]``."""
        return (case.padded_num_tokens, layer.num_heads, layer.head_dim)

    def shared_cache_layout(
        self, case: BatchCase, layer: AttentionLayerSpec, dtype: torch.dtype
    ) -> TensorSpec:
        """The shared paged-KV layout."""
        return layouts.paged_kv(
            case.num_pages, case.page_size, layer.num_kv_heads, layer.head_dim, dtype
        )

    # -- tests of attention only ---------------------------------------------------------------
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

    @pytest.mark.parametrize("layout", ["qkv", "gated_q"])
    @pytest.mark.parametrize("case_name", ["mixed", "decode", "page_crossing"])
    def test_fused_projection_views(
        self,
        backend: Any,
        backend_capabilities: Any,
        case_name: str,
        layout: str,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """``q``, ``k`` and ``v`` as views into one fused projection's rows.

        A model computes queries, keys and values with one GEMM and hands the
        backend strided views of its output (unit stride in the head
        dimension): ``qkv`` rows ``[q heads | k heads | v heads]``, heads
        adjacent; ``gated_q`` rows whose query heads each carry a gate of
        ``head_dim`` after them (``[q0 g0 q1 g1 ... | k | v]``, as gated
        attention projects them), so query heads are ``2 * head_dim`` apart.
        The backend must read them as they lie, copying only where its kernels
        need it.
        """
        case = self.get_case(case_name)
        gqa = backend_capabilities is not None and "gqa" in backend_capabilities
        layer = self.layer(*self.gqa_shapes[0]) if gqa else self.layer()

        def as_fused_views(inputs: AttentionInputs) -> AttentionInputs:
            t, h, hk, d = inputs.q.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
            q_part = inputs.q
            if layout == "gated_q":
                q_part = torch.cat([inputs.q, torch.full_like(inputs.q, float("nan"))], dim=-1)
            fused = torch.cat([x.reshape(t, -1) for x in (q_part, inputs.k, inputs.v)], dim=1)
            q, k, v = fused.split([q_part[0].numel(), hk * d, hk * d], dim=1)
            q = q.view(t, h, -1)[..., :d]
            assert not q.is_contiguous() or t == 1
            return replace(inputs, q=q, k=k.view(t, hk, d), v=v.view(t, hk, d))

        self.check_against_reference(backend, case, layer, dtype, device, relayout=as_fused_views)

    @pytest.mark.parametrize("case_name", ["mixed", "decode", "page_crossing", "chunked_prefill"])
    def test_fp8_kv_cache(
        self, backend: Any, case_name: str, dtype: torch.dtype, device: torch.device
    ) -> None:
        """A ``float8_e4m3fn`` KV cache holding ``key / k_scale`` and ``value / v_scale``."""
        if not getattr(backend, "supports_fp8_kv_cache", False):
            pytest.skip("the backend does not declare supports_fp8_kv_cache")
        case = self.get_case(case_name)
        k_scale, v_scale = 0.5, 2.0
        layer = self.layer(k_scale=k_scale, v_scale=v_scale)
        self.check_cache_spec(backend, case, layer, torch.float8_e4m3fn)
        inputs = self.make_inputs(case, layer, dtype, device)
        start, expected = inputs.kv_cache.cpu(), inputs.expected_cache

        def quantised(cache: torch.Tensor) -> torch.Tensor:
            return torch.stack(
                [_to_fp8(cache[:, 0], k_scale), _to_fp8(cache[:, 1], v_scale)], dim=1
            )

        kv_cache = quantised(start).to(device)
        # the reference attends to every key and value as the cache holds it
        rounded = [
            (dequantised(k, k_scale), dequantised(v, v_scale))
            for k, v in zip(inputs.keys, inputs.values, strict=True)
        ]
        inputs = replace(
            inputs,
            kv_cache=kv_cache,
            keys=[k for k, _ in rounded],
            values=[v for _, v in rounded],
        )
        out = self.run_step(backend, case.metadata(device), inputs, layer)
        assert out.dtype == dtype
        atol, rtol = FP8_KV_TOLERANCE
        torch.testing.assert_close(
            out[: case.num_tokens].to("cpu", torch.float64),
            self.reference(case, inputs, layer),
            atol=atol,
            rtol=rtol,
            msg=lambda m: f"case {case.name} with an FP8 KV cache\n{m}",
        )
        got = kv_cache.cpu().view(torch.uint8)
        assert torch.equal(got, quantised(expected).view(torch.uint8)), (
            f"case {case.name}: the FP8 kv_cache after the step is not the expected contents "
            "(new keys / k_scale and values / v_scale rounded to e4m3 at slot_mapping, every "
            "other entry untouched)"
        )

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
