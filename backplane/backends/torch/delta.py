"""Reference gated delta rule backend in plain torch (Qwen3-Next / Qwen3.5 linear attention).

One op, ``backplane_torch::gated_delta_rule``, over the flat ragged token layout
of :mod:`backplane.core.metadata` with one float32 state ``[Hv, Dk, Dv]`` per
sequence slot:

* prefill/extend sequences use the chunked form (a loop over sequences; inside a
  sequence, the intra-chunk delta-rule updates are condensed with the UT
  transform — one triangular solve per chunk, all chunks at once — and only the
  short loop over chunks carries the state from one chunk to the next);
* decode sequences take one recurrent step, vectorised over the whole batch.

Conventions (as in Qwen3-Next): value head ``h`` uses key head
``h // (Hv // Hk)``; with ``use_qk_l2norm`` q and k are scaled by
``rsqrt(sum(x^2) + 1e-6)`` in float32; q is then multiplied by ``scale``; the
state is decayed by ``exp(g)`` before the delta update, and the output reads the
updated state. All arithmetic is float32.

The ops' ``out`` argument has no default in the schema: with a default, the
dispatcher drops a trailing ``out=None`` before the kernel runs, and torch 2.11's
in-place/view handling of mutable arguments then indexes past the arguments it
got. The backend methods always pass ``out`` (``None`` or a buffer).
"""

from __future__ import annotations

from typing import Any

import torch

from backplane.backends.torch.chained_rows import chained_delta
from backplane.backends.torch.verify_states import record_delta_states
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.families import DeltaBackend, DeltaLayerSpec
from backplane.core.forward_context import get_forward_context

#: Tokens per chunk of the prefill form (the result does not depend on it).
CHUNK_SIZE = 64
#: Epsilon of the in-kernel L2 normalisation (as in fla and transformers).
L2NORM_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 q, k with the optional L2 norm, the q scale and key heads expanded to value heads."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    rep = num_v_heads // k.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return q, k


def _chunked_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of one sequence in chunked (WY / UT-transform) form.

    :param q: ``[L, H, Dk]`` float32, normalised, scaled, one row per value head.
    :param k: ``[L, H, Dk]`` float32.
    :param v: ``[L, H, Dv]`` float32.
    :param g: ``[L, H]`` float32 log decays.
    :param beta: ``[L, H]`` float32.
    :param state: ``[H, Dk, Dv]`` float32 initial state.
    :param chunk_size: tokens per chunk.
    :return: ``(o [L, H, Dv], final_state [H, Dk, Dv])``.
    """
    length = q.shape[0]
    cs = max(1, min(chunk_size, length))
    pad = (-length) % cs
    nc = (length + pad) // cs

    def chunks(t: torch.Tensor) -> torch.Tensor:
        # [L, H, ...] -> [H, nc, cs, ...]; padded tokens have k = v = beta = g = 0 (no effect)
        t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(nc, cs, *t.shape[1:]).movedim(2, 0)

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    g_cum = g.cumsum(dim=-1)  # [H, c, l] log decay from the chunk start to l (inclusive)
    causal = torch.ones(cs, cs, dtype=torch.bool, device=q.device).tril()
    # decay[..., i, j] = exp(g_cum_i - g_cum_j) for j <= i; masked before exp so it cannot overflow
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    k_beta = k * beta[..., None]
    # Within a chunk the pre-update values u_i = beta_i (v_i - S_{i-1}^T k_i) satisfy
    # (I + tril(diag(beta) K K^T * decay, -1)) U = beta * (V - decayed K_start S0): a unit lower
    # triangular system, solved once for V and once for the keys reading the chunk-start state.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~causal.tril(-1), 0.0) + torch.eye(cs, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * g_cum.exp()[..., None], upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay  # [H, c, l, s], causal incl. diagonal
    q_start = q * g_cum.exp()[..., None]  # reads the chunk-start state
    k_end = k * (g_cum[..., -1:] - g_cum).exp()[..., None]  # writes decayed to the chunk end
    chunk_decay = g_cum[..., -1].exp()  # [H, c]

    o = torch.empty_like(v)
    s = state
    for c in range(nc):  # only the carry of the state between chunks is sequential
        v_new = u[:, c] - w[:, c] @ s  # [H, l, Dv]
        o[:, c] = q_start[:, c] @ s + attn[:, c] @ v_new
        s = s * chunk_decay[:, c, None, None] + k_end[:, c].transpose(-1, -2) @ v_new
    heads, dv = o.shape[0], o.shape[-1]
    return o.movedim(0, 2).reshape(nc * cs, heads, dv)[:length], s


@cached_op(
    "backplane_torch::gated_delta_rule",
    mutates_args=("state", "out"),
    output_shape=DeltaBackend.output_shape,
)
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Gated delta rule over a ragged batch (see :meth:`DeltaBackend.forward`).

    :param q: ``[T, Hk, Dk]``.
    :param k: ``[T, Hk, Dk]``.
    :param v: ``[T, Hv, Dv]``.
    :param g: ``[T, Hv]`` log decays.
    :param beta: ``[T, Hv]``.
    :param state: ``[num_slots, Hv, Dk, Dv]`` float32; each sequence's slot is read
        when ``has_initial_state`` (zeros otherwise) and left holding its final state.
    :param scale: multiplies q (after the optional L2 norm).
    :param use_qk_l2norm: L2-normalise q and k per head first.
    :param out: optional ``[T, Hv, Dv]`` buffer.
    :return: the output, or the empty sentinel when ``out`` is given.
    """
    batch = get_forward_context().batch
    buf = output_buffer(out, v.shape, v.dtype, v.device)
    n = batch.num_tokens
    hv = v.shape[1]
    host = batch.host
    dev = v.device
    record_delta_states(k, v, g, beta, state, use_qk_l2norm, L2NORM_EPS)

    if batch.num_prefill_seqs > 0:
        p = batch.num_prefill_seqs
        slots = batch.state_slots.to(device=dev, dtype=torch.long)[:p]
        has = batch.has_initial_state.to(device=dev)[:p]
        # read every initial state before any slot is written; a slot without initial state
        # may hold anything (even NaN), so select rather than multiply
        init = torch.where(has[:, None, None, None], state.index_select(0, slots), 0.0)
        finals = []
        for i in range(p):  # per-sequence loop; each sequence is chunked and vectorised
            rows = slice(int(host.query_start_loc[i]), int(host.query_start_loc[i + 1]))
            qs, ks = _prepare_qk(q[rows], k[rows], hv, scale, use_qk_l2norm)
            o, final = _chunked_delta(
                qs, ks, v[rows].float(), g[rows].float(), beta[rows].float(), init[i]
            )
            buf[rows].copy_(o)
            finals.append(final)
        state.index_copy_(0, slots, torch.stack(finals).to(state.dtype))

    if batch.chained_rows is not None and n > 0:
        # a verify graph's rows: every row is a decode step, chained through its slots
        qs, ks = _prepare_qk(q[:n], k[:n], hv, scale, use_qk_l2norm)
        buf[:n].copy_(chained_delta(qs, ks, v, g, beta, state, batch.chained_rows, n))
    elif batch.num_decode_seqs > 0:
        p, s_end = batch.num_prefill_seqs, batch.num_seqs
        rows = slice(batch.num_prefill_tokens, n)  # one token per decode sequence
        slots = batch.state_slots.to(device=dev, dtype=torch.long)[p:s_end]
        qs, ks = _prepare_qk(q[rows], k[rows], hv, scale, use_qk_l2norm)  # [S, Hv, Dk]
        s = state.index_select(0, slots) * g[rows].float().exp()[..., None, None]
        pred = torch.einsum("shkv,shk->shv", s, ks)
        delta = (v[rows].float() - pred) * beta[rows].float()[..., None]
        s = s + ks[..., :, None] * delta[..., None, :]
        state.index_copy_(0, slots, s.to(state.dtype))
        buf[rows].copy_(torch.einsum("shkv,shk->shv", s, qs))

    return finish_output(out, buf, n)


class TorchDeltaBackend(DeltaBackend):
    """Reference gated delta rule backend in plain torch (any device)."""

    name = "torch"
    chains_rows = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        layer: DeltaLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``backplane_torch::gated_delta_rule`` (see :meth:`DeltaBackend.forward`)."""
        if layer.num_v_heads % layer.num_k_heads:
            raise ValueError(
                f"num_v_heads={layer.num_v_heads} must be a multiple of "
                f"num_k_heads={layer.num_k_heads}"
            )
        return gated_delta_rule(q, k, v, g, beta, state, layer.q_scale, layer.use_qk_l2norm, out)

    def dynamic_ops(self) -> tuple[Any, ...]:
        """The custom op this backend calls."""
        return (torch.ops.backplane_torch.gated_delta_rule.default,)
