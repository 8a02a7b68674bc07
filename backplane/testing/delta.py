"""Conformance tests of the ``delta`` family (gated delta rule, Qwen3-Next linear attention).

Subclass :class:`DeltaBackendTests` and provide a ``backend`` fixture::

    from backplane.testing.delta import DeltaBackendTests
    from backplane.testing.plugin import backend_params, load_backend

    class TestMyDelta(DeltaBackendTests):
        @pytest.fixture(params=backend_params("delta"))
        def backend(self, request):
            return load_backend(request.param)

The reference is a naive float64 per-token recurrence written from
:meth:`backplane.core.families.DeltaBackend.forward` (and the conventions of
Qwen3-Next in ``transformers``: value head ``h`` reads key head
``h // (Hv / Hk)``, the L2 norm is ``x * rsqrt(sum(x^2) + 1e-6)``); it shares no
code with any backend. State slots of sequences without initial state hold NaN
before the call; unused slots hold random values that must come back untouched.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from backplane.core.families import DeltaLayerSpec
from backplane.core.metadata import BatchMetadata
from backplane.testing.batches import BatchCase
from backplane.testing.plugin import require_feature
from backplane.testing.recurrent import (
    OpCall,
    RecurrentBackendTests,
    assert_recurrence_close,
    prompt_chunks,
    random_state,
    single_sequence_batch,
    step_rows,
)

#: Epsilon of the in-kernel L2 norm of q and k.
L2NORM_EPS = 1e-6


def reference_gated_delta_rule(
    batch: BatchMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive float64 gated delta rule, one token and one value head at a time.

    Per token and value head: ``S = exp(g) S``; ``S += beta k (v - S^T k)^T``;
    ``o = S^T (scale q)``.

    :param batch: the step's metadata (host arrays are used).
    :param q: ``[T, Hk, Dk]``.
    :param k: ``[T, Hk, Dk]``.
    :param v: ``[T, Hv, Dv]``.
    :param g: ``[T, Hv]``.
    :param beta: ``[T, Hv]``.
    :param state: ``[num_slots, Hv, Dk, Dv]`` before the step.
    :param scale: the q scale.
    :param use_qk_l2norm: L2-normalise q and k first.
    :return: ``(o [num_tokens, Hv, Dv], state after the step)``, float64 on CPU.
    """
    host = batch.host
    q, k, v, g, beta = (t.detach().double().cpu() for t in (q, k, v, g, beta))
    old = state.detach().double().cpu()
    new = old.clone()
    num_k_heads, num_v_heads = q.shape[1], v.shape[1]
    per_k = num_v_heads // num_k_heads
    o = torch.zeros(batch.num_tokens, num_v_heads, v.shape[2], dtype=torch.float64)
    for i in range(batch.num_seqs):
        slot = int(host.state_slots[i])
        s = old[slot].clone() if host.has_initial_state[i] else torch.zeros_like(old[slot])
        for t in range(int(host.query_start_loc[i]), int(host.query_start_loc[i + 1])):
            for h in range(num_v_heads):
                qt, kt = q[t, h // per_k], k[t, h // per_k]
                if use_qk_l2norm:
                    qt = qt / torch.sqrt((qt * qt).sum() + L2NORM_EPS)
                    kt = kt / torch.sqrt((kt * kt).sum() + L2NORM_EPS)
                sh = torch.exp(g[t, h]) * s[h]
                sh = sh + beta[t, h] * torch.outer(kt, v[t, h] - sh.T @ kt)
                s[h] = sh
                o[t, h] = sh.T @ (scale * qt)
        new[slot] = s
    return o, new


class DeltaBackendTests(RecurrentBackendTests):
    """Conformance tests of a ``delta`` backend.

    Class attributes set the (small) layer shapes; a subclass may override them.
    ``k_head_dim != v_head_dim`` on purpose, so that transposed states fail.
    """

    family: ClassVar[str] = "delta"
    NUM_K_HEADS: ClassVar[int] = 2
    K_HEAD_DIM: ClassVar[int] = 8
    V_HEAD_DIM: ClassVar[int] = 6

    #: Prompts longer than one 64-token chunk.
    LONG_CASE: ClassVar[dict[str, Any]] = {
        "query_lens": [70, 9, 1],
        "cached_lens": [0, 66, 5],
        "page_size": 16,
        "seed": 7,
    }

    def layer(self, num_v_heads: int, use_qk_l2norm: bool) -> DeltaLayerSpec:
        """The layer constants used by the tests (default scale ``k_head_dim ** -0.5``)."""
        return DeltaLayerSpec(
            layer_id=0,
            num_k_heads=self.NUM_K_HEADS,
            num_v_heads=num_v_heads,
            k_head_dim=self.K_HEAD_DIM,
            v_head_dim=self.V_HEAD_DIM,
            use_qk_l2norm=use_qk_l2norm,
        )

    def inputs(
        self,
        batch: BatchMetadata,
        num_slots: int,
        layer: DeltaLayerSpec,
        dtype: torch.dtype,
        device: torch.device,
        *,
        seed: int = 0,
    ) -> dict[str, Any]:
        """Random inputs with Qwen3-Next-like magnitudes.

        Without the in-kernel L2 norm, q and k are normalised here (as a model
        would before calling), since the delta rule is only stable for
        ``beta * |k|^2 < 2``.
        """
        gen = torch.Generator().manual_seed(seed)
        T, hk, hv = batch.padded_num_tokens, layer.num_k_heads, layer.num_v_heads

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=gen, dtype=torch.float32)

        q, k = rnd(T, hk, layer.k_head_dim), rnd(T, hk, layer.k_head_dim)
        if not layer.use_qk_l2norm:
            q, k = (
                torch.nn.functional.normalize(q, dim=-1),
                torch.nn.functional.normalize(k, dim=-1),
            )
        # g = -exp(A_log) * softplus(a + dt_bias) as in Qwen3-Next: decays of 0.2 .. 1 per token
        g = -torch.exp(torch.rand(hv, generator=gen) - 1) * torch.nn.functional.softplus(
            rnd(T, hv) - 1
        )
        beta = torch.sigmoid(rnd(T, hv))
        cast = {"device": device, "dtype": dtype}
        return {
            "q": q.to(**cast),
            "k": k.to(**cast),
            "v": rnd(T, hv, layer.v_head_dim).to(**cast),
            "g": g.to(**cast),
            "beta": beta.to(**cast),
            "state": random_state(
                (num_slots, hv, layer.k_head_dim, layer.v_head_dim),
                torch.float32,
                batch,
                gen,
                device,
                scale=0.3,
            ),
        }

    def _layer_for(self, variant: str, capabilities: Any) -> DeltaLayerSpec:
        if variant == "l2norm_grouped":
            require_feature(capabilities, "qk_l2norm", "grouped_v_heads")
            return self.layer(2 * self.NUM_K_HEADS, True)
        return self.layer(self.NUM_K_HEADS, False)

    def op_calls(
        self,
        backend: Any,
        case: BatchCase,
        batch: BatchMetadata,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[OpCall]:
        """A ``forward`` call with the in-kernel L2 norm, one value head per key head."""
        layer = self.layer(self.NUM_K_HEADS, True)
        inp = self.inputs(batch, case.num_slots, layer, dtype, device, seed=13)
        return [
            OpCall(
                run=lambda out: backend.forward(*inp.values(), layer, out=out),
                out_like=inp["v"],
                per_token_inputs=[inp["q"], inp["k"], inp["v"]],
                states=[inp["state"]],
            )
        ]

    def test_cache_spec(self, backend: Any) -> None:
        """The default cache spec is the shared float32 delta-state layout."""
        spec = backend.cache_spec(self.layer(4, True), num_slots=3, dtype=torch.bfloat16)
        assert spec["delta_state"].shape == (3, 4, self.K_HEAD_DIM, self.V_HEAD_DIM)
        assert spec["delta_state"].dtype == torch.float32

    @pytest.mark.parametrize("variant", ["plain", "l2norm_grouped"])
    def test_matches_reference(
        self,
        backend: Any,
        backend_capabilities: Any,
        device: torch.device,
        dtype: torch.dtype,
        case: BatchCase,
        variant: str,
    ) -> None:
        """Output and state equal the float64 reference; the out contract holds.

        ``l2norm_grouped`` turns on the in-kernel L2 norm and shares each key
        head between two value heads.
        """
        layer = self._layer_for(variant, backend_capabilities)
        batch = case.metadata(device)
        inp = self.inputs(batch, case.num_slots, layer, dtype, device)
        args = [inp[n] for n in ("q", "k", "v", "g", "beta", "state")]
        expected, expected_state = reference_gated_delta_rule(
            batch, *args, scale=layer.q_scale, use_qk_l2norm=layer.use_qk_l2norm
        )
        full = self.check_out_contract(
            backend, batch, lambda out: backend.forward(*args, layer, out=out), [inp["state"]]
        )
        assert full.shape == inp["v"].shape and full.dtype == dtype
        assert_recurrence_close(
            full[: batch.num_tokens],
            expected,
            inp["state"],
            expected_state,
            dtype,
            ("delta output", "delta state"),
        )

    @pytest.mark.parametrize(
        "chunks", [(5, 3, 1, 1, 1), (1, 2, 1, 70)], ids=["5-3-d-d-d", "1-2-d-70"]
    )
    def test_chunked_equals_whole_prompt(
        self,
        backend: Any,
        backend_capabilities: Any,
        device: torch.device,
        dtype: torch.dtype,
        chunks: tuple[int, ...],
    ) -> None:
        """A prompt run whole equals the same prompt in chunks (+ decodes), outputs and state."""
        layer = self._layer_for("l2norm_grouped", backend_capabilities)
        total, slot, num_slots = sum(chunks), 3, 4
        whole = single_sequence_batch(total, 0, slot, device, padding=0)
        inp = self.inputs(whole, num_slots, layer, dtype, device, seed=3)
        names = ("q", "k", "v", "g", "beta")

        def step(batch: BatchMetadata, rows: slice, state: torch.Tensor) -> torch.Tensor:
            args = [step_rows(inp[n], rows, batch) for n in names]
            with self.planned(backend, batch):
                o = backend.forward(*args, state, layer)
            return o[: rows.stop - rows.start]

        state_whole = inp["state"].clone()
        o_whole = step(whole, slice(0, total), state_whole)
        state_parts = inp["state"].clone()
        parts = [
            step(batch, rows, state_parts) for batch, rows in prompt_chunks(chunks, slot, device)
        ]
        assert_recurrence_close(
            torch.cat(parts),
            o_whole,
            state_parts,
            state_whole,
            dtype,
            ("delta output", "delta state"),
        )
