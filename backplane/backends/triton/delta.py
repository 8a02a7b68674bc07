"""Gated delta rule on fla's Triton kernels, with the state cache addressed by slot.

One cached op, ``backplane_triton::gated_delta``:

* prefill/extend sequences run ``chunk_gated_delta_rule`` over the packed
  tokens with ``cu_seqlens`` (device), ``cu_seqlens_cpu`` (from ``batch.host``)
  and the chunk index table built from the host values in :meth:`plan` and
  copied from pinned memory without blocking, so fla never reads the device
  ``cu_seqlens`` back (which would synchronise); their initial states are gathered from
  the slots (zeros without ``has_initial_state``) and the final states
  scattered back;
* decode sequences run our kernel (:mod:`backplane.backends.triton.delta_decode`),
  one program per (sequence, value head, value block), which reads each
  sequence's state from its slot and writes it back there: no gather, no
  scatter, nothing allocated.

Grouped value heads (``num_v_heads > num_k_heads``) are native to both
kernels. States are float32 ``[S, Hv, Dk, Dv]``, fla's ``[N, HV, K, V]`` layout.
"""

from __future__ import annotations

import functools
import types

import numpy as np
import torch

from backplane.backends.torch.delta import L2NORM_EPS
from backplane.backends.torch.verify_states import record_delta_states
from backplane.backends.triton._common import exact_fp32_dots, sequence_blocks
from backplane.backends.triton.delta_decode import delta_decode
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.families import DeltaBackend, DeltaLayerSpec
from backplane.core.forward_context import get_forward_context
from backplane.core.metadata import BatchMetadata

#: The chunk length of fla's chunked gated delta rule (its default).
FLA_CHUNK = 64


@functools.cache
def _fla() -> types.SimpleNamespace:
    """Import fla's chunked gated delta rule (once)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return types.SimpleNamespace(chunk=chunk_gated_delta_rule)


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
        # fla's chunk index table ([chunk, 2] = (sequence, chunk within it)), built on the
        # host: fla would build it from the device cu_seqlens (a repeat_interleave that
        # syncs) or copy it from pageable host memory (which syncs too).
        chunk_indices, pinned = sequence_blocks(np.diff(cu_host), FLA_CHUNK, batch.device)
        plan["prefill"] = {
            "cu_seqlens": batch.query_start_loc[: n + 1].long(),
            "cu_seqlens_cpu": torch.from_numpy(cu_host),
            "chunk_indices": chunk_indices,
            "pinned": pinned,  # keeps the pinned source alive until the copy is done
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
    # speculative verification: per-position states, before the kernels overwrite the slots
    record_delta_states(k, v, g, beta, state, use_qk_l2norm, L2NORM_EPS)
    plan = ctx.plan("delta")
    if not isinstance(plan, dict):
        plan = _plan(batch)
    tp = batch.num_prefill_tokens
    pre = plan["prefill"]
    if pre is not None:
        fla = _fla()
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
    if nd and batch.chained_rows is not None:
        # a verify graph's rows (all decodes): one launch per chunk position, each running
        # the rows at that position from their source slots into their destination slots
        b, chain = batch.num_tokens, batch.chained_rows
        for j in range(chain.num_positions):
            delta_decode(
                q[:b], k[:b], v[:b], g[:b], beta[:b], state, chain.src_slots[:b], scale,
                use_qk_l2norm, buf[:b], dst_slots=chain.dst_slots[:b],
                positions=chain.position[:b], position=j,
            )  # fmt: skip
    elif nd:
        a, b = tp, batch.num_tokens
        np_ = batch.num_prefill_seqs
        delta_decode(
            q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state,
            batch.state_slots[np_ : np_ + nd], scale, use_qk_l2norm, buf[a:b],
        )  # fmt: skip
    return finish_output(out, buf, batch.num_tokens)


class TritonDeltaBackend(DeltaBackend):
    """Gated delta rule: fla's chunked kernel (prefill) and our in-place decode kernel."""

    name = "triton"
    chains_rows = True

    def plan(self, batch: BatchMetadata) -> dict | None:
        """Build the prefill ``cu_seqlens`` (device and host) and slot indices once per step.

        :param batch: the step's metadata.
        :return: the plan, or ``None`` for a decode graph (nothing to plan: it has no
            prefill, and its replays read everything on the device).
        """
        if batch.mode.is_decode_graph:
            return None
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
        return gated_delta(
            q, k, v, g, beta, state, float(layer.q_scale), bool(layer.use_qk_l2norm), out
        )

    def dynamic_ops(self) -> tuple:
        """The delta op runs eagerly between captured graph segments."""
        return (torch.ops.backplane_triton.gated_delta.default,)
