"""The ssm backend matrix: every registered ssm backend runs the conformance kit."""

from __future__ import annotations

from typing import Any

import pytest

from backplane.testing.plugin import backend_params, load_backend
from backplane.testing.ssm import SSMBackendTests


class TestSSMBackend(SSMBackendTests):
    """Runs :class:`SSMBackendTests` on each registered ssm backend."""

    @pytest.fixture(params=backend_params("ssm"))
    def backend(self, request: pytest.FixtureRequest) -> Any:
        """The backend object under test."""
        return load_backend(request.param)


def _hf_nemotron_h() -> Any:
    return pytest.importorskip(
        "transformers.models.nemotron_h.modeling_nemotron_h",
        reason="transformers with NemotronH is needed for the parity check",
    )


@pytest.mark.parametrize("cached", [0, 5], ids=["prefill", "extend"])
def test_reference_matches_transformers_prefill(cached: int) -> None:
    """The kit's float64 references agree with the NemotronH Mamba2 mixer's torch path.

    Covers the causal conv (``causal_conv1d_fn`` / ``update_conv_state`` semantics) and
    the chunked scan (``mamba2_chunk_scan`` with initial and final states).
    """
    hf = _hf_nemotron_h()
    torch = pytest.importorskip("torch")
    from backplane.testing.recurrent import single_sequence_batch
    from backplane.testing.ssm import reference_causal_conv1d, reference_ssm_scan

    gen = torch.Generator().manual_seed(0)
    L, H, P, N, G, K, conv_dim, slot = 11, 4, 4, 6, 2, 4, 10, 1
    batch = single_sequence_batch(L, cached, slot, torch.device("cpu"), padding=0)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731

    # causal conv: HF keeps kernel_size inputs of history; the last kernel_size - 1 are ours
    x, w, b = rnd(L, conv_dim), rnd(conv_dim, K), rnd(conv_dim)
    hist = rnd(conv_dim, K) if cached else torch.zeros(conv_dim, K, dtype=torch.float64)
    conv_state = torch.zeros(2, conv_dim, K - 1, dtype=torch.float64)
    conv_state[slot] = hist[:, 1:]
    out, new_state = reference_causal_conv1d(batch, x, w, b, conv_state, "silu")
    full = torch.cat([hist, x.T], dim=-1)[None]
    hf_out = hf.causal_conv1d_fn(full, w, b, activation="silu")[0, :, -L:].T
    torch.testing.assert_close(out, hf_out)
    torch.testing.assert_close(new_state[slot], full[0, :, -(K - 1) :])

    # chunked scan with an initial state (zeros for a fresh prompt)
    xs, dt, B, C = rnd(L, H, P), rnd(L, H) * 0.5, rnd(L, G, N), rnd(L, G, N)
    A, D, dt_bias = -torch.exp(rnd(H) * 0.5), rnd(H), rnd(H) * 0.5 - 1
    ssm_state = torch.zeros(2, H, P, N, dtype=torch.float64)
    if cached:
        ssm_state[slot] = rnd(H, P, N) * 0.5
    y, new_ssm = reference_ssm_scan(batch, xs, dt, A, B, C, D, dt_bias, None, ssm_state, True)
    hf_y, hf_final = hf.mamba2_chunk_scan(
        xs[None],
        dt[None],
        A,
        B[None],
        C[None],
        chunk_size=4,
        D=D,
        dt_bias=dt_bias,
        initial_states=ssm_state[slot][None],
        dt_softplus=True,
        return_final_states=True,
    )
    # transformers computes the scan in float32
    torch.testing.assert_close(y, hf_y[0].double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_ssm[slot], hf_final[0].double(), atol=1e-5, rtol=1e-5)


def test_reference_matches_transformers_decode() -> None:
    """The float64 references agree with NemotronH's single-token update paths
    (``causal_conv1d_update`` and ``mamba2_selective_state_update``, with a z gate)."""
    hf = _hf_nemotron_h()
    torch = pytest.importorskip("torch")
    from backplane.core.packing import build_batch_metadata
    from backplane.testing.ssm import reference_causal_conv1d, reference_ssm_scan

    gen = torch.Generator().manual_seed(1)
    S, H, P, N, G, K, conv_dim = 3, 4, 4, 6, 2, 4, 10
    batch = build_batch_metadata(
        [1] * S, [4, 7, 2], [[1, 2], [3, 4], [5]], 4, state_slots=[3, 1, 2]
    )
    slots = [3, 1, 2]
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731

    x, w, b = rnd(S, conv_dim), rnd(conv_dim, K), rnd(conv_dim)
    conv_state = rnd(4, conv_dim, K - 1)
    out, new_state = reference_causal_conv1d(batch, x, w, b, conv_state, "silu")
    hf_state = torch.cat([torch.zeros(S, conv_dim, 1, dtype=torch.float64), conv_state[slots]], -1)
    hf_out = hf.causal_conv1d_update(x[:, :, None], hf_state, w, b, activation="silu")
    torch.testing.assert_close(out, hf_out[:, :, 0])
    torch.testing.assert_close(new_state[slots], hf_state[..., 1:])

    xs, dt, B, C, z = rnd(S, H, P), rnd(S, H) * 0.5, rnd(S, G, N), rnd(S, G, N), rnd(S, H, P)
    A, D, dt_bias = -torch.exp(rnd(H) * 0.5), rnd(H), rnd(H) * 0.5 - 1
    ssm_state = rnd(4, H, P, N) * 0.5
    y, new_ssm = reference_ssm_scan(batch, xs, dt, A, B, C, D, dt_bias, z, ssm_state, True)
    hf_ssm = ssm_state[slots].clone()
    hf_y = hf.mamba2_selective_state_update(
        hf_ssm,
        xs,
        dt[:, :, None].expand(-1, -1, P),
        A[:, None, None].expand(-1, P, N),
        B,
        C,
        D[:, None].expand(-1, P),
        z=z,
        dt_bias=dt_bias[:, None].expand(-1, P),
        dt_softplus=True,
    )
    torch.testing.assert_close(y, hf_y)
    torch.testing.assert_close(new_ssm[slots], hf_ssm)
