"""Mamba2 on Triton: our causal-conv kernels, mamba-ssm's scan kernels.

Two cached ops:

``backplane_triton::causal_conv`` (ours)
    ``_conv_kernel`` computes every output token in parallel, one program per
    (sequence, token block, channel block): the ``kernel_size - 1`` inputs
    before a sequence's first new token come from its conv-state slot (when
    ``has_initial_state``, else zeros). ``_conv_state_kernel`` then stores the
    last ``kernel_size - 1`` inputs of each sequence (new tokens, topped up from
    the old state for short chunks) back into the slot. Two launches, so that
    no program reads a state another program already overwrote.

``backplane_triton::ssm_scan``
    Prefill/extend sequences run ``mamba_chunk_scan_combined``'s forward (the
    chunked SSD scan). That function takes one initial state per *batch row*
    only (packed sequences with ``seq_idx`` cannot start from their own
    states), so the prefill sequences are laid out as rows of a padded batch
    ``[num_prefill_seqs, max_prefill_len]`` with per-row initial states
    gathered from the slots (zeros without ``has_initial_state``). ``dt`` is
    turned into ``softplus(dt + dt_bias)`` here and padded with zeros, so a
    padding token leaves the state exactly unchanged (``exp(0 * A) = 1`` and
    ``0 * B x = 0``): the scan's final states are the states after each
    sequence's last real token, and are scattered back to the slots. The cost
    is padding work when prefill lengths are very uneven.
    Decode sequences run ``selective_state_update`` directly on the state
    cache with the slot indices (``state_batch_indices``), in the tied layout
    (``A``, ``dt``, ``dt_bias``, ``D`` broadcast over ``head_dim`` with stride 0).

mamba-ssm is loaded by :mod:`backplane.backends.triton._mamba_import` (its
package ``__init__`` is never executed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backplane.backends.triton import _mamba_import
from backplane.backends.triton._common import exact_fp32_dots, next_pow2
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.families import ConvLayerSpec, SSMBackend, SSMLayerSpec
from backplane.core.forward_context import get_forward_context
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
    if n and batch.num_tokens:
        if x.stride(-1) != 1:
            x = x.contiguous()
        C, K = weight.shape
        max_q = int(batch.max_query_len)
        block_t = min(64, next_pow2(max_q))
        block_c = 64 if C >= 64 else next_pow2(C)
        grid = (n, triton.cdiv(max_q, block_t), triton.cdiv(C, block_c))
        _conv_kernel[grid](
            x, weight, bias if bias is not None else weight, conv_state, buf,
            batch.query_start_loc, batch.state_slots, batch.has_initial_state,
            x.stride(0), weight.stride(0), weight.stride(1),
            conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), buf.stride(0),
            C, K=K, HAS_BIAS=bias is not None, SILU=bool(silu), BLOCK_T=block_t, BLOCK_C=block_c,
        )  # fmt: skip
        if K > 1:
            _conv_state_kernel[(n, triton.cdiv(C, block_c))](
                x, conv_state, batch.query_start_loc, batch.state_slots, batch.has_initial_state,
                x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
                C, KM1=K - 1, BLOCK_K=next_pow2(K - 1), BLOCK_C=block_c,
            )  # fmt: skip
    return finish_output(out, buf, batch.num_tokens)


# -- selective scan -----------------------------------------------------------------------


def prefill_layout(batch: BatchMetadata) -> dict[str, torch.Tensor | int] | None:
    """Device indices that lay the prefill tokens out as a padded ``[seqs, max_len]`` batch.

    :param batch: the step's metadata.
    :return: ``None`` without prefill sequences, else ``{"rows", "max_len", "pad_index",
        "slots", "has_init"}``; ``pad_index[t]`` is the flat padded position of
        prefill token ``t``.
    """
    n = batch.num_prefill_seqs
    if n == 0:
        return None
    tp = batch.num_prefill_tokens
    max_len = int(batch.host.query_lens[:n].max())
    seq_of = batch.token_seq_ids[:tp].long()
    local = torch.arange(tp, device=batch.device) - batch.query_start_loc.long()[seq_of]
    return {
        "rows": n,
        "max_len": max_len,
        "pad_index": seq_of * max_len + local,
        "slots": batch.state_slots[:n].long(),
        "has_init": batch.has_initial_state[:n],
    }


def _pad_rows(t: torch.Tensor, layout: dict, rows_shape: tuple[int, int]) -> torch.Tensor:
    """Scatter the prefill rows of ``t`` into a zero-filled padded batch ``[rows, max_len, ...]``."""
    n, max_len = rows_shape
    tp = layout["pad_index"].shape[0]
    padded = t.new_zeros((n * max_len, *t.shape[1:]))
    padded.index_copy_(0, layout["pad_index"], t[:tp])
    return padded.view(n, max_len, *t.shape[1:])


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
    mamba = _mamba_import.load()
    H, P = x.shape[1], x.shape[2]
    N = B.shape[-1]
    tp = batch.num_prefill_tokens
    plan = ctx.plan("ssm")
    layout = plan.get("prefill") if isinstance(plan, dict) else prefill_layout(batch)
    if layout is not None:
        rows = (layout["rows"], layout["max_len"])
        dt_eff = dt[:tp].float() + dt_bias.float()
        if dt_softplus:
            dt_eff = torch.nn.functional.softplus(dt_eff)
        slots = layout["slots"]
        init = torch.where(layout["has_init"][:, None, None, None], ssm_state[slots], 0.0).float()
        with exact_fp32_dots(x.dtype):
            y, _, _, _, _, final = mamba.mamba_chunk_scan_combined_fwd(
                _pad_rows(x, layout, rows),
                _pad_rows(dt_eff, layout, rows),
                A.float(),
                _pad_rows(B, layout, rows),
                _pad_rows(C, layout, rows),
                int(chunk_size),
                D=D,
                z=_pad_rows(z, layout, rows) if z is not None else None,
                dt_bias=None,
                initial_states=init,
                dt_softplus=False,
                dt_limit=(float("-inf"), float("inf")),
            )
        torch.index_select(y.reshape(-1, H, P), 0, layout["pad_index"], out=buf[:tp])
        ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))
    nd = batch.num_decode_seqs
    if nd:
        a, b = tp, batch.num_tokens
        np_ = batch.num_prefill_seqs
        slots = batch.state_slots[np_ : np_ + nd].long()
        y = mamba.selective_state_update(
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
        buf[a:b].copy_(y)
    return finish_output(out, buf, batch.num_tokens)


class TritonSSMBackend(SSMBackend):
    """Mamba2 with our Triton causal conv and mamba-ssm's Triton scan kernels."""

    name = "triton"

    def plan(self, batch: BatchMetadata) -> dict:
        """Build the padded prefill layout once per step (shared by every scan layer)."""
        return {"prefill": prefill_layout(batch)}

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
        return torch.ops.backplane_triton.causal_conv(
            x, weight, bias, conv_state, layer.activation == "silu", out
        )

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
        return torch.ops.backplane_triton.ssm_scan(
            x, dt, A, B, C, D, dt_bias, z, ssm_state,
            bool(layer.dt_softplus), int(layer.chunk_size), out,
        )  # fmt: skip

    def dynamic_ops(self) -> tuple:
        """Both ops run eagerly between captured graph segments."""
        return (
            torch.ops.backplane_triton.causal_conv.default,
            torch.ops.backplane_triton.ssm_scan.default,
        )
