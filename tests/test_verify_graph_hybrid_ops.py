"""The recurrent ops on chained rows: a verify graph's rows against the float64 references.

A step of chained rows (``batch.chained_rows``) runs each chunk position as a one-token
row that continues the state the row before it left in a scratch slot. Every op must
give each row the output of the float64 one-token-at-a-time reference of its chunk,
leave the state after each position in that row's destination slot, end each
sequence's own slot at the state after its whole chunk, and touch no other slot but
the reserved slot 0 (which padding rows use). The checks take the backend as an
argument: ``tests/test_verify_graph_hybrid_triton.py`` runs them on the Triton
backends in the interpreter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from backplane.core.families import ConvLayerSpec, DeltaLayerSpec, SSMLayerSpec
from backplane.core.forward_context import forward_context
from backplane.core.metadata import BatchMetadata, ChainedRows, StepMode
from backplane.core.packing import build_batch_metadata
from backplane.core.registry import get_registry
from backplane.engine.worker.inputs import RowChain, chain_rows
from backplane.testing.delta import reference_gated_delta_rule
from backplane.testing.plugin import load_backend
from backplane.testing.ssm import reference_causal_conv1d, reference_ssm_scan

PAGE_SIZE = 16
#: chunk lengths of the step's sequences (a decode last, as an eager batch wants), cached tokens
CHUNKS = (4, 3, 2, 1)
CACHED = (6, 3, 12, 9)
K = 3  # scratch slots per sequence (proposals)
ROWS = 16  # the bucket: real rows then padding rows


class _Seq:
    def __init__(self, new: int, cached: int, slot: int) -> None:
        self.num_new_tokens, self.num_cached_tokens, self.state_slot = new, cached, slot


def _setup(device: str) -> tuple[BatchMetadata, BatchMetadata, RowChain, int]:
    """The chunks as one eager batch, the same chunks as chained rows, the chain, slot count."""
    n = len(CHUNKS)
    own = list(range(1, n + 1))
    chunks = build_batch_metadata(
        list(CHUNKS), list(CACHED), [[i + 1] for i in range(n)], PAGE_SIZE,
        state_slots=own, device=device,
    )  # fmt: skip
    first_scratch = n + 1
    seqs = [_Seq(q, c, s) for q, c, s in zip(CHUNKS, CACHED, own, strict=True)]
    chain = chain_rows(seqs, first_scratch, K, K + 1)
    real = sum(CHUNKS)
    seq_of_row = np.repeat(np.arange(n), CHUNKS)
    cached = [CACHED[s] + int(i) for s, i in zip(seq_of_row, chain.position, strict=True)]
    pad = ROWS - real
    rows = build_batch_metadata(
        [1] * ROWS,
        cached + [1] * pad,
        [[int(s) + 1] for s in seq_of_row] + [[0]] * pad,
        PAGE_SIZE,
        state_slots=[own[s] for s in seq_of_row] + [0] * pad,
        device=device,
        mode=StepMode.decode_graph(ROWS, rows_share_pages=True),
    )

    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([a, np.zeros(pad, np.int64)])).to(device)

    rows.chained_rows = ChainedRows(
        chain.num_positions, put(chain.position), put(chain.src_slots), put(chain.dst_slots)
    )
    return chunks, rows, chain, first_scratch + n * K


def _state(num_slots: int, *shape: int, gen: torch.Generator) -> torch.Tensor:
    """Random states; slot 0 holds NaN, so a real row reading it shows."""
    s = torch.randn(num_slots, *shape, generator=gen) * 0.5
    s[0] = float("nan")
    return s


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.double().cpu()


def _check_states(
    state: torch.Tensor,
    before: torch.Tensor,
    chunks: BatchMetadata,
    chain: RowChain,
    reference_after: Any,
    tol: float,
) -> None:
    """Each row's destination holds its chunk's state after its position (``reference_after(
    seq, t)``); slots no row writes are untouched."""
    starts = chunks.host.query_start_loc
    written = {0}
    for s, q in enumerate(CHUNKS):
        for t in range(q):
            slot = int(chain.dst_slots[starts[s] + t])
            written.add(slot)
            torch.testing.assert_close(
                _f64(state[slot]), reference_after(s, t), atol=tol, rtol=tol, msg=f"{s}, {t}"
            )
    for slot in range(state.shape[0]):
        if slot not in written:
            torch.testing.assert_close(state[slot], before[slot], msg=f"slot {slot}")


def _prefix(chunks: BatchMetadata, s: int, t: int, device: str) -> tuple[BatchMetadata, slice]:
    """Sequence ``s``'s first ``t + 1`` chunk tokens as a batch of its own, and their rows."""
    start = int(chunks.host.query_start_loc[s])
    only = build_batch_metadata(
        [t + 1], [CACHED[s]], [[s + 1]], PAGE_SIZE, state_slots=[s + 1], device=device
    )
    return only, slice(start, start + t + 1)


def check_conv(backend: Any, device: str = "cpu") -> None:
    """The causal conv on chained rows against the float64 reference of the chunks."""
    gen = torch.Generator().manual_seed(1)
    C, Kc = 24, 4
    chunks, rows, chain, num_slots = _setup(device)
    state0 = _state(num_slots, C, Kc - 1, gen=gen)
    state = state0.to(device, copy=True)
    weight, bias = torch.randn(C, Kc, generator=gen) * 0.5, torch.randn(C, generator=gen) * 0.1
    x = torch.randn(ROWS, C, generator=gen)
    weight, bias, x = weight.to(device), bias.to(device), x.to(device)
    spec = ConvLayerSpec(layer_id=0, conv_dim=C, kernel_size=Kc)
    with forward_context(rows, {"ssm": backend.plan(rows)}):
        got = backend.conv(x, weight, bias, state, spec)
    real = chunks.num_tokens
    want, _ = reference_causal_conv1d(chunks, x[:real], weight, bias, state0, "silu")
    torch.testing.assert_close(_f64(got[:real]), want, atol=1e-5, rtol=1e-5)

    def after(s: int, t: int) -> torch.Tensor:
        only, part = _prefix(chunks, s, t, device)
        return reference_causal_conv1d(only, x[part], weight, bias, state0, "silu")[1][s + 1]

    _check_states(state.cpu(), state0, chunks, chain, after, 1e-6)


def check_scan(backend: Any, device: str = "cpu") -> None:
    """The Mamba2 scan on chained rows against the float64 reference of the chunks."""
    gen = torch.Generator().manual_seed(2)
    H, P, N, G = 4, 8, 8, 2
    chunks, rows, chain, num_slots = _setup(device)
    state0 = _state(num_slots, H, P, N, gen=gen)
    state = state0.to(device, copy=True)
    A = -torch.rand(H, generator=gen) - 0.5
    D, dt_bias = torch.randn(H, generator=gen), torch.randn(H, generator=gen) * 0.1
    x, dt = torch.randn(ROWS, H, P, generator=gen), torch.randn(ROWS, H, generator=gen)
    B, Cm = (torch.randn(ROWS, G, N, generator=gen) for _ in range(2))
    z = torch.randn(ROWS, H, P, generator=gen)
    A, D, dt_bias, x, dt, B, Cm, z = (t.to(device) for t in (A, D, dt_bias, x, dt, B, Cm, z))
    spec = SSMLayerSpec(layer_id=0, nheads=H, head_dim=P, d_state=N, n_groups=G, chunk_size=16)
    with forward_context(rows, {"ssm": backend.plan(rows)}):
        got = backend.scan(x, dt, A, B, Cm, D, dt_bias, z, state, spec)
    real = chunks.num_tokens
    part = slice(0, real)
    want, _ = reference_ssm_scan(
        chunks, x[part], dt[part], A, B[part], Cm[part], D, dt_bias, z[part], state0, True
    )
    torch.testing.assert_close(_f64(got[:real]), want, atol=1e-4, rtol=1e-4)

    def after(s: int, t: int) -> torch.Tensor:
        only, p = _prefix(chunks, s, t, device)
        _, st = reference_ssm_scan(
            only, x[p], dt[p], A, B[p], Cm[p], D, dt_bias, z[p], state0, True
        )
        return st[s + 1]

    _check_states(state.cpu(), state0, chunks, chain, after, 1e-4)


def check_delta(backend: Any, device: str = "cpu") -> None:
    """The gated delta rule on chained rows against the float64 reference of the chunks."""
    gen = torch.Generator().manual_seed(3)
    hk, hv, dk, dv = 2, 4, 8, 6
    spec = DeltaLayerSpec(layer_id=0, num_k_heads=hk, num_v_heads=hv, k_head_dim=dk, v_head_dim=dv)
    chunks, rows, chain, num_slots = _setup(device)
    state0 = _state(num_slots, hv, dk, dv, gen=gen)
    state = state0.to(device, copy=True)
    q, k = torch.randn(ROWS, hk, dk, generator=gen), torch.randn(ROWS, hk, dk, generator=gen)
    v = torch.randn(ROWS, hv, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(ROWS, hv, generator=gen))
    beta = torch.sigmoid(torch.randn(ROWS, hv, generator=gen))
    q, k, v, g, beta = (t.to(device) for t in (q, k, v, g, beta))
    with forward_context(rows, {"delta": backend.plan(rows)}):
        got = backend.forward(q, k, v, g, beta, state, spec)
    real = chunks.num_tokens
    ins = [t[:real] for t in (q, k, v, g, beta)]
    want, _ = reference_gated_delta_rule(chunks, *ins, state0, spec.q_scale, True)
    torch.testing.assert_close(_f64(got[:real]), want, atol=1e-4, rtol=1e-4)

    def after(s: int, t: int) -> torch.Tensor:
        only, p = _prefix(chunks, s, t, device)
        part = [x[p] for x in (q, k, v, g, beta)]
        return reference_gated_delta_rule(only, *part, state0, spec.q_scale, True)[1][s + 1]

    _check_states(state.cpu(), state0, chunks, chain, after, 1e-4)


def _torch(family: str) -> Any:
    return load_backend(get_registry().get(family, "torch"))


@pytest.mark.parametrize("check", [check_conv, check_scan], ids=["conv", "scan"])
def test_torch_ssm_ops_on_chained_rows_equal_the_chunks(check):
    assert _torch("ssm").chains_rows
    check(_torch("ssm"))


def test_torch_delta_op_on_chained_rows_equals_the_chunks():
    assert _torch("delta").chains_rows
    check_delta(_torch("delta"))
