"""Reference Mamba2 backend in plain torch: causal depthwise conv1d and the selective scan.

Both ops work on the flat ragged token layout of :mod:`backplane.core.metadata`
and keep one state per sequence slot:

* ``backplane_torch::causal_conv1d`` is vectorised over every token of the batch
  (prefill, extend and decode alike): each output row gathers its ``kernel_size``
  inputs from this step's tokens or, for the first ``kernel_size - 1`` positions
  of a sequence, from the conv state. The new conv state (the last
  ``kernel_size - 1`` inputs of each sequence, reaching back into the old state
  when a chunk is shorter than that) is gathered the same way and written with
  one ``index_copy_``.
* ``backplane_torch::ssm_scan`` runs the chunked (state-space-duality) form of
  the scan for each prefill/extend sequence — a loop over sequences, vectorised
  over time, heads and chunks — and a single vectorised selective state update
  for all decode sequences.

All arithmetic is float32 whatever the activation dtype; the SSM state is
float32 (:func:`backplane.core.layouts.ssm_state`), the conv state has the
model dtype. Index tensors are derived on the device from the batch's device
tensors; host values are used only for shapes and slicing, so neither op
synchronises with the device.

The ops' ``out`` argument has no default in the schema: with a default, the
dispatcher drops a trailing ``out=None`` before the kernel runs, and torch 2.11's
in-place/view handling of mutable arguments then indexes past the arguments it
got. The backend methods always pass ``out`` (``None`` or a buffer).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from backplane.backends.torch.chained_rows import chained_conv, chained_scan
from backplane.backends.torch.verify_states import record_conv_states, record_scan_states
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.families import ConvLayerSpec, SSMBackend, SSMLayerSpec
from backplane.core.forward_context import get_forward_context
from backplane.core.metadata import BatchMetadata

# -- causal conv1d ------------------------------------------------------------------------------


def _token_layout(batch: BatchMetadata, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per-token sequence index, offset inside this step's chunk, slot and has-state flag.

    :return: ``(seq, offset, slot, has_state)`` for the real tokens, all on ``device``.
    """
    n = batch.num_tokens
    seq = batch.token_seq_ids[:n].to(device=device, dtype=torch.long)
    tok = torch.arange(n, device=device)
    offset = tok - batch.query_start_loc.to(device=device, dtype=torch.long)[seq]
    slot = batch.state_slots.to(device=device, dtype=torch.long)[seq]
    has_state = batch.has_initial_state.to(device=device)[seq]
    return seq, offset, slot, has_state


@cached_op(
    "backplane_torch::causal_conv1d",
    mutates_args=("conv_state", "out"),
    output_shape=SSMBackend.conv_output_shape,
)
def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    activation: str,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Causal depthwise conv1d per sequence, continuing from and updating the conv state.

    :param x: ``[T, conv_dim]`` inputs (padded token count ``T``).
    :param weight: ``[conv_dim, kernel_size]``.
    :param bias: ``[conv_dim]`` or ``None``.
    :param conv_state: ``[num_slots, conv_dim, kernel_size - 1]``; the slot of each
        sequence is read when ``has_initial_state`` (zeros otherwise) and left holding
        the sequence's last ``kernel_size - 1`` inputs.
    :param activation: ``"silu"`` or ``""``.
    :param out: optional ``[T, conv_dim]`` buffer.
    :return: the output, or the empty sentinel when ``out`` is given.
    """
    if activation not in ("silu", ""):
        raise ValueError(f"unsupported conv activation {activation!r}; use 'silu' or ''")
    batch = get_forward_context().batch
    buf = output_buffer(out, x.shape, x.dtype, x.device)
    n = batch.num_tokens
    width = weight.shape[1] - 1  # the state holds kernel_size - 1 inputs
    record_conv_states(x, conv_state)  # before the sequences' slots are overwritten
    chain = batch.chained_rows
    if chain is not None and n > 0:
        buf[:n].copy_(chained_conv(x, weight, bias, conv_state, activation, chain, n))
    elif n > 0:
        seq, offset, slot, has_state = _token_layout(batch, x.device)
        tok = torch.arange(n, device=x.device)
        acc = torch.zeros((n, x.shape[1]), dtype=torch.float32, device=x.device)
        w = weight.float()
        for k in range(width + 1):  # loop over the kernel taps, not over tokens
            # tap k of token t reads the input `width - k` positions earlier in its sequence
            src = offset - width + k
            from_x = src >= 0
            xv = x[(tok - width + k).clamp(min=0)].float()
            if width > 0:
                sv = conv_state[slot, :, (src + width).clamp(0, width - 1)].float()
                # a slot without initial state may hold anything (even NaN): select, never multiply
                sv = torch.where(has_state[:, None], sv, 0.0)
                xv = torch.where(from_x[:, None], xv, sv)
            acc.addcmul_(xv, w[:, k])
        if bias is not None:
            acc += bias.float()
        if activation == "silu":
            acc = F.silu(acc)
        buf[:n].copy_(acc)

        if width > 0 and batch.num_seqs > 0:
            # new state position p holds the input `width - p` positions before the sequence end
            dev = x.device
            qsl = batch.query_start_loc.to(device=dev, dtype=torch.long)
            qlen = batch.query_lens.to(device=dev, dtype=torch.long)[: batch.num_seqs]
            slots = batch.state_slots.to(device=dev, dtype=torch.long)[: batch.num_seqs]
            has = batch.has_initial_state.to(device=dev)[: batch.num_seqs]
            pos = torch.arange(width, device=dev)
            src = qlen[:, None] - width + pos[None, :]  # [S, width] offset inside the chunk
            xs = x[(qsl[: batch.num_seqs, None] + src).clamp(min=0, max=n - 1)]  # [S, width, C]
            old = conv_state[slots[:, None], :, (src + width).clamp(0, width - 1)]  # [S, width, C]
            old = torch.where(has[:, None, None], old, torch.zeros((), dtype=old.dtype, device=dev))
            new = torch.where((src >= 0)[:, :, None], xs.to(conv_state.dtype), old)
            conv_state.index_copy_(0, slots, new.transpose(1, 2).to(conv_state.dtype))
    return finish_output(out, buf, n)


# -- selective scan -----------------------------------------------------------------------------


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """Stable segment sums: ``out[..., i, j] = sum(a[..., j+1:i+1])`` for ``i >= j``, else ``-inf``.

    :param a: ``[..., L]``.
    :return: ``[..., L, L]``.
    """
    length = a.shape[-1]
    x = a[..., None].expand(*a.shape, length)
    strict = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    x = x.masked_fill(~strict, 0).cumsum(dim=-2)
    lower = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(0)
    return x.masked_fill(~lower, float("-inf"))


def _chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state0: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba2 scan of one sequence in chunked (SSD) form, without the D skip.

    :param x: ``[L, H, P]`` float32.
    :param dt: ``[L, H]`` float32, already discretised (bias and softplus applied).
    :param A: ``[H]`` float32.
    :param B: ``[L, H, N]`` float32 (groups already expanded to heads).
    :param C: ``[L, H, N]`` float32.
    :param state0: ``[H, P, N]`` float32 initial state.
    :param chunk_size: tokens per chunk.
    :return: ``(y [L, H, P], final_state [H, P, N])``.
    """
    length = x.shape[0]
    cs = max(1, min(chunk_size, length))
    pad = (-length) % cs
    if pad:
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, B, C))
    nc = (length + pad) // cs
    xdt = (x * dt[..., None]).reshape(nc, cs, *x.shape[1:])  # [c, l, h, p]
    a = (dt * A).reshape(nc, cs, -1).permute(2, 0, 1)  # [h, c, l]
    B = B.reshape(nc, cs, *B.shape[1:])
    C = C.reshape(nc, cs, *C.shape[1:])
    a_cum = a.cumsum(dim=-1)

    # within each chunk: attention-like form with the decay between positions as the mask
    decay = torch.exp(_segsum(a))  # [h, c, l, s]
    scores = torch.einsum("clhn,cshn->hcls", C, B) * decay
    y = torch.einsum("hcls,cshp->clhp", scores, xdt)

    # state contributed by each chunk, decayed to the chunk end
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [h, c, l]
    chunk_states = torch.einsum("clhn,hcl,clhp->chpn", B, to_end, xdt)

    # states at chunk boundaries: decay the initial state and earlier chunks' states forward
    states = torch.cat([state0[None], chunk_states], dim=0)  # [c+1, h, p, n]
    chunk_decay = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0))))  # [h, c+1, c+1]
    # states[:, z] is the state at the start of chunk z (z == nc: the final state)
    states = torch.einsum("hzc,chpn->hzpn", chunk_decay, states)
    start_states, final = states[:, :-1], states[:, -1]

    # contribution of each chunk's start state to its outputs
    y = y + torch.einsum("clhn,hcpn,hcl->clhp", C, start_states, torch.exp(a_cum))
    return y.reshape(nc * cs, *y.shape[2:])[:length], final


@cached_op(
    "backplane_torch::ssm_scan",
    mutates_args=("ssm_state", "out"),
    output_shape=SSMBackend.scan_output_shape,
)
def ssm_scan(
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
    chunk_size: int,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Mamba2 selective scan over a ragged batch (see :meth:`SSMBackend.scan`).

    :param x: ``[T, H, P]``.
    :param dt: ``[T, H]`` raw time steps (``dt_bias`` and softplus applied here).
    :param A: ``[H]``.
    :param B: ``[T, G, N]``.
    :param C: ``[T, G, N]``.
    :param D: ``[H]``.
    :param dt_bias: ``[H]``.
    :param z: ``[T, H, P]`` gate or ``None``.
    :param ssm_state: ``[num_slots, H, P, N]`` float32.
    :param dt_softplus: apply softplus to ``dt + dt_bias``.
    :param chunk_size: chunk length of the prefill scan.
    :param out: optional ``[T, H, P]`` buffer.
    :return: the output, or the empty sentinel when ``out`` is given.
    """
    batch = get_forward_context().batch
    buf = output_buffer(out, x.shape, x.dtype, x.device)
    n = batch.num_tokens
    nheads = x.shape[1]
    rep = nheads // B.shape[1]  # heads per B/C group
    A32, D32 = A.float(), D.float()
    host = batch.host
    record_scan_states(x, dt, A, B, dt_bias, ssm_state, dt_softplus)

    def discretise(dt_rows: torch.Tensor) -> torch.Tensor:
        d = dt_rows.float() + dt_bias.float()
        return F.softplus(d) if dt_softplus else d

    def finish_rows(y: torch.Tensor, rows: slice) -> None:
        """Add the D skip, apply the z gate and write the rows into the output."""
        y = y + x[rows].float() * D32[:, None]
        if z is not None:
            y = y * F.silu(z[rows].float())
        buf[rows].copy_(y)

    if batch.num_prefill_seqs > 0:
        p = batch.num_prefill_seqs
        slots = batch.state_slots.to(device=x.device, dtype=torch.long)[:p]
        has = batch.has_initial_state.to(device=x.device)[:p]
        # read every initial state before any slot is written
        init = torch.where(has[:, None, None, None], ssm_state.index_select(0, slots), 0.0)
        finals = []
        for i in range(p):  # per-sequence loop; each scan is vectorised over time
            start, end = int(host.query_start_loc[i]), int(host.query_start_loc[i + 1])
            rows = slice(start, end)
            y, final = _chunked_scan(
                x[rows].float(),
                discretise(dt[rows]),
                A32,
                B[rows].float().repeat_interleave(rep, dim=1),
                C[rows].float().repeat_interleave(rep, dim=1),
                init[i],
                chunk_size,
            )
            finish_rows(y, rows)
            finals.append(final)
        ssm_state.index_copy_(0, slots, torch.stack(finals).to(ssm_state.dtype))

    if batch.chained_rows is not None and n > 0:
        # a verify graph's rows: every row is a decode step, chained through its slots
        y = chained_scan(x, dt, A, B, C, dt_bias, ssm_state, dt_softplus, batch.chained_rows, n)
        finish_rows(y, slice(0, n))
    elif batch.num_decode_seqs > 0:
        p, s = batch.num_prefill_seqs, batch.num_seqs
        rows = slice(batch.num_prefill_tokens, n)  # one token per decode sequence
        slots = batch.state_slots.to(device=x.device, dtype=torch.long)[p:s]
        h = ssm_state.index_select(0, slots)  # [S, H, P, N]
        d = discretise(dt[rows])  # [S, H]
        b = B[rows].float().repeat_interleave(rep, dim=1)  # [S, H, N]
        c = C[rows].float().repeat_interleave(rep, dim=1)
        xv = x[rows].float()  # [S, H, P]
        h = (
            h * torch.exp(d * A32)[:, :, None, None]
            + (d[:, :, None] * xv)[..., None] * b[:, :, None, :]
        )
        ssm_state.index_copy_(0, slots, h.to(ssm_state.dtype))
        finish_rows(torch.einsum("shpn,shn->shp", h, c), rows)

    return finish_output(out, buf, n)


class TorchSSMBackend(SSMBackend):
    """Reference Mamba2 backend: causal conv1d and selective scan in plain torch (any device)."""

    name = "torch"
    chains_rows = True

    def conv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        layer: ConvLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``backplane_torch::causal_conv1d`` (see :meth:`SSMBackend.conv`)."""
        return causal_conv1d(x, weight, bias, conv_state, layer.activation, out)

    def scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor,
        dt_bias: torch.Tensor,
        z: torch.Tensor | None,
        ssm_state: torch.Tensor,
        layer: SSMLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``backplane_torch::ssm_scan`` (see :meth:`SSMBackend.scan`)."""
        return ssm_scan(
            x, dt, A, B, C, D, dt_bias, z, ssm_state, layer.dt_softplus, layer.chunk_size, out
        )

    def dynamic_ops(self) -> tuple[Any, ...]:
        """The two custom ops this backend calls."""
        return (
            torch.ops.backplane_torch.causal_conv1d.default,
            torch.ops.backplane_torch.ssm_scan.default,
        )
