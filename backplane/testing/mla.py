"""Conformance tests for multi-head latent attention (MLA) backends.

Subclass :class:`MLABackendTests` and provide a ``backend`` fixture (see
:mod:`backplane.testing.attention` for the pattern). The reference
(:func:`reference_mla`) expands every cached latent into per-head keys and
values in float64 and attends token by token, head by head — the textbook
form, independent of the weight-absorbed or expanded shortcuts a backend
takes. The latent cache is checked entry by entry after every step. A backend that
sets ``supports_fp8_kv_cache`` also runs a ``float8_e4m3fn`` latent cache
holding ``row / kv_scale``: the new rows must land in it rounded to e4m3 (bit
for bit, :func:`~backplane.testing.fp8.to_fp8`) and the output must match the
reference over the latents as the cache holds them within
:data:`~backplane.testing.fp8.FP8_KV_TOLERANCE`.
Class attributes set the dimensions for kernels with restrictions (e.g.
``kv_lora_rank = 512, qk_rope_head_dim = 64``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import pytest
import torch

from backplane.core import layouts
from backplane.core.families import MLALayerSpec
from backplane.core.layouts import TensorSpec
from backplane.testing.batches import BatchCase
from backplane.testing.fp8 import FP8_KV_TOLERANCE, dequantised, to_fp8
from backplane.testing.paged import PagedBackendTests


def reference_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latents: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    cached_len: int,
    scale: float,
) -> torch.Tensor:
    """Naive float64 causal MLA of one sequence's new tokens.

    For head ``h`` the key of position ``s`` is ``[w_uk[h] @ latents[s], k_pe[s]]``
    and its value ``w_uv[h] @ latents[s]``.

    :param q_nope: ``[L, H, nope]`` of the ``L`` new tokens (positions
        ``cached_len ..``).
    :param q_pe: ``[L, H, rope]``.
    :param latents: ``[S, kv_lora_rank]`` of every position of the sequence.
    :param k_pe: ``[S, rope]`` of every position.
    :param w_uk: ``[H, nope, kv_lora_rank]``.
    :param w_uv: ``[H, v_dim, kv_lora_rank]``.
    :param cached_len: tokens before the first query.
    :param scale: softmax scale.
    :return: ``[L, H, v_dim]`` in float64.
    """
    q_nope, q_pe, latents, k_pe = q_nope.double(), q_pe.double(), latents.double(), k_pe.double()
    w_uk, w_uv = w_uk.double(), w_uv.double()
    num_q, num_heads, _ = q_nope.shape
    out = torch.zeros(num_q, num_heads, w_uv.shape[1], dtype=torch.float64)
    for h in range(num_heads):
        keys = torch.cat([latents @ w_uk[h].T, k_pe], dim=-1)  # [S, nope + rope]
        values = latents @ w_uv[h].T  # [S, v_dim]
        for j in range(num_q):
            pos = cached_len + j
            query = torch.cat([q_nope[j, h], q_pe[j, h]])
            probs = torch.softmax(keys[: pos + 1] @ query * scale, dim=0)
            out[j, h] = probs @ values[: pos + 1]
    return out


@dataclass
class MLAInputs:
    """One batch's MLA inputs and the kit's view of them."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    latent_cache: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    latents: list[torch.Tensor]
    rope_keys: list[torch.Tensor]
    expected_cache: torch.Tensor


def make_mla_inputs(
    case: BatchCase, layer: MLALayerSpec, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> MLAInputs:
    """Random inputs and a prefilled shared-layout latent cache for ``case``.

    The cache starts random; each sequence's cached prefix is written at the
    slots its page table gives; padding rows of the inputs are NaN. Weights
    are scaled so that keys and values have unit variance.
    """
    gen = torch.Generator().manual_seed(seed)
    h, rank, rope = layer.num_heads, layer.kv_lora_rank, layer.qk_rope_head_dim
    nope, vdim = layer.qk_nope_head_dim, layer.v_head_dim
    spec = layouts.mla_latent(case.num_pages, case.page_size, rank, rope, dtype)
    cache = torch.randn(spec.shape, generator=gen).to(dtype)
    expected = cache.clone()
    padded = case.padded_num_tokens
    nan = float("nan")
    q_nope = torch.full((padded, h, nope), nan, dtype=dtype)
    q_pe = torch.full((padded, h, rope), nan, dtype=dtype)
    kv_c = torch.full((padded, rank), nan, dtype=dtype)
    k_pe = torch.full((padded, rope), nan, dtype=dtype)
    w_uk = (torch.randn(h, nope, rank, generator=gen) / math.sqrt(rank)).to(dtype)
    w_uv = (torch.randn(h, vdim, rank, generator=gen) / math.sqrt(rank)).to(dtype)
    latents, rope_keys = [], []
    start = 0
    for i, (ql, cl) in enumerate(zip(case.query_lens, case.cached_lens, strict=True)):
        total = ql + cl
        lat = torch.randn(total, rank, generator=gen).to(dtype)
        kpe = torch.randn(total, rope, generator=gen).to(dtype)
        latents.append(lat)
        rope_keys.append(kpe)
        q_nope[start : start + ql] = torch.randn(ql, h, nope, generator=gen).to(dtype)
        q_pe[start : start + ql] = torch.randn(ql, h, rope, generator=gen).to(dtype)
        kv_c[start : start + ql] = lat[cl:]
        k_pe[start : start + ql] = kpe[cl:]
        table = case.page_tables[i]
        for pos in range(total):
            page, off = table[pos // case.page_size], pos % case.page_size
            row = torch.cat([lat[pos], kpe[pos]])
            expected[page, off] = row
            if pos < cl:
                cache[page, off] = row
        start += ql
    return MLAInputs(
        q_nope=q_nope.to(device),
        q_pe=q_pe.to(device),
        kv_c=kv_c.to(device),
        k_pe=k_pe.to(device),
        latent_cache=cache.to(device),
        w_uk=w_uk.to(device),
        w_uv=w_uv.to(device),
        latents=latents,
        rope_keys=rope_keys,
        expected_cache=expected,
    )


def reference_outputs(case: BatchCase, inputs: MLAInputs, layer: MLALayerSpec) -> torch.Tensor:
    """The float64 reference for the real tokens of ``case``: ``[num_tokens, H, v_dim]``."""
    outs = []
    start = 0
    q_nope, q_pe = inputs.q_nope.cpu(), inputs.q_pe.cpu()
    w_uk, w_uv = inputs.w_uk.cpu(), inputs.w_uv.cpu()
    for i, (ql, cl) in enumerate(zip(case.query_lens, case.cached_lens, strict=True)):
        rows = slice(start, start + ql)
        outs.append(
            reference_mla(
                q_nope[rows],
                q_pe[rows],
                inputs.latents[i],
                inputs.rope_keys[i],
                w_uk,
                w_uv,
                cl,
                layer.scale,
            )
        )
        start += ql
    return torch.cat(outs)


class MLABackendTests(PagedBackendTests):
    """The conformance suite of the MLA family (see the module docstring).

    Its tests are the paged-cache tests of :class:`~backplane.testing.paged.PagedBackendTests`
    on the latent cache.
    """

    family: ClassVar[str] = "mla"
    cache_name: ClassVar[str] = "latent_cache"
    cache_rows: ClassVar[str] = "new [kv_c, k_pe] rows"
    custom_scale: ClassVar[float] = 0.3
    num_heads: ClassVar[int] = 2
    kv_lora_rank: ClassVar[int] = 16
    qk_nope_head_dim: ClassVar[int] = 8
    qk_rope_head_dim: ClassVar[int] = 4
    v_head_dim: ClassVar[int] = 8

    def layer(self, scale: float | None = None, kv_scale: float = 1.0) -> MLALayerSpec:
        """The layer constants of the tests.

        :param scale: softmax scale (default ``(nope + rope) ** -0.5``).
        :param kv_scale: an FP8 latent cache holds ``row / kv_scale``.
        :return: the layer spec.
        """
        qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        return MLALayerSpec(
            layer_id=0,
            num_heads=self.num_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            scale=scale if scale is not None else 1.0 / math.sqrt(qk_dim),
            kv_scale=kv_scale,
        )

    #: See :func:`make_mla_inputs`.
    make_inputs = staticmethod(make_mla_inputs)

    def call_forward(
        self,
        backend: Any,
        inputs: MLAInputs,
        layer: MLALayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``backend.forward(q_nope, q_pe, kv_c, k_pe, latent_cache, w_uk, w_uv, layer, out=out)``."""
        return backend.forward(
            inputs.q_nope,
            inputs.q_pe,
            inputs.kv_c,
            inputs.k_pe,
            inputs.latent_cache,
            inputs.w_uk,
            inputs.w_uv,
            layer,
            out=out,
        )

    #: See :func:`reference_outputs`.
    reference = staticmethod(reference_outputs)

    def out_shape(self, case: BatchCase, layer: MLALayerSpec) -> tuple[int, ...]:
        """``[padded tokens, num_heads, v_head_dim]``."""
        return (case.padded_num_tokens, layer.num_heads, layer.v_head_dim)

    def shared_cache_layout(
        self, case: BatchCase, layer: MLALayerSpec, dtype: torch.dtype
    ) -> TensorSpec:
        """The shared latent layout."""
        return layouts.mla_latent(
            case.num_pages, case.page_size, layer.kv_lora_rank, layer.qk_rope_head_dim, dtype
        )

    @pytest.mark.parametrize("kv_scale", [0.5, 3.0])
    @pytest.mark.parametrize("case_name", ["mixed", "decode", "page_crossing", "chunked_prefill"])
    def test_fp8_kv_cache(
        self,
        backend: Any,
        case_name: str,
        kv_scale: float,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """A ``float8_e4m3fn`` latent cache holding ``[kv_c, k_pe] / kv_scale``."""
        if not getattr(backend, "supports_fp8_kv_cache", False):
            pytest.skip("the backend does not declare supports_fp8_kv_cache")
        case = self.get_case(case_name)
        layer = self.layer(kv_scale=kv_scale)
        self.check_cache_spec(backend, case, layer, torch.float8_e4m3fn)
        inputs = self.make_inputs(case, layer, dtype, device)
        cache = to_fp8(inputs.latent_cache.cpu(), kv_scale).to(device)
        # the reference attends to every latent and rotary key as the cache holds it
        inputs = replace(
            inputs,
            latent_cache=cache,
            latents=[dequantised(x, kv_scale) for x in inputs.latents],
            rope_keys=[dequantised(x, kv_scale) for x in inputs.rope_keys],
        )
        out = self.run_step(backend, case.metadata(device), inputs, layer)
        assert out.dtype == dtype
        atol, rtol = FP8_KV_TOLERANCE
        torch.testing.assert_close(
            out[: case.num_tokens].to("cpu", torch.float64),
            self.reference(case, inputs, layer),
            atol=atol,
            rtol=rtol,
            msg=lambda m: f"case {case.name} with an FP8 latent cache\n{m}",
        )
        expected = to_fp8(inputs.expected_cache, kv_scale).view(torch.uint8)
        assert torch.equal(cache.cpu().view(torch.uint8), expected), (
            f"case {case.name}: the FP8 latent_cache after the step is not the expected "
            "contents (new [kv_c, k_pe] / kv_scale rounded to e4m3 at slot_mapping, every "
            "other entry untouched)"
        )
