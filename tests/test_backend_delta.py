"""The delta backend matrix: every registered delta backend runs the conformance kit."""

from __future__ import annotations

from typing import Any

import pytest

from backplane.testing.delta import DeltaBackendTests
from backplane.testing.plugin import backend_params, load_backend


class TestDeltaBackend(DeltaBackendTests):
    """Runs :class:`DeltaBackendTests` on each registered delta backend."""

    @pytest.fixture(params=backend_params("delta"))
    def backend(self, request: pytest.FixtureRequest) -> Any:
        """The backend object under test."""
        return load_backend(request.param)


def _torch_path(fn):
    return getattr(fn, "__wrapped__", fn)


@pytest.mark.parametrize("cached", [0, 4], ids=["prefill", "extend"])
def test_reference_matches_transformers(cached: int) -> None:
    """The kit's float64 reference agrees with Qwen3-Next's torch paths.

    ``torch_chunk_gated_delta_rule`` for a prompt (with an initial state when
    extending) and ``torch_recurrent_gated_delta_rule`` for one decode token,
    both with the in-kernel L2 norm and grouped value heads.
    """
    hf = pytest.importorskip(
        "transformers.models.qwen3_next.modeling_qwen3_next",
        reason="transformers with Qwen3-Next is needed for the parity check",
    )
    import torch

    from backplane.testing.delta import reference_gated_delta_rule
    from backplane.testing.recurrent import single_sequence_batch

    gen = torch.Generator().manual_seed(0)
    L, hk, hv, dk, dv, slot = 70, 2, 4, 8, 6, 1
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = rnd(L + 1, hk, dk), rnd(L + 1, hk, dk), rnd(L + 1, hv, dv)
    g = -torch.nn.functional.softplus(rnd(L + 1, hv))
    beta = torch.sigmoid(rnd(L + 1, hv))
    state = torch.zeros(2, hv, dk, dv, dtype=torch.float64)
    if cached:
        state[slot] = rnd(hv, dk, dv) * 0.3
    scale = dk**-0.5  # transformers always scales q by k_head_dim ** -0.5

    # Older transformers releases expect q/k already repeated to the value heads (the
    # model does it before the call); repeated heads are what grouping means.
    qh, kh = (t.repeat_interleave(hv // hk, dim=1) for t in (q, k))

    prompt = single_sequence_batch(L, cached, slot, torch.device("cpu"), padding=0)
    o, after = reference_gated_delta_rule(
        prompt, q[:L], k[:L], v[:L], g[:L], beta[:L], state, scale, True
    )
    # the torch originals: with fla installed transformers binds its GPU kernels
    hf_o, hf_state = _torch_path(hf.torch_chunk_gated_delta_rule)(
        qh[None, :L],
        kh[None, :L],
        v[None, :L],
        g[None, :L],
        beta[None, :L],
        initial_state=state[slot][None] if cached else None,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    # transformers computes in float32
    torch.testing.assert_close(o, hf_o[0].double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after[slot], hf_state[0].double(), atol=1e-5, rtol=1e-5)

    decode = single_sequence_batch(1, cached + L, slot, torch.device("cpu"), padding=0)
    o1, after1 = reference_gated_delta_rule(
        decode, q[L:], k[L:], v[L:], g[L:], beta[L:], after, scale, True
    )
    hf_o1, hf_state1 = _torch_path(hf.torch_recurrent_gated_delta_rule)(
        qh[None, L:],
        kh[None, L:],
        v[None, L:],
        g[None, L:],
        beta[None, L:],
        initial_state=after[slot][None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(o1, hf_o1[0].double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after1[slot], hf_state1[0].double(), atol=1e-5, rtol=1e-5)
