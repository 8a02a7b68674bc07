"""Recurrent decode steps chained through state slots: the rows of a verify graph, in plain torch.

In a verify graph (``batch.chained_rows`` set, see
:class:`~backplane.core.metadata.ChainedRows`) each row is one position of a
sequence's chunk. Row ``r`` continues the state in slot ``src_slots[r]`` and
leaves its own in slot ``dst_slots[r]``, so a chunk's rows form a chain: the
row at position ``j`` reads what the row at ``j - 1`` wrote. The functions
here run the decode update once per position ``j``, each time over every row,
and write only the rows whose position is ``j``; the others write the
reserved slot 0, which nothing reads. Every row reads its source slot before
any slot of that position is written, and no row's destination is its
source, so each launch reads what the launch before it left. The loop's
length is the host's ``num_positions``, fixed per bucket: captured in a CUDA
graph it unrolls, and nothing synchronises with the host.

The arithmetic is that of the decode path of :mod:`backplane.backends.torch.ssm`
and :mod:`backplane.backends.torch.delta`, in float32. A backend whose decode
kernel can only update a slot in place (mamba-ssm's state update, which the
Triton SSM backend calls) chains its rows with :func:`run_chain_in_place`
instead: each position copies the source states into the destination slots,
then runs that kernel on the destinations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from backplane.core.metadata import NULL_SLOT, ChainedRows

#: One decode update: the rows' input states (float32) -> (their output states, their outputs).
DecodeStep = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def run_chain(state: torch.Tensor, chain: ChainedRows, rows: int, step: DecodeStep) -> torch.Tensor:
    """Run ``step`` once per chunk position over the first ``rows`` rows, along their chains.

    :param state: ``[num_slots, ...]`` one state cache; the rows' source slots are
        read and their destination slots written.
    :param chain: the step's chained rows.
    :param rows: the rows to run (the step's token count).
    :param step: the decode update of every row at once.
    :return: each row's output, taken at its own position.
    """
    pos = chain.position[:rows]
    src = chain.src_slots[:rows]
    dst = chain.dst_slots[:rows]
    out: torch.Tensor | None = None
    for j in range(chain.num_positions):
        at = pos == j
        new, y = step(state.index_select(0, src).float())
        state.index_copy_(0, torch.where(at, dst, NULL_SLOT), new.to(state.dtype))
        out = _at_position(out, y, at)
    assert out is not None, "a chain runs at least one position"
    return out


def run_chain_in_place(
    states: Sequence[torch.Tensor],
    chain: ChainedRows,
    rows: int,
    update: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Chain rows through a decode update that works in place on the slots it is given.

    For each chunk position ``j``, every row at ``j`` first copies its source
    slot's states into its destination slot (a row whose source is its
    destination copies onto itself), then ``update(slots)`` advances the
    states in ``slots`` by one token: the destination of each row at ``j``,
    slot 0 for the others, whose outputs are dropped.

    :param states: every state cache the update advances (``[num_slots, ...]`` each).
    :param chain: the step's chained rows.
    :param rows: the rows to run (the step's token count).
    :param update: runs the backend's decode over all rows on the given ``[rows]`` slots
        and returns their outputs (a new tensor).
    :return: each row's output, taken at its own position.
    """
    pos = chain.position[:rows]
    src = chain.src_slots[:rows]
    dst = chain.dst_slots[:rows]
    out: torch.Tensor | None = None
    for j in range(chain.num_positions):
        at = pos == j
        slots = torch.where(at, dst, NULL_SLOT)
        for state in states:
            state.index_copy_(0, slots, state.index_select(0, src))
        y = update(slots)
        out = _at_position(out, y, at)
    assert out is not None, "a chain runs at least one position"
    return out


def chained_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    activation: str,
    chain: ChainedRows,
    rows: int,
) -> torch.Tensor:
    """The causal depthwise conv of one-token rows whose conv states chain.

    A row's window is its source slot's last ``kernel_size - 1`` inputs and
    its own input; the window without its oldest input is its output state.

    :param x: ``[T, conv_dim]`` the rows' inputs.
    :param weight: ``[conv_dim, kernel_size]``.
    :param bias: ``[conv_dim]`` or ``None``.
    :param conv_state: ``[num_slots, conv_dim, kernel_size - 1]``.
    :param activation: ``"silu"`` or ``""``.
    :param chain: the step's chained rows.
    :param rows: the rows to run.
    :return: ``[rows, conv_dim]`` float32 outputs.
    """
    w = weight.float()
    xv = x[:rows].float()[:, :, None]

    def step(old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.cat((old, xv), dim=2)  # [rows, conv_dim, kernel_size], oldest first
        y = (window * w).sum(dim=2)
        if bias is not None:
            y = y + bias.float()
        if activation == "silu":
            y = F.silu(y)
        return window[:, :, 1:], y

    if conv_state.shape[2] == 0:  # a kernel of one tap keeps no state
        y = xv[:, :, 0] * w[:, 0]
        y = y + bias.float() if bias is not None else y
        return F.silu(y) if activation == "silu" else y
    return run_chain(conv_state, chain, rows, step)


def chained_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    dt_softplus: bool,
    chain: ChainedRows,
    rows: int,
) -> torch.Tensor:
    """The Mamba2 selective state update of one-token rows whose states chain (no D skip, no gate).

    :param x: ``[T, H, P]``.
    :param dt: ``[T, H]`` raw time steps.
    :param A: ``[H]``.
    :param B: ``[T, G, N]``.
    :param C: ``[T, G, N]``.
    :param dt_bias: ``[H]``.
    :param ssm_state: ``[num_slots, H, P, N]``.
    :param dt_softplus: apply softplus to ``dt + dt_bias``.
    :param chain: the step's chained rows.
    :param rows: the rows to run.
    :return: ``[rows, H, P]`` float32, ``C h`` of each row.
    """
    rep = x.shape[1] // B.shape[1]
    d = dt[:rows].float() + dt_bias.float()
    if dt_softplus:
        d = F.softplus(d)
    b = B[:rows].float().repeat_interleave(rep, dim=1)  # [rows, H, N]
    c = C[:rows].float().repeat_interleave(rep, dim=1)
    decay = torch.exp(d * A.float())[:, :, None, None]
    inject = (d[:, :, None] * x[:rows].float())[..., None] * b[:, :, None, :]

    def step(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = h * decay + inject
        return h, torch.einsum("shpn,shn->shp", h, c)

    return run_chain(ssm_state, chain, rows, step)


def chained_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chain: ChainedRows,
    rows: int,
) -> torch.Tensor:
    """The gated delta rule update of one-token rows whose states chain.

    :param q: ``[rows, Hv, Dk]`` float32, normalised and scaled, one row per value head.
    :param k: ``[rows, Hv, Dk]`` float32, normalised, one row per value head.
    :param v: ``[T, Hv, Dv]``.
    :param g: ``[T, Hv]`` log decays.
    :param beta: ``[T, Hv]``.
    :param state: ``[num_slots, Hv, Dk, Dv]``.
    :param chain: the step's chained rows.
    :param rows: the rows to run.
    :return: ``[rows, Hv, Dv]`` float32 outputs.
    """
    decay = g[:rows].float().exp()[..., None, None]
    vv = v[:rows].float()
    bb = beta[:rows].float()[..., None]

    def step(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = s * decay
        delta = (vv - torch.einsum("shkv,shk->shv", s, k)) * bb
        s = s + k[..., :, None] * delta[..., None, :]
        return s, torch.einsum("shkv,shk->shv", s, q)

    return run_chain(state, chain, rows, step)


def _at_position(out: torch.Tensor | None, y: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``out`` with the rows where ``at`` holds taken from ``y`` (all of ``y`` at first)."""
    return y if out is None else torch.where(at.view(-1, *([1] * (y.dim() - 1))), y, out)
