"""Conformance tests of the ``ssm`` family (Mamba2 causal conv1d and selective scan).

Subclass :class:`SSMBackendTests` and provide a ``backend`` fixture::

    from backplane.testing.plugin import backend_params, load_backend
    from backplane.testing.ssm import SSMBackendTests

    class TestMySSM(SSMBackendTests):
        @pytest.fixture(params=backend_params("ssm"))
        def backend(self, request):
            return load_backend(request.param)

The references below are naive float64 per-token recurrences written from the
definitions in :class:`backplane.core.families.SSMBackend` (and matching the
Mamba2 mixer of NemotronH in ``transformers``): they share no code with any
backend.

The state slots of sequences without initial state are filled with NaN before
each call, so a backend that reads them (instead of starting from zeros) fails;
slots no sequence uses hold random values that must come back untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

from backplane.core.families import ConvLayerSpec, SSMLayerSpec
from backplane.core.metadata import BatchMetadata
from backplane.testing.batches import BatchCase
from backplane.testing.checks import assert_close_to_reference
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

# -- float64 references -------------------------------------------------------------------------


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def _softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.exp(x))


def reference_causal_conv1d(
    batch: BatchMetadata,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive float64 causal depthwise conv1d, one token at a time.

    Each sequence's history starts as the ``kernel_size - 1`` inputs in its
    slot (zeros without initial state); every new token is appended and the
    output is the dot product of the last ``kernel_size`` entries with the
    kernel. The slot ends up holding the last ``kernel_size - 1`` entries.

    :param batch: the step's metadata (host arrays are used).
    :param x: ``[T, conv_dim]``.
    :param weight: ``[conv_dim, kernel_size]``.
    :param bias: ``[conv_dim]`` or ``None``.
    :param conv_state: ``[num_slots, conv_dim, kernel_size - 1]`` before the step.
    :param activation: ``"silu"`` or ``""``.
    :return: ``(out [num_tokens, conv_dim], conv_state after the step)``, float64 on CPU.
    """
    host = batch.host
    x = x.detach().double().cpu()
    w = weight.detach().double().cpu()
    b = (
        bias.detach().double().cpu()
        if bias is not None
        else torch.zeros(w.shape[0], dtype=torch.float64)
    )
    old = conv_state.detach().double().cpu()
    new = old.clone()
    width = w.shape[1] - 1
    out = torch.zeros(batch.num_tokens, w.shape[0], dtype=torch.float64)
    for i in range(batch.num_seqs):
        slot = int(host.state_slots[i])
        if host.has_initial_state[i]:
            history = [old[slot, :, j] for j in range(width)]
        else:
            history = [torch.zeros(w.shape[0], dtype=torch.float64) for _ in range(width)]
        for t in range(int(host.query_start_loc[i]), int(host.query_start_loc[i + 1])):
            history.append(x[t])
            window = history[len(history) - (width + 1) :]
            acc = b.clone()
            for j in range(width + 1):
                acc += w[:, j] * window[j]
            out[t] = _silu(acc) if activation == "silu" else acc
        if width:
            new[slot] = torch.stack(history[len(history) - width :], dim=-1)
    return out, new


def reference_ssm_scan(
    batch: BatchMetadata,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    z: torch.Tensor | None,
    ssm_state: torch.Tensor,
    dt_softplus: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive float64 Mamba2 recurrence, one token at a time.

    Per token: ``dt' = softplus(dt + dt_bias)`` (or ``dt + dt_bias``);
    ``h = exp(dt' A) h + dt' x B^T`` (head ``j`` uses group ``j // (H / G)`` of B, C);
    ``y = h C + D x``; ``y *= silu(z)`` when gated.

    :return: ``(y [num_tokens, H, P], ssm_state after the step)``, float64 on CPU.
    """
    host = batch.host
    x, dt, B, C = (t.detach().double().cpu() for t in (x, dt, B, C))
    A, D, dt_bias = (t.detach().double().cpu() for t in (A, D, dt_bias))
    zz = z.detach().double().cpu() if z is not None else None
    old = ssm_state.detach().double().cpu()
    new = old.clone()
    nheads, head_dim = x.shape[1], x.shape[2]
    group = torch.arange(nheads) // (nheads // B.shape[1])
    y = torch.zeros(batch.num_tokens, nheads, head_dim, dtype=torch.float64)
    for i in range(batch.num_seqs):
        slot = int(host.state_slots[i])
        h = old[slot].clone() if host.has_initial_state[i] else torch.zeros_like(old[slot])
        for t in range(int(host.query_start_loc[i]), int(host.query_start_loc[i + 1])):
            d = dt[t] + dt_bias
            if dt_softplus:
                d = _softplus(d)
            bt, ct = B[t][group], C[t][group]  # [H, N]
            h = (
                torch.exp(d * A)[:, None, None] * h
                + (d[:, None] * x[t])[:, :, None] * bt[:, None, :]
            )
            yt = (h * ct[:, None, :]).sum(-1) + D[:, None] * x[t]
            if zz is not None:
                yt = yt * _silu(zz[t])
            y[t] = yt
        new[slot] = h
    return y, new


# -- the mixin ----------------------------------------------------------------------------------


def _normal_sampler(
    gen: torch.Generator, dtype: torch.dtype, device: torch.device
) -> Callable[..., torch.Tensor]:
    """``rnd(*shape, scale=1.0)``: normal samples of ``gen`` times ``scale``, as ``dtype`` on ``device``.

    Drawn in float32 on the host, so the values do not depend on ``dtype`` or ``device``.
    """

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
        return t.to(device=device, dtype=dtype)

    return rnd


class SSMBackendTests(RecurrentBackendTests):
    """Conformance tests of an ``ssm`` backend (``conv`` and ``scan``).

    Class attributes set the (small) layer shapes; a subclass may override them.
    """

    family: ClassVar[str] = "ssm"
    NHEADS: ClassVar[int] = 4
    HEAD_DIM: ClassVar[int] = 4
    D_STATE: ClassVar[int] = 6
    KERNEL_SIZE: ClassVar[int] = 4
    #: Small, so the kit's prompts span several chunks of the prefill scan.
    CHUNK_SIZE: ClassVar[int] = 4

    #: Long prompts that span several scan chunks.
    LONG_CASE: ClassVar[dict[str, Any]] = {
        "query_lens": [19, 13, 1],
        "cached_lens": [0, 9, 6],
        "seed": 5,
    }

    # -- inputs

    def conv_inputs(
        self,
        batch: BatchMetadata,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        conv_dim: int = 10,
        with_bias: bool = True,
        seed: int = 0,
    ) -> dict[str, Any]:
        """Random ``conv`` inputs for ``batch`` (padding rows hold random values too)."""
        gen = torch.Generator().manual_seed(seed)
        T = batch.padded_num_tokens
        rnd = _normal_sampler(gen, dtype, device)

        return {
            "x": rnd(T, conv_dim),
            "weight": rnd(conv_dim, self.KERNEL_SIZE, scale=0.5),
            "bias": rnd(conv_dim, scale=0.5) if with_bias else None,
            "conv_state": random_state(
                (num_slots, conv_dim, self.KERNEL_SIZE - 1), dtype, batch, gen, device
            ),
        }

    def scan_inputs(
        self,
        batch: BatchMetadata,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        n_groups: int = 1,
        gated: bool = False,
        seed: int = 0,
    ) -> dict[str, Any]:
        """Random ``scan`` inputs for ``batch`` with Mamba2-like magnitudes."""
        gen = torch.Generator().manual_seed(seed)
        T, H, P, N = batch.padded_num_tokens, self.NHEADS, self.HEAD_DIM, self.D_STATE
        rnd = _normal_sampler(gen, dtype, device)

        # A = -exp(A_log) as in the models: negative, order 1; dt + dt_bias around -1 so that
        # softplus(dt) spans roughly 0.1 .. 1 and the state decays but does not vanish
        A = -torch.exp(torch.rand(H, generator=gen) * 2 - 1)
        # B and C at N ** -0.25 each keep C . h of order one whatever d_state is, so the
        # kit's absolute tolerances mean the same at d_state 6 and at 128 (unscaled, a
        # 128-term product in 16-bit operands errs by ~1e-1 on outputs of order 10).
        bc = N**-0.25
        return {
            "x": rnd(T, H, P),
            "dt": rnd(T, H, scale=0.5),
            "A": A.to(device),
            "B": rnd(T, n_groups, N, scale=bc),
            "C": rnd(T, n_groups, N, scale=bc),
            "D": rnd(H).float(),
            "dt_bias": (torch.rand(H, generator=gen) - 1.5).to(device),
            "z": rnd(T, H, P) if gated else None,
            "ssm_state": random_state(
                (num_slots, H, P, N), torch.float32, batch, gen, device, scale=0.5
            ),
        }

    def conv_layer(self, conv_dim: int, activation: str) -> ConvLayerSpec:
        """The conv layer constants used by the tests."""
        return ConvLayerSpec(
            layer_id=0, conv_dim=conv_dim, kernel_size=self.KERNEL_SIZE, activation=activation
        )

    def scan_layer(self, n_groups: int) -> SSMLayerSpec:
        """The scan layer constants used by the tests."""
        return SSMLayerSpec(
            layer_id=0,
            nheads=self.NHEADS,
            head_dim=self.HEAD_DIM,
            d_state=self.D_STATE,
            n_groups=n_groups,
            dt_softplus=True,
            chunk_size=self.CHUNK_SIZE,
        )

    def op_calls(
        self,
        backend: Any,
        case: BatchCase,
        batch: BatchMetadata,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[OpCall]:
        """A ``conv`` (SiLU) and a ``scan`` (one group, no gate) call on ``batch``."""
        conv_in = self.conv_inputs(batch, case.num_slots, dtype, device, seed=11)
        scan_in = self.scan_inputs(batch, case.num_slots, dtype, device, seed=12)
        conv_layer = self.conv_layer(conv_in["x"].shape[1], "silu")
        scan_layer = self.scan_layer(1)
        return [
            OpCall(
                run=lambda out: backend.conv(*conv_in.values(), conv_layer, out=out),
                out_like=conv_in["x"],
                per_token_inputs=[conv_in["x"]],
                states=[conv_in["conv_state"]],
            ),
            OpCall(
                run=lambda out: backend.scan(*scan_in.values(), scan_layer, out=out),
                out_like=scan_in["x"],
                per_token_inputs=[scan_in[k] for k in ("x", "dt", "B", "C")],
                states=[scan_in["ssm_state"]],
            ),
        ]

    # -- tests

    def test_cache_specs(self, backend: Any) -> None:
        """The default cache specs follow the shared layouts (float32 SSM state)."""
        spec = backend.cache_spec(self.scan_layer(1), num_slots=5, dtype=torch.bfloat16)
        assert spec["ssm_state"].shape == (5, self.NHEADS, self.HEAD_DIM, self.D_STATE)
        assert spec["ssm_state"].dtype == torch.float32
        conv = backend.conv_cache_spec(
            self.conv_layer(10, "silu"), num_slots=5, dtype=torch.bfloat16
        )
        assert conv["conv_state"].shape == (5, 10, self.KERNEL_SIZE - 1)

    @pytest.mark.parametrize("activation", ["silu", ""], ids=["silu", "no_act"])
    def test_conv_matches_reference(
        self,
        backend: Any,
        device: torch.device,
        dtype: torch.dtype,
        case: BatchCase,
        activation: str,
    ) -> None:
        """``conv`` output and conv state equal the float64 reference; out contract holds."""
        batch = case.metadata(device)
        inp = self.conv_inputs(batch, case.num_slots, dtype, device, with_bias=activation == "silu")
        layer = self.conv_layer(inp["x"].shape[1], activation)
        expected, expected_state = reference_causal_conv1d(
            batch, inp["x"], inp["weight"], inp["bias"], inp["conv_state"], activation
        )
        full = self.check_out_contract(
            backend,
            batch,
            lambda out: backend.conv(
                inp["x"], inp["weight"], inp["bias"], inp["conv_state"], layer, out=out
            ),
            [inp["conv_state"]],
        )
        assert full.shape == inp["x"].shape and full.dtype == dtype
        assert_close_to_reference(full[: batch.num_tokens], expected, dtype, msg="conv output")
        # the state holds copies of (rounded) inputs: it must match at the state dtype's precision
        assert_close_to_reference(inp["conv_state"], expected_state, dtype, msg="conv state")

    @pytest.mark.parametrize("variant", ["plain", "gated_groups"])
    def test_scan_matches_reference(
        self,
        backend: Any,
        backend_capabilities: Any,
        device: torch.device,
        dtype: torch.dtype,
        case: BatchCase,
        variant: str,
    ) -> None:
        """``scan`` output and SSM state equal the float64 reference; out contract holds.

        ``gated_groups`` adds the ``z`` gate and two B/C groups.
        """
        n_groups, gated = 1, False
        if variant == "gated_groups":
            require_feature(backend_capabilities, "z_gate", "n_groups")
            n_groups, gated = 2, True
        batch = case.metadata(device)
        inp = self.scan_inputs(batch, case.num_slots, dtype, device, n_groups=n_groups, gated=gated)
        layer = self.scan_layer(n_groups)
        args = [inp[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias", "z", "ssm_state")]
        expected, expected_state = reference_ssm_scan(batch, *args, dt_softplus=True)
        full = self.check_out_contract(
            backend, batch, lambda out: backend.scan(*args, layer, out=out), [inp["ssm_state"]]
        )
        assert full.shape == inp["x"].shape and full.dtype == dtype
        assert_recurrence_close(
            full[: batch.num_tokens],
            expected,
            inp["ssm_state"],
            expected_state,
            dtype,
            ("scan output", "ssm state"),
        )

    @pytest.mark.parametrize(
        "chunks", [(5, 3, 1, 1, 1), (1, 2, 1, 7)], ids=["5-3-d-d-d", "1-2-1-7"]
    )
    def test_chunked_equals_whole_prompt(
        self, backend: Any, device: torch.device, dtype: torch.dtype, chunks: tuple[int, ...]
    ) -> None:
        """A prompt run whole equals the same prompt in chunks (+ decodes), outputs and states."""
        total, slot, num_slots, conv_dim = sum(chunks), 2, 4, 10
        whole = single_sequence_batch(total, 0, slot, device, padding=0)
        conv_in = self.conv_inputs(whole, num_slots, dtype, device, conv_dim=conv_dim, seed=1)
        scan_in = self.scan_inputs(whole, num_slots, dtype, device, seed=2)
        conv_layer, scan_layer = self.conv_layer(conv_dim, "silu"), self.scan_layer(1)
        keys = ("x", "dt", "A", "B", "C", "D", "dt_bias", "z")
        per_token = {"x", "dt", "B", "C", "z"}

        def step(
            batch: BatchMetadata, rows: slice, conv_state: torch.Tensor, ssm_state: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            def take(k: str) -> torch.Tensor | None:
                t = scan_in[k]
                return step_rows(t, rows, batch) if t is not None and k in per_token else t

            n = rows.stop - rows.start
            with self.planned(backend, batch):
                c = backend.conv(
                    step_rows(conv_in["x"], rows, batch),
                    conv_in["weight"],
                    conv_in["bias"],
                    conv_state,
                    conv_layer,
                )
                s = backend.scan(*[take(k) for k in keys], ssm_state, scan_layer)
            return c[:n], s[:n]

        conv_state0, ssm_state0 = conv_in["conv_state"].clone(), scan_in["ssm_state"].clone()
        conv_whole, scan_whole = step(whole, slice(0, total), conv_state0, ssm_state0)

        conv_state1, ssm_state1 = conv_in["conv_state"].clone(), scan_in["ssm_state"].clone()
        conv_parts, scan_parts = [], []
        for batch, rows in prompt_chunks(chunks, slot, device):
            c, s = step(batch, rows, conv_state1, ssm_state1)
            conv_parts.append(c)
            scan_parts.append(s)
        atol, rtol = (2e-5, 2e-5) if dtype == torch.float32 else (0.0, 0.0)
        torch.testing.assert_close(torch.cat(conv_parts), conv_whole, atol=atol, rtol=rtol)
        torch.testing.assert_close(conv_state1, conv_state0, atol=0, rtol=0)
        assert_recurrence_close(
            torch.cat(scan_parts),
            scan_whole,
            ssm_state1,
            ssm_state0,
            dtype,
            ("scan output", "ssm state"),
        )
