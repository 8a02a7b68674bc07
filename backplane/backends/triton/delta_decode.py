"""Gated delta rule decode on Triton: one token per sequence, the state updated in its slot.

:func:`delta_decode` launches ``_delta_decode_kernel`` with one program per
(decode sequence, value head, block of the value dimension). A program reads
its slice ``state[slot, h, :, v_block]`` (float32) once, decays it by
``exp(g)``, applies the delta-rule update with ``beta`` and writes it back to
the same slot, and writes the output row from the updated state; no state is
gathered into or scattered from a temporary. Semantics are those of the torch
reference (:mod:`backplane.backends.torch.delta`):

* value head ``h`` reads key head ``h // (Hv // Hk)``;
* with ``use_qk_l2norm``, ``q`` and ``k`` are scaled by
  ``rsqrt(sum(x^2) + 1e-6)`` in float32, then ``q`` by ``scale``;
* ``S = exp(g) S``, ``S += k (beta (v - S^T k))^T``, ``o = S^T q``.

All arithmetic is float32 whatever the activation dtype. The launch allocates
nothing and reads no device value on the host (the grid comes from the host
count of decode sequences), so it can be captured in a CUDA graph. Scratch
sequences of a padded decode graph may share the reserved slot 0; their
programs race on that slot only.

The chained rows of a verify graph (:class:`~backplane.core.metadata.ChainedRows`)
launch the same kernel once per chunk position ``j``: a row reads its source
slot and writes its destination slot, and only the rows at position ``j``
read or write anything.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backplane.backends.torch.delta import L2NORM_EPS
from backplane.backends.triton._common import next_pow2
from backplane.core.launch import KernelLauncher, cdiv

#: Largest block of the value dimension one program updates.
MAX_BLOCK_V = 32


@triton.jit
def _delta_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    o_ptr,
    slots_ptr,
    dst_ptr,
    pos_ptr,
    position,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    stride_ot,
    stride_oh,
    stride_od,
    scale,
    eps,
    DK,
    DV,
    GROUP,
    L2NORM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    CHAINED: tl.constexpr,
):
    """One decode token of one sequence, one value head, one block of the value dimension.

    With ``CHAINED`` the row reads slot ``slots[i]`` and writes slot ``dst[i]``, and
    only when ``pos[i] == position``; otherwise it updates ``slots[i]`` in place.
    """
    i = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    row = i.to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    out_slot = slot
    k_lim = DK
    v_lim = DV
    if CHAINED:
        out_slot = tl.load(dst_ptr + i).to(tl.int64)
        # a row at another position masks everything: no load, no store
        run = (tl.load(pos_ptr + i) == position).to(tl.int32)
        k_lim = DK * run
        v_lim = DV * run
    hk = h // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = offs_k < k_lim
    v_mask = offs_v < v_lim
    q = tl.load(
        q_ptr + row * stride_qt + hk * stride_qh + offs_k * stride_qd, mask=k_mask, other=0.0
    )
    k = tl.load(
        k_ptr + row * stride_kt + hk * stride_kh + offs_k * stride_kd, mask=k_mask, other=0.0
    )
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
    q = q * scale
    v = tl.load(
        v_ptr + row * stride_vt + h * stride_vh + offs_v * stride_vd, mask=v_mask, other=0.0
    )
    v = v.to(tl.float32)
    g = tl.load(g_ptr + row * stride_gt + h * stride_gh).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_bt + h * stride_bh).to(tl.float32)
    within = offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    ptrs = state_ptr + slot * stride_ss + h * stride_sh + within
    mask = k_mask[:, None] & v_mask[None, :]
    s = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s += k[:, None] * delta[None, :]
    out_ptrs = state_ptr + out_slot * stride_ss + h * stride_sh + within
    tl.store(out_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(
        o_ptr + row * stride_ot + h * stride_oh + offs_v * stride_od,
        o.to(o_ptr.dtype.element_ty),
        mask=v_mask,
    )


_DELTA_DECODE = KernelLauncher(_delta_decode_kernel)


def delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    out: torch.Tensor,
    *,
    dst_slots: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    position: int = 0,
) -> None:
    """One gated-delta-rule step for each decode row, updating ``state`` in its slots.

    Row ``i`` of every input is sequence ``i``'s token; its state lives in
    ``state[slots[i]]``. Real sequences must have distinct slots.

    With ``dst_slots`` and ``positions`` (chained rows) only the rows whose
    position is ``position`` run: each reads ``state[slots[i]]`` and writes the
    updated state to ``state[dst_slots[i]]`` and its output row; the others
    touch nothing.

    :param q: ``[n, Hk, Dk]``.
    :param k: ``[n, Hk, Dk]``.
    :param v: ``[n, Hv, Dv]``.
    :param g: ``[n, Hv]`` log decay.
    :param beta: ``[n, Hv]``.
    :param state: ``[S, Hv, Dk, Dv]``, updated in place at ``slots``.
    :param slots: ``[n]`` integer slot of each row.
    :param scale: multiplies ``q`` (after the optional L2 norm).
    :param use_qk_l2norm: L2-normalise ``q`` and ``k`` per head first.
    :param out: ``[n, Hv, Dv]`` receives the outputs.
    :param dst_slots: ``[n]`` the slot each row writes (chained rows), or ``None``.
    :param positions: ``[n]`` each row's chunk position (with ``dst_slots``).
    :param position: the position whose rows run.
    """
    chained = dst_slots is not None
    if chained != (positions is not None):
        raise ValueError("chained rows need both dst_slots and positions; give both or neither")
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if n == 0:
        return
    if hv % hk:
        raise ValueError(f"num_v_heads={hv} must be a multiple of num_k_heads={hk}")
    block_v = min(MAX_BLOCK_V, next_pow2(dv))
    grid = (n, hv, cdiv(dv, block_v))
    _DELTA_DECODE.launch(grid, (
        q, k, v, g, beta, state, out, slots,
        dst_slots if chained else slots, positions if chained else slots, int(position),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        float(scale), L2NORM_EPS, dk, dv, hv // hk), q.device.index,
        L2NORM=bool(use_qk_l2norm), BLOCK_K=next_pow2(dk), BLOCK_V=block_v, CHAINED=chained,
    )  # fmt: skip
