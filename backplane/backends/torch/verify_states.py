"""Per-position recurrent states of speculative verification chunks, in plain torch.

A verification step (``batch.verify_states`` set; see
:class:`~backplane.core.metadata.VerifyStates`) must leave, besides each
sequence's state after its whole chunk, the state after every position of the
chunk in a scratch slot, so that the engine can keep the state after the last
accepted token (:meth:`~backplane.core.families.RecurrentBackend.copy_state_slots`).

Every backend's conv, scan and delta ops call the matching function below
first thing, before their own path reads the sequences' slots and overwrites
them with the state after the whole chunk. A function returns at once when the
step verifies nothing, so ordinary steps pay one attribute read. Chunks are
short (the proposals plus one), so the recurrence runs position by position,
each position vectorised over every verifying sequence; positions past a
shorter chunk's end, and positions the engine does not keep, are written to
the reserved scratch slot 0, never read. Everything is derived on the device
from the batch's tensors: nothing synchronises with the host.

The arithmetic is the decode step of the torch reference backends
(:mod:`backplane.backends.torch.ssm`, :mod:`backplane.backends.torch.delta`),
in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backplane.core.forward_context import get_forward_context
from backplane.core.metadata import BatchMetadata, VerifyStates


def _verifying(batch: BatchMetadata) -> VerifyStates | None:
    """The step's verification description, or ``None`` when it verifies no sequence here.

    A verify graph's chained rows write every position's state themselves
    (:mod:`backplane.backends.torch.chained_rows`): nothing is left to record.
    """
    vs = batch.verify_states
    if vs is None or len(vs.seqs_host) == 0 or batch.num_tokens == 0:
        return None
    if batch.mode.rows_share_pages:
        return None
    return vs


def _chunk_layout(
    batch: BatchMetadata, vs: VerifyStates, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First token row, own slot and has-initial-state flag of each verifying sequence.

    :return: ``(start [V], own [V], has_state [V])`` on ``device``.
    """
    seqs = vs.seqs.to(device)
    start = batch.query_start_loc.to(device=device, dtype=torch.long)[seqs]
    own = batch.state_slots.to(device=device, dtype=torch.long)[seqs]
    has = batch.has_initial_state.to(device=device)[seqs]
    return start, own, has


def _initial(state: torch.Tensor, own: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """The states the chunks start from, zeros where a sequence has none (read, never multiplied:
    a slot without a state may hold NaN)."""
    init = state.index_select(0, own)
    return torch.where(has.view(-1, *([1] * (init.dim() - 1))), init, 0.0)


def record_conv_states(x: torch.Tensor, conv_state: torch.Tensor) -> None:
    """Write the conv state after each position of every verifying chunk into its scratch slot.

    The conv state after position ``t`` is the last ``kernel_size - 1`` inputs
    up to and including input ``t``: a window over the old state followed by
    the chunk's inputs, gathered for every position at once.

    :param x: the conv's input ``[T, conv_dim]`` for the whole batch.
    :param conv_state: ``[num_slots, conv_dim, kernel_size - 1]``; the verifying
        sequences' own slots are read, their scratch slots written.
    """
    batch = get_forward_context().batch
    vs = _verifying(batch)
    width = conv_state.shape[2]
    if vs is None or width == 0:
        return
    dev = x.device
    start, own, has = _chunk_layout(batch, vs, dev)
    slots = vs.slots.to(dev)
    num_v, cols = slots.shape
    old = _initial(conv_state, own, has)  # [V, C, width]
    # window column p of position t reads element t + 1 + p of [old state (width), inputs]
    src = torch.arange(cols, device=dev)[:, None] + 1 + torch.arange(width, device=dev)[None, :]
    rows = (start[:, None, None] + (src - width)[None]).clamp(0, batch.num_tokens - 1)
    from_x = x[rows].to(conv_state.dtype)  # [V, cols, width, C]
    from_old = old[:, :, src.clamp(max=width - 1)].permute(0, 2, 3, 1)  # [V, cols, width, C]
    window = torch.where((src < width)[None, :, :, None], from_old, from_x)
    conv_state.index_copy_(
        0, slots.reshape(-1), window.transpose(2, 3).reshape(num_v * cols, -1, width)
    )


def record_scan_states(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    dt_softplus: bool,
) -> None:
    """Write the Mamba2 state after each position of every verifying chunk into its scratch slot.

    :param x: ``[T, H, P]``.
    :param dt: ``[T, H]`` raw time steps.
    :param A: ``[H]``.
    :param B: ``[T, G, N]``.
    :param dt_bias: ``[H]``.
    :param ssm_state: ``[num_slots, H, P, N]``; own slots read, scratch slots written.
    :param dt_softplus: apply softplus to ``dt + dt_bias``.
    """
    batch = get_forward_context().batch
    vs = _verifying(batch)
    if vs is None:
        return
    dev = x.device
    start, own, has = _chunk_layout(batch, vs, dev)
    slots = vs.slots.to(dev)
    rep = x.shape[1] // B.shape[1]
    a32, bias32 = A.float(), dt_bias.float()
    h = _initial(ssm_state, own, has).float()  # [V, H, P, N]
    last = batch.num_tokens - 1
    for t in range(vs.max_len):  # a chunk is the proposals plus one: a few positions
        rows = (start + t).clamp(max=last)
        d = dt[rows].float() + bias32
        if dt_softplus:
            d = F.softplus(d)
        b = B[rows].float().repeat_interleave(rep, dim=1)  # [V, H, N]
        h = (
            h * torch.exp(d * a32)[:, :, None, None]
            + (d[:, :, None] * x[rows].float())[..., None] * b[:, :, None, :]
        )
        ssm_state.index_copy_(0, slots[:, t], h.to(ssm_state.dtype))


def record_delta_states(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    use_qk_l2norm: bool,
    l2norm_eps: float,
) -> None:
    """Write the gated delta rule state after each position of every verifying chunk.

    :param k: ``[T, Hk, Dk]``.
    :param v: ``[T, Hv, Dv]``.
    :param g: ``[T, Hv]`` log decays.
    :param beta: ``[T, Hv]``.
    :param state: ``[num_slots, Hv, Dk, Dv]`` float32; own slots read, scratch slots written.
    :param use_qk_l2norm: L2-normalise the keys per head first (as the op does).
    :param l2norm_eps: the op's epsilon of that normalisation.
    """
    batch = get_forward_context().batch
    vs = _verifying(batch)
    if vs is None:
        return
    dev = v.device
    start, own, has = _chunk_layout(batch, vs, dev)
    slots = vs.slots.to(dev)
    rep = v.shape[1] // k.shape[1]
    s = _initial(state, own, has).float()  # [V, Hv, Dk, Dv]
    last = batch.num_tokens - 1
    for t in range(vs.max_len):
        rows = (start + t).clamp(max=last)
        kt = k[rows].float()
        if use_qk_l2norm:
            kt = kt * torch.rsqrt((kt * kt).sum(dim=-1, keepdim=True) + l2norm_eps)
        kt = kt.repeat_interleave(rep, dim=1)  # [V, Hv, Dk]
        s = s * g[rows].float().exp()[..., None, None]
        pred = torch.einsum("shkv,shk->shv", s, kt)
        delta = (v[rows].float() - pred) * beta[rows].float()[..., None]
        s = s + kt[..., :, None] * delta[..., None, :]
        state.index_copy_(0, slots[:, t], s.to(state.dtype))
