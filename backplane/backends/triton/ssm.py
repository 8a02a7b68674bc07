"""Mamba2 on Triton: our causal-conv and prefill-epilogue kernels, mamba-ssm's scan kernels.

Two cached ops:

``backplane_triton::causal_conv`` (ours)
    ``_conv_kernel`` computes every output token in parallel, one program per
    (sequence, token block, channel block): the ``kernel_size - 1`` inputs
    before a sequence's first new token come from its conv-state slot (when
    ``has_initial_state``, else zeros). ``_conv_state_kernel`` then stores the
    last ``kernel_size - 1`` inputs of each sequence (new tokens, topped up from
    the old state for short chunks) back into the slot. Two launches, so that
    no program reads a state another program already overwrote. A decode-only
    step (one new token per sequence) takes ``_conv_decode_kernel`` instead:
    one program per (sequence, channel block) reads its window, writes the
    output, then shifts its own slot by one; one launch per layer.

``backplane_triton::ssm_scan``
    Prefill/extend sequences are scanned packed, as they lie in the batch: one
    row of ``num_prefill_tokens`` tokens, no padding and no loop over
    sequences. mamba-ssm's chunked (SSD) forward stages run over that row with
    ``seq_idx`` (the batch's per-token sequence ids), which masks every term
    that would cross a sequence boundary, so each sequence is scanned from a
    zero state wherever it starts inside a chunk; ``chunk_state_varlen`` then
    reads each sequence's final state off the chunk-start states (kept in
    float32) and its own tokens. The scan takes one initial state per row only,
    so initial states are added afterwards, exactly: the recurrence is linear in
    its initial state and Mamba2's ``A`` is one scalar per head, so a sequence
    starting from ``h0`` gets ``exp(dA[t]) * (C[t] . h0[h])`` added to token
    ``t``'s output and ``exp(dA[last]) * h0`` to its final state, with ``dA`` =
    ``A`` times the inclusive cumulative ``dt`` inside the sequence (a float64
    running sum over the packed tokens, so no sequence loses precision to the
    tokens before it). Two launches of ours finish the prefill:
    ``_prefill_out_kernel`` (per sequence, token block, head and ``head_dim``
    block: the initial-state term for sequences with ``has_initial_state``, in
    float32, then the z gate, written into ``out``) and
    ``_prefill_state_kernel`` (each final state plus its initial-state term,
    stored straight into the slot; a separate launch because the first one
    reads the initial states it overwrites). ``dt`` is turned into
    ``softplus(dt + dt_bias)`` here (the initial-state terms need it too) and
    handed to the scan as is.
    Decode sequences run ``selective_state_update`` directly on the state
    cache with the slot indices (``state_batch_indices``), in the tied layout
    (``A``, ``dt``, ``dt_bias``, ``D`` broadcast over ``head_dim`` with stride 0).

The chained rows of a verify graph (``batch.chained_rows``) launch the conv's
decode kernel once per chunk position, each row reading its source slot and
writing its destination slot; the scan copies each position's source states
into the destination slots and runs ``selective_state_update`` there
(:func:`~backplane.backends.torch.chained_rows.run_chain_in_place`).

mamba-ssm is loaded by :mod:`backplane.backends.triton._mamba_import` (its
package ``__init__`` is never executed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backplane.backends.torch.chained_rows import run_chain_in_place
from backplane.backends.torch.verify_states import record_conv_states, record_scan_states
from backplane.backends.triton import _mamba_import
from backplane.backends.triton._common import (
    dot_block,
    exact_fp32_dots,
    ieee_dot,
    next_pow2,
    sequence_blocks,
)
from backplane.core import compile_ahead
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.families import ConvLayerSpec, SSMBackend, SSMLayerSpec
from backplane.core.forward_context import get_forward_context
from backplane.core.launch import KernelLauncher, cdiv
from backplane.core.metadata import BatchMetadata

# -- causal conv kernels ---------------------------------------------------------------


@triton.jit
def _conv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    state_ptr,
    o_ptr,
    qsl_ptr,
    slots_ptr,
    has_init_ptr,
    stride_xt,
    stride_wc,
    stride_wk,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_ot,
    C,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Outputs of one token block and channel block of one sequence."""
    seq = tl.program_id(0)
    tb = tl.program_id(1)
    cb = tl.program_id(2)
    start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - start
    if tb * BLOCK_T < q_len:
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        has_init = tl.load(has_init_ptr + seq).to(tl.int32)
        offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        t_mask = offs_t < q_len
        c_mask = offs_c < C
        # Broadcast the scalar flag to a block (the interpreter rejects scalar-by-block masks).
        from_state_ok = (offs_t * 0 + has_init) != 0
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        for k in tl.static_range(K):
            rel = offs_t - (K - 1) + k  # position of the input tap relative to the first new token
            in_x = rel >= 0
            xv = tl.load(
                x_ptr + (start + rel).to(tl.int64)[:, None] * stride_xt + offs_c[None, :],
                mask=(t_mask & in_x)[:, None] & c_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            sv = tl.load(
                state_ptr + slot * stride_ss + offs_c[None, :] * stride_sc
                + (K - 1 + rel)[:, None] * stride_sk,
                mask=(t_mask & (rel < 0) & from_state_ok)[:, None] & c_mask[None, :],
                other=0.0,
            ).to(tl.float32)  # fmt: skip
            w = tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=c_mask, other=0.0)
            acc += (xv + sv) * w.to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(
            o_ptr + (start + offs_t).to(tl.int64)[:, None] * stride_ot + offs_c[None, :],
            acc.to(o_ptr.dtype.element_ty),
            mask=t_mask[:, None] & c_mask[None, :],
        )


@triton.jit
def _conv_state_kernel(
    x_ptr,
    state_ptr,
    qsl_ptr,
    slots_ptr,
    has_init_ptr,
    stride_xt,
    stride_ss,
    stride_sc,
    stride_sk,
    C,
    KM1: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Store the last ``K - 1`` inputs of one sequence (one channel block) into its slot."""
    seq = tl.program_id(0)
    cb = tl.program_id(1)
    start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - start
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    has_init = tl.load(has_init_ptr + seq).to(tl.int32)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    c_mask = offs_c < C
    k_mask = offs_k < KM1
    rel = q_len - KM1 + offs_k  # input position (relative to the chunk) that lands in state[k]
    in_x = rel >= 0
    from_state_ok = (offs_k * 0 + has_init) != 0
    base = state_ptr + slot * stride_ss + offs_c[:, None] * stride_sc
    xv = tl.load(
        x_ptr + (start + rel).to(tl.int64)[None, :] * stride_xt + offs_c[:, None],
        mask=c_mask[:, None] & (k_mask & in_x)[None, :],
        other=0.0,
    )
    sv = tl.load(
        base + (KM1 + rel)[None, :] * stride_sk,
        mask=c_mask[:, None] & (k_mask & (rel < 0) & from_state_ok)[None, :],
        other=0.0,
    )
    new = tl.where(in_x[None, :], xv.to(state_ptr.dtype.element_ty), sv)
    # Every thread must finish reading the old state before any thread overwrites it.
    tl.debug_barrier()
    tl.store(base + offs_k[None, :] * stride_sk, new, mask=c_mask[:, None] & k_mask[None, :])


@triton.jit
def _conv_decode_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    state_ptr,
    o_ptr,
    qsl_ptr,
    slots_ptr,
    has_init_ptr,
    stride_xt,
    stride_wc,
    stride_wk,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_ot,
    C,
    dst_ptr,
    pos_ptr,
    position,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CHAINED: tl.constexpr,
):
    """One new token of one sequence (one channel block): its output and the shifted state.

    The taps are summed in the order of ``_conv_kernel`` (bias, then the state's
    taps oldest first, then the new input), so a decode step gives the same bits
    as the general kernel; the state update that kernel leaves to
    ``_conv_state_kernel`` happens here, in the same launch. With ``CHAINED``
    (a verify graph's rows) the row reads slot ``slots[seq]``, writes the
    shifted window to slot ``dst[seq]``, and runs only when ``pos[seq] == position``.
    """
    seq = tl.program_id(0)
    cb = tl.program_id(1)
    start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) > start:
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        out_slot = slot
        c_lim = C
        if CHAINED:
            out_slot = tl.load(dst_ptr + seq).to(tl.int64)
            # a row at another position masks everything: no load, no store
            c_lim = C * (tl.load(pos_ptr + seq) == position).to(tl.int32)
        has_init = tl.load(has_init_ptr + seq).to(tl.int32)
        offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = offs_c < c_lim
        from_state = c_mask & ((offs_c * 0 + has_init) != 0)
        base = state_ptr + slot * stride_ss + offs_c * stride_sc
        out_base = state_ptr + out_slot * stride_ss + offs_c * stride_sc
        acc = tl.zeros([BLOCK_C], tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + start.to(tl.int64) * stride_xt + offs_c, mask=c_mask, other=0.0)
        for k in tl.static_range(K):
            w = tl.load(w_ptr + offs_c * stride_wc + k * stride_wk, mask=c_mask, other=0.0)
            if k < K - 1:
                tap = tl.load(base + k * stride_sk, mask=from_state, other=0.0).to(tl.float32)
            else:
                tap = xv.to(tl.float32)
            acc += tap * w.to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(
            o_ptr + start.to(tl.int64) * stride_ot + offs_c,
            acc.to(o_ptr.dtype.element_ty),
            mask=c_mask,
        )
        # Shift the window by one: every thread reads its channels' taps before
        # overwriting them (in place, or into the destination slot), the new input last.
        for k in tl.static_range(K - 2):
            nxt = tl.load(base + (k + 1) * stride_sk, mask=from_state, other=0.0)
            tl.store(out_base + k * stride_sk, nxt, mask=c_mask)
        tl.store(out_base + (K - 2) * stride_sk, xv.to(state_ptr.dtype.element_ty), mask=c_mask)


_CONV_DECODE = KernelLauncher(_conv_decode_kernel)


@cached_op(
    "backplane_triton::causal_conv",
    mutates_args=("conv_state", "out"),
    output_shape=SSMBackend.conv_output_shape,
)
def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    silu: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv1d per sequence, continuing from and updating the conv state.

    :param x: ``[T, C]`` (rows may be strided, channels contiguous).
    :param weight: ``[C, K]``.
    :param bias: ``[C]`` or ``None``.
    :param conv_state: ``[S, C, K - 1]``.
    :param silu: apply SiLU to the result.
    :param out: optional ``[T, C]`` buffer.
    :return: the output or the empty sentinel.
    """
    batch = get_forward_context().batch
    buf = output_buffer(out, x.shape, x.dtype, x.device)
    n = batch.num_seqs
    # speculative verification: per-position states, before the kernels overwrite the slots
    record_conv_states(x, conv_state)
    if n and batch.num_tokens:
        if x.stride(-1) != 1:
            x = x.contiguous()
        C, K = weight.shape
        max_q = int(batch.max_query_len)
        block_c = 64 if C >= 64 else next_pow2(C)
        # the two conv kernels take the same arguments
        args = (
            x, weight, bias if bias is not None else weight, conv_state, buf,
            batch.query_start_loc, batch.state_slots, batch.has_initial_state,
            x.stride(0), weight.stride(0), weight.stride(1),
            conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), buf.stride(0), C,
        )  # fmt: skip
        meta = dict(K=K, HAS_BIAS=bias is not None, SILU=bool(silu), BLOCK_C=block_c)
        chain = batch.chained_rows
        if chain is not None and K > 1:
            # a verify graph's rows: one launch per chunk position, each running the rows at
            # that position from their source slots into their destination slots
            grid = (n, cdiv(C, block_c))
            rows = (*args[:6], chain.src_slots, *args[7:])
            for j in range(chain.num_positions):
                _CONV_DECODE.launch(
                    grid, (*rows, chain.dst_slots, chain.position, j), x.device.index,
                    **meta, CHAINED=True,
                )  # fmt: skip
            return finish_output(out, buf, batch.num_tokens)
        if max_q == 1 and K > 1:
            # decode only: output and state update in one launch
            slots = batch.state_slots
            _CONV_DECODE.launch(
                (n, cdiv(C, block_c)), (*args, slots, slots, 0), x.device.index, **meta,
                CHAINED=False,
            )  # fmt: skip
            return finish_output(out, buf, batch.num_tokens)
        block_t = min(64, next_pow2(max_q))
        grid = (n, cdiv(max_q, block_t), cdiv(C, block_c))
        compile_ahead.launch(_conv_kernel, grid, *args, **meta, BLOCK_T=block_t)
        if K > 1:
            compile_ahead.launch(
                _conv_state_kernel, (n, cdiv(C, block_c)),
                x, conv_state, batch.query_start_loc, batch.state_slots, batch.has_initial_state,
                x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
                C, KM1=K - 1, BLOCK_K=next_pow2(K - 1), BLOCK_C=block_c,
            )  # fmt: skip
    return finish_output(out, buf, batch.num_tokens)


# -- selective scan -----------------------------------------------------------------------


@triton.jit
def _prefill_out_kernel(
    y_ptr,
    z_ptr,
    c_ptr,
    state_ptr,
    da_ptr,
    o_ptr,
    blocks_ptr,
    qsl_ptr,
    slots_ptr,
    has_init_ptr,
    stride_yt,
    stride_yh,
    stride_zt,
    stride_zh,
    stride_zp,
    stride_ct,
    stride_cg,
    stride_cn,
    stride_ss,
    stride_sh,
    stride_sp,
    stride_sn,
    stride_dat,
    stride_ot,
    stride_oh,
    stride_op,
    P,
    N,
    HEADS_PER_GROUP,
    HAS_Z: tl.constexpr,
    ANY_INIT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One token block x head x ``head_dim`` block of a prefill sequence's output.

    ``y`` is the scan from a zero state; a sequence with an initial state ``h0``
    adds ``exp(dA[t]) * (C[t] . h0)`` (``dA`` = ``A`` times the sequence's inclusive
    cumulative ``dt``), then the z gate applies to the sum. Program ``i`` serves
    block ``blocks[i, 1]`` of sequence ``blocks[i, 0]``.
    """
    seq = tl.load(blocks_ptr + 2 * tl.program_id(0))
    tb = tl.load(blocks_ptr + 2 * tl.program_id(0) + 1)
    num_pb = tl.cdiv(P, BLOCK_P)
    h = tl.program_id(1) // num_pb
    pb = tl.program_id(1) % num_pb
    start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - start
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    t_mask = offs_t < q_len
    p_mask = offs_p < P
    rows = (start + offs_t).to(tl.int64)
    mask = t_mask[:, None] & p_mask[None, :]
    acc = tl.load(
        y_ptr + rows[:, None] * stride_yt + h * stride_yh + offs_p[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    if ANY_INIT:
        if tl.load(has_init_ptr + seq).to(tl.int32) != 0:
            slot = tl.load(slots_ptr + seq).to(tl.int64)
            c_rows = c_ptr + rows[:, None] * stride_ct + (h // HEADS_PER_GROUP) * stride_cg
            h0_rows = state_ptr + slot * stride_ss + h * stride_sh + offs_p[:, None] * stride_sp
            from_h0 = tl.zeros([BLOCK_T, BLOCK_P], tl.float32)
            for n0 in range(0, N, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < N
                c = tl.load(
                    c_rows + offs_n[None, :] * stride_cn,
                    mask=t_mask[:, None] & n_mask[None, :],
                    other=0.0,
                ).to(tl.float32)
                h0 = tl.load(
                    h0_rows + offs_n[None, :] * stride_sn,
                    mask=p_mask[:, None] & n_mask[None, :],
                    other=0.0,
                )
                if IEEE:
                    from_h0 += tl.dot(c, tl.trans(h0), input_precision="ieee")
                else:
                    from_h0 += tl.dot(c, tl.trans(h0))
            da = tl.load(da_ptr + rows * stride_dat + h, mask=t_mask, other=0.0)
            acc += from_h0 * tl.exp(da)[:, None]
    if HAS_Z:
        zv = tl.load(
            z_ptr + rows[:, None] * stride_zt + h * stride_zh + offs_p[None, :] * stride_zp,
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        acc = acc * zv * tl.sigmoid(zv)
    tl.store(
        o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_p[None, :] * stride_op,
        acc.to(o_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _prefill_state_kernel(
    fin_ptr,
    state_ptr,
    da_ptr,
    qsl_ptr,
    slots_ptr,
    has_init_ptr,
    stride_fs,
    stride_fh,
    stride_fp,
    stride_ss,
    stride_sh,
    stride_sp,
    stride_sn,
    stride_dat,
    P,
    N,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Store one prefill sequence's final state (one head, one ``P x N`` block) in its slot.

    The scan's final state from zeros, plus ``exp(dA[last]) * h0`` with an initial state.
    Each element is read before it is overwritten by the same program.
    """
    seq = tl.program_id(0)
    h = tl.program_id(1)
    num_nb = tl.cdiv(N, BLOCK_N)
    pb = tl.program_id(2) // num_nb
    nb = tl.program_id(2) % num_nb
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    new = tl.load(
        fin_ptr + seq * stride_fs + h * stride_fh + offs_p[:, None] * stride_fp + offs_n[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    ptrs = state_ptr + slot * stride_ss + h * stride_sh + offs_p[:, None] * stride_sp
    ptrs += offs_n[None, :] * stride_sn
    if tl.load(has_init_ptr + seq).to(tl.int32) != 0:
        last = (tl.load(qsl_ptr + seq + 1) - 1).to(tl.int64)
        decay = tl.exp(tl.load(da_ptr + last * stride_dat + h))
        new += decay * tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, new.to(state_ptr.dtype.element_ty), mask=mask)


#: Tokens per program of the prefill epilogue (:func:`prefill_plan` tiles sequences by it).
PREFILL_BLOCK_T = 64


def prefill_plan(batch: BatchMetadata) -> dict | None:
    """Host facts and the token-block table of the packed prefill, shared by every scan layer.

    :param batch: the step's metadata.
    :return: ``None`` without prefill sequences, else ``{"seqs", "tokens",
        "any_init", "blocks", "pinned"}``: ``any_init`` says whether some prefill
        sequence has an initial state; ``blocks`` is the
        :func:`~backplane.backends.triton._common.sequence_blocks` table of the
        prefill sequences in blocks of :data:`PREFILL_BLOCK_T` tokens (``pinned``
        keeps its host source alive until the copy is done).
    """
    n = batch.num_prefill_seqs
    if n == 0:
        return None
    host = batch.host
    blocks, pinned = sequence_blocks(host.query_lens[:n], PREFILL_BLOCK_T, batch.device)
    return {
        "seqs": n,
        "tokens": batch.num_prefill_tokens,
        "any_init": bool(host.has_initial_state[:n].any()),
        "blocks": blocks,
        "pinned": pinned,
    }


def _ssm_prefill_blocks(P: int, N: int) -> tuple[int, int]:
    """``(BLOCK_P, BLOCK_N)`` of the prefill epilogue (``tl.dot`` needs 16 or more)."""
    return min(dot_block(P), 64), min(dot_block(N), 64)


def packed_prefill(
    info: dict[str, int],
    batch: BatchMetadata,
    x: torch.Tensor,
    dt_eff: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor | None,
    ssm_state: torch.Tensor,
    chunk_size: int,
    out: torch.Tensor,
) -> None:
    """The chunked scan of every prefill sequence, packed into one row (see the module docstring).

    :param info: :func:`prefill_plan` of the batch.
    :param batch: the step's metadata.
    :param x: ``[Tp, H, P]`` the prefill tokens' inputs.
    :param dt_eff: ``[Tp, H]`` float32 discretised time steps (bias and softplus applied).
    :param A: ``[H]`` float32.
    :param B: ``[Tp, G, N]``.
    :param C: ``[Tp, G, N]``.
    :param D: ``[H]``.
    :param z: ``[Tp, H, P]`` gate or ``None``.
    :param ssm_state: ``[S, H, P, N]`` float32; read (initial states) and written (final states).
    :param chunk_size: the SSD chunk length.
    :param out: ``[Tp, H, P]`` rows of the output buffer.
    """
    mamba = _mamba_import.load()
    n, tp = info["seqs"], info["tokens"]
    H, P = x.shape[1], x.shape[2]
    G, N = B.shape[1], B.shape[2]
    qsl = batch.query_start_loc[: n + 1]
    # The sequence index of every token (prefill tokens come first, so the batch's own
    # per-token ids are it): the scan restarts from zeros at each sequence's first token.
    seq_idx = batch.token_seq_ids[:tp].unsqueeze(0)
    # mamba-ssm's loads need contiguous state dims, and rows or channels of x contiguous.
    B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (B, C))
    if x.stride(-1) != 1 and x.stride(1) != 1:
        x = x.contiguous()
    x1, B1, C1 = x.unsqueeze(0), B.unsqueeze(0), C.unsqueeze(0)
    with exact_fp32_dots(x.dtype):
        dA_cs, dt_c = mamba.chunk_cumsum_fwd(
            dt_eff.unsqueeze(0), A, chunk_size, dt_limit=(float("-inf"), float("inf"))
        )
        states = mamba.chunk_state_fwd(B1, x1, dt_c, dA_cs, seq_idx=seq_idx, states_in_fp32=True)
        # float32 chunk-start states (mamba-ssm's combined forward keeps them in C's
        # dtype): the per-sequence final states below are built from them.
        states, _ = mamba.state_passing_fwd(
            states.flatten(-2),
            dA_cs[:, :, :, -1],
            seq_idx=seq_idx,
            chunk_size=chunk_size,
            out_dtype=torch.float32,
        )
        states = states.unflatten(-1, (P, N))
        cb = mamba.bmm_chunk_fwd(C1, B1, chunk_size, seq_idx=seq_idx, output_dtype=torch.float32)
        y, _ = mamba.chunk_scan_fwd(cb, x1, dt_c, dA_cs, C1, states, D=D, z=None, seq_idx=seq_idx)
        finals = mamba.chunk_state_varlen(B, x, dt_c[0], dA_cs[0], qsl, states[0])
    y = y[0]
    any_init = info["any_init"]
    if any_init:
        # A times the inclusive cumulative dt inside each sequence; the running sum over
        # the packed tokens is taken in float64 so that subtracting a sequence's start
        # loses nothing when many tokens precede it.
        cum = dt_eff.double().cumsum(0)
        starts = qsl[:n].long()
        before = cum[starts] - dt_eff[starts].double()
        da = ((cum - before[batch.token_seq_ids[:tp].long()]) * A.double()).float()
    else:
        da = dt_eff  # never read
    block_p, block_n = _ssm_prefill_blocks(P, N)
    num_pb = cdiv(P, block_p)
    zz = z if z is not None else y
    blocks = info["blocks"]
    compile_ahead.launch(
        _prefill_out_kernel, (blocks.shape[0], H * num_pb),
        y, zz, C, ssm_state, da, out, blocks, qsl, batch.state_slots, batch.has_initial_state,
        y.stride(0), y.stride(1), zz.stride(0), zz.stride(1), zz.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), ssm_state.stride(3),
        da.stride(0), out.stride(0), out.stride(1), out.stride(2),
        P, N, H // G,
        HAS_Z=z is not None, ANY_INIT=any_init, IEEE=ieee_dot(x.dtype),
        BLOCK_T=PREFILL_BLOCK_T, BLOCK_P=block_p, BLOCK_N=block_n,
    )  # fmt: skip
    # A second launch: the outputs above read the initial states this one overwrites.
    compile_ahead.launch(
        _prefill_state_kernel, (n, H, num_pb * cdiv(N, block_n)),
        finals, ssm_state, da, qsl, batch.state_slots, batch.has_initial_state,
        finals.stride(0), finals.stride(1), finals.stride(2),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), ssm_state.stride(3),
        da.stride(0), P, N, BLOCK_P=block_p, BLOCK_N=block_n,
    )  # fmt: skip


def _prefill_key(info: dict, args: tuple) -> tuple:
    """What the packed prefill's launches specialise on: the plan's host facts and the tensors.

    :param info: :func:`prefill_plan` of the batch.
    :param args: :func:`packed_prefill`'s arguments after ``info`` and the batch.
    :return: a key of :func:`~backplane.core.compile_ahead.ahead_of`.
    """
    return ("ssm_prefill", info["seqs"], info["tokens"], info["any_init"]) + (
        compile_ahead.signature(*args[2:])
    )


def compile_prefill_ahead(args: tuple) -> None:
    """Compile every kernel :func:`packed_prefill` launches with ``args``, side by side.

    See :func:`~backplane.core.compile_ahead.run_ahead`. Triton reads
    ``TRITON_F32_DEFAULT`` when it compiles, which is after the compile-only
    pass has returned: the exact float32 dots of a float32 model are set around
    the wait for the compiles too.

    :param args: :func:`packed_prefill`'s arguments.
    """
    with exact_fp32_dots(args[2].dtype):
        compile_ahead.run_ahead("the Triton SSM prefill", packed_prefill, *args)


@cached_op(
    "backplane_triton::ssm_scan",
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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mamba2 selective scan over a ragged batch (see the module docstring).

    :param x: ``[T, H, P]``.
    :param dt: ``[T, H]``.
    :param A: ``[H]``.
    :param B: ``[T, G, N]``.
    :param C: ``[T, G, N]``.
    :param D: ``[H]``.
    :param dt_bias: ``[H]``.
    :param z: ``[T, H, P]`` or ``None``.
    :param ssm_state: ``[S, H, P, N]`` float32.
    :param dt_softplus: ``dt = softplus(dt + dt_bias)`` (else ``dt + dt_bias``).
    :param chunk_size: the SSD chunk length for prefill.
    :param out: optional ``[T, H, P]`` buffer.
    :return: the output or the empty sentinel.
    """
    ctx = get_forward_context()
    batch = ctx.batch
    buf = output_buffer(out, x.shape, x.dtype, x.device)
    record_scan_states(x, dt, A, B, dt_bias, ssm_state, dt_softplus)
    mamba = _mamba_import.load()
    H, P = x.shape[1], x.shape[2]
    N = B.shape[-1]
    tp = batch.num_prefill_tokens
    plan = ctx.plan("ssm")
    info = plan.get("prefill") if isinstance(plan, dict) else prefill_plan(batch)
    if info is not None:
        dt_eff = dt[:tp].float() + dt_bias.float()
        if dt_softplus:
            dt_eff = torch.nn.functional.softplus(dt_eff)
        args = (
            info, batch, x[:tp], dt_eff, A.float(), B[:tp], C[:tp], D,
            z[:tp] if z is not None else None, ssm_state, int(chunk_size), buf[:tp],
        )  # fmt: skip
        # At start-up, the first prefill of each shape compiles every kernel (and
        # every autotuned configuration) it needs side by side before it runs.
        if compile_ahead.ahead_of(lambda: _prefill_key(info, args)):
            compile_prefill_ahead(args)
        packed_prefill(*args)
    nd = batch.num_decode_seqs
    if nd:
        a, b = tp, batch.num_tokens
        np_ = batch.num_prefill_seqs

        def update(slots: torch.Tensor) -> torch.Tensor:
            return mamba.selective_state_update(
                ssm_state,
                x[a:b],
                dt[a:b].unsqueeze(-1).expand(nd, H, P),
                A.float()[:, None, None].expand(H, P, N),
                B[a:b],
                C[a:b],
                D=D[:, None].expand(H, P),
                z=z[a:b] if z is not None else None,
                dt_bias=dt_bias[:, None].expand(H, P),
                dt_softplus=bool(dt_softplus),
                state_batch_indices=slots,
            )

        if batch.chained_rows is not None:
            # a verify graph's rows (all decodes): the update on each position's destinations
            buf[a:b].copy_(run_chain_in_place((ssm_state,), batch.chained_rows, b, update))
        else:
            buf[a:b].copy_(update(batch.state_slots[np_ : np_ + nd].long()))
    return finish_output(out, buf, batch.num_tokens)


class TritonSSMBackend(SSMBackend):
    """Mamba2 with our Triton causal conv and mamba-ssm's Triton scan kernels."""

    name = "triton"
    chains_rows = True

    def plan(self, batch: BatchMetadata) -> dict | None:
        """Read the packed prefill's host facts once per step (shared by every scan layer).

        :param batch: the step's metadata.
        :return: the facts, or ``None`` for a decode graph (nothing to plan: it has
            no prefill, and its replays read everything on the device).
        """
        if batch.mode.is_decode_graph:
            return None
        return {"prefill": prefill_plan(batch)}

    def conv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        layer: ConvLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal conv with state; see :meth:`SSMBackend.conv`."""
        if layer.activation not in ("silu", ""):
            raise ValueError(f"unsupported conv activation {layer.activation!r} (silu or none)")
        return causal_conv(x, weight, bias, conv_state, layer.activation == "silu", out)

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
        """Selective scan; see :meth:`SSMBackend.scan`."""
        return ssm_scan(
            x, dt, A, B, C, D, dt_bias, z, ssm_state,
            bool(layer.dt_softplus), int(layer.chunk_size), out,
        )  # fmt: skip

    def dynamic_ops(self) -> tuple:
        """Both ops run eagerly between captured graph segments."""
        return (
            torch.ops.backplane_triton.causal_conv.default,
            torch.ops.backplane_triton.ssm_scan.default,
        )
