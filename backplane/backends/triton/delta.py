"""Gated delta rule on fla's Triton kernels, with the state cache addressed by slot.

One cached op, ``backplane_triton::gated_delta``:

* prefill/extend sequences run ``chunk_gated_delta_rule`` over the packed
  tokens with ``cu_seqlens`` (device), ``cu_seqlens_cpu`` (from ``batch.host``)
  and the chunk index table built from the host values in :meth:`plan` and
  copied from pinned memory without blocking, so fla never reads the device
  ``cu_seqlens`` back (which would synchronise); their initial states are gathered from
  the slots (zeros without ``has_initial_state``) and the final states
  scattered back;
* decode sequences run ``fused_recurrent_gated_delta_rule`` as a batch of
  length-1 sequences, with the same gather/scatter (fla 0.6 has no in-place
  slot indexing).

Grouped value heads (``num_v_heads > num_k_heads``) are native to both fla
kernels. States are float32 ``[S, Hv, Dk, Dv]``, fla's ``[N, HV, K, V]`` layout.
"""

from __future__ import annotations

import functools
import types

import numpy as np
import torch

from backplane.backends.triton._common import exact_fp32_dots
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.families import DeltaBackend, DeltaLayerSpec
from backplane.core.forward_context import get_forward_context
from backplane.core.metadata import BatchMetadata

#: The chunk length of fla's chunked gated delta rule (its default).
FLA_CHUNK = 64


@functools.cache
def _fla() -> types.SimpleNamespace:
    """Import fla's two gated-delta-rule entry points (once)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return types.SimpleNamespace(
        chunk=chunk_gated_delta_rule, recurrent=fused_recurrent_gated_delta_rule
    )


def _plan(batch: BatchMetadata) -> dict:
    """Per-step prefill index tensors shared by every delta layer.

    Only prefill uses them: prefill runs eagerly, while decode may be captured
    in a CUDA graph, so decode indices are derived inside the op from the
    batch's persistent tensors (a tensor made here would be frozen into the graph).
    """
    n = batch.num_prefill_seqs
    plan: dict = {"prefill": None}
    if n:
        cu_host = batch.host.query_start_loc[: n + 1].astype(np.int64)
        # fla's chunk index table ([chunk, 2] = (sequence, chunk within it)), built here on
        # the host: fla would build it from the device cu_seqlens (a repeat_interleave that
        # syncs) or copy it from pageable host memory (which syncs too).
        counts = -(-np.diff(cu_host) // FLA_CHUNK)
        seq_ids = np.repeat(np.arange(n, dtype=np.int64), counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        host_idx = torch.from_numpy(
            np.stack([seq_ids, np.arange(len(seq_ids), dtype=np.int64) - starts], 1)
        )
        device = batch.device
        if device.type == "cuda":
            host_idx = host_idx.pin_memory()
        plan["prefill"] = {
            "cu_seqlens": batch.query_start_loc[: n + 1].long(),
            "cu_seqlens_cpu": torch.from_numpy(cu_host),
            "chunk_indices": host_idx.to(device, non_blocking=True),
            "pinned": host_idx,  # keeps the pinned source alive until the copy is done
            "slots": batch.state_slots[:n].long(),
            "has_init": batch.has_initial_state[:n],
        }
    return plan


@cached_op(
    "backplane_triton::gated_delta",
    mutates_args=("state", "out"),
    output_shape=DeltaBackend.output_shape,
)
def gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule over a ragged batch (see the module docstring).

    :param q: ``[T, Hk, Dk]``.
    :param k: ``[T, Hk, Dk]``.
    :param v: ``[T, Hv, Dv]``.
    :param g: ``[T, Hv]`` log decay.
    :param beta: ``[T, Hv]``.
    :param state: ``[S, Hv, Dk, Dv]`` float32.
    :param scale: applied to ``q``.
    :param use_qk_l2norm: L2-normalise ``q`` and ``k`` in the kernel.
    :param out: optional ``[T, Hv, Dv]`` buffer.
    :return: the output or the empty sentinel.
    """
    ctx = get_forward_context()
    batch = ctx.batch
    buf = output_buffer(out, v.shape, v.dtype, v.device)
    plan = ctx.plan("delta")
    if not isinstance(plan, dict):
        plan = _plan(batch)
    fla = _fla()
    tp = batch.num_prefill_tokens
    pre = plan["prefill"]
    if pre is not None:
        slots = pre["slots"]
        h0 = torch.where(pre["has_init"][:, None, None, None], state[slots], 0.0)
        with exact_fp32_dots(v.dtype):
            o, ht = fla.chunk(
                q[:tp].unsqueeze(0).contiguous(),
                k[:tp].unsqueeze(0).contiguous(),
                v[:tp].unsqueeze(0).contiguous(),
                g[:tp].unsqueeze(0).contiguous(),
                beta[:tp].unsqueeze(0).contiguous(),
                scale=scale,
                initial_state=h0,
                output_final_state=True,
                use_qk_l2norm_in_kernel=bool(use_qk_l2norm),
                cu_seqlens=pre["cu_seqlens"],
                cu_seqlens_cpu=pre["cu_seqlens_cpu"],
                chunk_indices=pre["chunk_indices"],
                chunk_size=FLA_CHUNK,
            )
        buf[:tp].copy_(o[0])
        state.index_copy_(0, slots, ht.to(state.dtype))
    nd = batch.num_decode_seqs
    if nd:
        a, b = tp, batch.num_tokens
        np_ = batch.num_prefill_seqs
        slots = batch.state_slots[np_ : np_ + nd].long()
        # A batch of nd sequences of length 1: [nd, 1, heads, dim].
        with exact_fp32_dots(v.dtype):
            o, ht = fla.recurrent(
                q[a:b].unsqueeze(1).contiguous(),
                k[a:b].unsqueeze(1).contiguous(),
                v[a:b].unsqueeze(1).contiguous(),
                g=g[a:b].unsqueeze(1).contiguous(),
                beta=beta[a:b].unsqueeze(1).contiguous(),
                scale=scale,
                initial_state=state[slots],
                output_final_state=True,
                use_qk_l2norm_in_kernel=bool(use_qk_l2norm),
            )
        buf[a:b].copy_(o[:, 0])
        state.index_copy_(0, slots, ht.to(state.dtype))
    return finish_output(out, buf, batch.num_tokens)


class TritonDeltaBackend(DeltaBackend):
    """Gated delta rule with fla's chunked (prefill) and fused recurrent (decode) Triton kernels."""

    name = "triton"

    def plan(self, batch: BatchMetadata) -> dict:
        """Build the prefill ``cu_seqlens`` (device and host) and slot indices once per step."""
        return _plan(batch)

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
        """The gated delta rule; see :meth:`DeltaBackend.forward`."""
        return torch.ops.backplane_triton.gated_delta(
            q, k, v, g, beta, state, float(layer.q_scale), bool(layer.use_qk_l2norm), out
        )

    def dynamic_ops(self) -> tuple:
        """The delta op runs eagerly between captured graph segments."""
        return (torch.ops.backplane_triton.gated_delta.default,)
