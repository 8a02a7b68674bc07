"""Conformance tests for multi-head latent attention (MLA) backends.

Subclass :class:`MLABackendTests` and provide a ``backend`` fixture (see
:mod:`backplane.testing.attention` for the pattern). The reference
(:func:`reference_mla`) expands every cached latent into per-head keys and
values in float64 and attends token by token, head by head — the textbook
form, independent of the weight-absorbed or expanded shortcuts a backend
takes. The latent cache is checked entry by entry after every step.
Class attributes set the dimensions for kernels with restrictions (e.g.
``kv_lora_rank = 512, qk_rope_head_dim = 64``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from backplane.core import layouts
from backplane.core.families import MLALayerSpec
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
from backplane.testing.plugin import BackendTestsBase

_CASE_NAMES = [c.name for c in batch_cases()]


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


class MLABackendTests(BackendTestsBase):
    """The conformance suite of the MLA family (see the module docstring)."""

    family: ClassVar[str] = "mla"
    num_heads: ClassVar[int] = 2
    kv_lora_rank: ClassVar[int] = 16
    qk_nope_head_dim: ClassVar[int] = 8
    qk_rope_head_dim: ClassVar[int] = 4
    v_head_dim: ClassVar[int] = 8
    #: Page size of every case, or ``None`` for the kit's mix of small pages.
    page_size: ClassVar[int | None] = None
    #: dtype of the tests that run in one dtype only (opcheck, custom scale, out validation).
    single_dtype: ClassVar[torch.dtype] = torch.float32

    @pytest.fixture(params=_CASE_NAMES)
    def case(self, request: pytest.FixtureRequest) -> BatchCase:
        """One standard ragged batch."""
        return self.get_case(request.param)

    def get_case(self, name: str) -> BatchCase:
        """The standard case called ``name`` (with this class's page size)."""
        return {c.name: c for c in batch_cases(page_size=self.page_size)}[name]

    def layer(self, scale: float | None = None) -> MLALayerSpec:
        """The layer constants of the tests."""
        qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        return MLALayerSpec(
            layer_id=0,
            num_heads=self.num_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            scale=scale if scale is not None else 1.0 / math.sqrt(qk_dim),
        )

    def run_step(
        self,
        backend: Any,
        batch: BatchMetadata,
        inputs: MLAInputs,
        layer: MLALayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Plan and run one forward of ``backend`` on ``batch``."""
        plan = backend.plan(batch)
        with forward_context(batch, {self.family: plan}):
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

    def check_cache_spec(
        self, backend: Any, case: BatchCase, layer: MLALayerSpec, dtype: torch.dtype
    ) -> None:
        """Skip unless the backend uses the shared latent layout (the kit writes the cache)."""
        spec = backend.cache_spec(
            layer, num_pages=case.num_pages, page_size=case.page_size, dtype=dtype
        )
        shared = layouts.mla_latent(
            case.num_pages, case.page_size, layer.kv_lora_rank, layer.qk_rope_head_dim, dtype
        )
        if spec.get("latent_cache") != shared:
            pytest.skip(f"backend cache spec {spec} is not the shared latent layout the kit fills")

    def check_against_reference(
        self,
        backend: Any,
        case: BatchCase,
        layer: MLALayerSpec,
        dtype: torch.dtype,
        device: torch.device,
        table_width: int | None = None,
    ) -> None:
        """Run ``case`` and compare the output and the cache with the reference."""
        self.check_cache_spec(backend, case, layer, dtype)
        batch = case.metadata(device, table_width=table_width)
        inputs = make_mla_inputs(case, layer, dtype, device)
        out = self.run_step(backend, batch, inputs, layer)
        n = case.num_tokens
        expected_shape = (case.padded_num_tokens, layer.num_heads, layer.v_head_dim)
        assert tuple(out.shape) == expected_shape, (
            f"output shape {tuple(out.shape)} != {expected_shape}"
        )
        assert out.dtype == dtype
        assert_close_to_reference(
            out[:n], reference_outputs(case, inputs, layer), dtype, msg=f"case {case.name}"
        )
        assert torch.equal(inputs.latent_cache.cpu(), inputs.expected_cache), (
            f"case {case.name}: the latent cache after the step differs from the expected "
            "contents (new [kv_c, k_pe] rows at slot_mapping, every other entry untouched)"
        )

    # -- tests ---------------------------------------------------------------------------------
    def test_matches_reference(
        self, backend: Any, case: BatchCase, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Output rows match the float64 reference; the cache holds exactly the new latents."""
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
        inputs = make_mla_inputs(case, layer, dtype, device, seed=1)
        full = check_out_contract(
            lambda out: self.run_step(backend, batch, inputs, layer, out=out),
            [inputs.latent_cache],
            case.num_tokens,
        )
        assert_close_to_reference(
            full[: case.num_tokens], reference_outputs(case, inputs, layer), dtype
        )

    def test_out_buffer_validation(self, backend: Any, device: torch.device) -> None:
        """An out buffer of the wrong shape or dtype is rejected, not silently used."""
        case = self.get_case("mixed")
        layer = self.layer()
        batch = case.metadata(device)
        inputs = make_mla_inputs(case, layer, self.single_dtype, device)
        shape = (case.padded_num_tokens, layer.num_heads, layer.v_head_dim)
        other = torch.float64 if self.single_dtype != torch.float64 else torch.float32
        bad_shape = torch.empty(
            shape[0], shape[1], shape[2] + 1, dtype=self.single_dtype, device=device
        )
        bad_dtype = torch.empty(shape, dtype=other, device=device)
        for bad in (bad_shape, bad_dtype):
            with pytest.raises((ValueError, RuntimeError)):
                self.run_step(backend, batch, inputs, layer, out=bad)

    def test_custom_scale(self, backend: Any, device: torch.device) -> None:
        """The layer's softmax scale is honoured."""
        layer = self.layer(scale=0.3)
        self.check_against_reference(
            backend, self.get_case("mixed"), layer, self.single_dtype, device
        )

    def test_opcheck(self, backend: Any, device: torch.device) -> None:
        """Every custom op forward calls passes torch.library.opcheck and is a dynamic op."""
        case = self.get_case("mixed")
        layer = self.layer()
        batch = case.metadata(device)
        inputs = make_mla_inputs(case, layer, self.single_dtype, device)
        out_buf = torch.empty(
            case.padded_num_tokens,
            layer.num_heads,
            layer.v_head_dim,
            dtype=self.single_dtype,
            device=device,
        )
        _, calls = record_custom_ops(
            lambda: self.run_step(backend, batch, inputs, layer, out=out_buf)
        )
        assert calls, "forward called no custom op; cached ops must be torch.library custom ops"
        dynamic = set(backend.dynamic_ops())
        for op, args, kwargs in calls:
            assert op in dynamic, f"forward called {op} which dynamic_ops() does not list"
            with forward_context(batch, {self.family: backend.plan(batch)}):
                run_opcheck(op, args, kwargs)
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
        inputs = make_mla_inputs(case, layer, dtype, device)
        out = torch.empty(
            case.padded_num_tokens, layer.num_heads, layer.v_head_dim, dtype=dtype, device=device
        )
        plan = backend.plan(batch)
        torch.cuda.synchronize()
        with forward_context(batch, {self.family: plan}), no_host_sync(device):
            backend.forward(
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
        torch.cuda.synchronize()
        assert_close_to_reference(
            out[: case.num_tokens], reference_outputs(case, inputs, layer), dtype
        )
