"""Gated delta rule (Qwen3-Next GDN) with FlashInfer's ``chunk_gated_delta_rule`` for prefill.

What runs where
    * prefill/extend sequences: ``flashinfer.chunk_gated_delta_rule`` (built for sm90
      only; key and value head dim 128; value heads a multiple of key heads). The
      initial states are gathered from the state cache (zeros where
      ``has_initial_state`` is false), the final states scattered back; FlashInfer
      keeps states k-last (``[V, K]``), the cache keeps ``[K, V]``, so both are
      transposed on the way. FlashInfer's kernel ignores
      ``use_qk_l2norm_in_kernel``, so ``q``/``k`` are L2-normalised here first.
    * decode sequences (one token on cached state): fla's
      ``fused_recurrent_gated_delta_rule`` when fla is installed, otherwise a
      vectorised torch step (:attr:`FlashInferDeltaBackend.decode_impl` says which;
      ``BACKPLANE_FLASHINFER_DELTA_DECODE=torch`` forces torch).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from backplane.backends.flashinfer import _common
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.families import DeltaBackend, DeltaLayerSpec
from backplane.core.forward_context import get_forward_context
from backplane.core.layouts import TensorSpec
from backplane.core.metadata import BatchMetadata

HEAD_DIM = 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
DECODE_ENV = "BACKPLANE_FLASHINFER_DELTA_DECODE"
_L2_EPS = 1e-6

_DECODE_IMPLS = {"fla": 0, "torch": 1}


def _default_decode_impl() -> str:
    forced = os.environ.get(DECODE_ENV, "").strip().lower()
    if forced in _DECODE_IMPLS:
        return forced
    try:
        found = importlib.util.find_spec("fla") is not None
    except (ImportError, ValueError):
        found = False
    return "fla" if found else "torch"


@dataclass
class DeltaStepPlan:
    """Device index tensors for one step (made once, shared by all layers)."""

    batch: BatchMetadata
    cu_seqlens: torch.Tensor | None = None  # int64 [num_prefill_seqs + 1]


class FlashInferDeltaBackend(DeltaBackend):
    """GDN prefill on FlashInfer (Hopper, head dim 128); decode on fla or torch.

    :param decode_impl: ``"fla"`` or ``"torch"`` (default: fla when installed).
    """

    name: ClassVar[str] = "flashinfer"

    def __init__(self, decode_impl: str | None = None) -> None:
        self.handle = _common.register_backend(self)
        self.decode_impl = decode_impl or _default_decode_impl()
        if self.decode_impl not in _DECODE_IMPLS:
            raise ValueError(f"decode_impl must be one of {sorted(_DECODE_IMPLS)}")

    @staticmethod
    def supports(layer: DeltaLayerSpec, dtype: torch.dtype) -> tuple[bool, str]:
        """Say whether FlashInfer's GDN prefill kernel can run ``layer`` in ``dtype``."""
        if layer.k_head_dim != HEAD_DIM or layer.v_head_dim != HEAD_DIM:
            return False, (
                f"FlashInfer chunk_gated_delta_rule needs k and v head dim {HEAD_DIM} "
                f"(got {layer.k_head_dim}, {layer.v_head_dim})"
            )
        if layer.num_v_heads < layer.num_k_heads or layer.num_v_heads % layer.num_k_heads:
            return False, "num_v_heads must be a multiple of num_k_heads"
        if dtype not in SUPPORTED_DTYPES:
            return False, f"FlashInfer chunk_gated_delta_rule runs in float16/bfloat16, not {dtype}"
        return True, ""

    def _check(self, layer: DeltaLayerSpec, dtype: torch.dtype) -> None:
        ok, reason = self.supports(layer, dtype)
        if not ok:
            raise _common.UnsupportedLayerError(
                f"delta backend 'flashinfer' cannot run layer {layer.layer_id}: {reason}; "
                "select backends.delta: triton or torch",
                family="delta",
                backend="flashinfer",
            )

    def cache_spec(
        self, layer: DeltaLayerSpec, *, num_slots: int, dtype: torch.dtype
    ) -> dict[str, TensorSpec]:
        """The shared float32 delta-state layout, after checking FlashInfer can run ``layer``."""
        self._check(layer, dtype)
        return super().cache_spec(layer, num_slots=num_slots, dtype=dtype)

    def plan(self, batch: BatchMetadata) -> DeltaStepPlan:
        """Copy the prefill ``cu_seqlens`` (int64) to the device once for all layers."""
        step = DeltaStepPlan(batch=batch)
        np_ = batch.num_prefill_seqs
        if np_:
            step.cu_seqlens = _common.to_device(
                batch.host.query_start_loc[: np_ + 1], batch.device, torch.int64
            )
        return step

    def _step_plan(self) -> DeltaStepPlan:
        ctx = get_forward_context()
        step = ctx.plan("delta")
        if not isinstance(step, DeltaStepPlan) or step.batch is not ctx.batch:
            step = self.plan(ctx.batch)
            ctx.plans["delta"] = step
        return step

    def dynamic_ops(self) -> tuple[Any, ...]:
        """The delta-rule op."""
        return (torch.ops.backplane_flashinfer.delta.default,)

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
        """The gated delta rule per sequence (family contract)."""
        self._check(layer, q.dtype)
        return _delta_op(
            q,
            k,
            v,
            g,
            beta,
            state,
            self.handle,
            float(layer.q_scale),
            layer.use_qk_l2norm,
            _DECODE_IMPLS[self.decode_impl],
            out,
        )


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + _L2_EPS)).to(x.dtype)


def _decode_torch(q, k, v, g, beta, state, slots, scale, l2norm, out) -> None:
    """One recurrent step per sequence, batched over sequences and heads (float32)."""
    hv, hk = v.shape[1], q.shape[1]
    qf, kf = q.float(), k.float()
    if l2norm:
        qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + _L2_EPS)
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + _L2_EPS)
    if hv != hk:
        qf = qf.repeat_interleave(hv // hk, dim=1)
        kf = kf.repeat_interleave(hv // hk, dim=1)
    s = state.index_select(0, slots)  # [n, Hv, K, V]
    s.mul_(g.float().exp()[..., None, None])
    kv = torch.einsum("nhk,nhkv->nhv", kf, s)
    delta = (v.float() - kv) * beta.float()[..., None]
    s.add_(kf[..., :, None] * delta[..., None, :])
    out.copy_(torch.einsum("nhk,nhkv->nhv", qf * scale, s))
    state.index_copy_(0, slots, s)


def _decode_fla(q, k, v, g, beta, state, slots, scale, l2norm, out) -> None:
    """One step per sequence with fla's fused recurrent kernel (states gathered/scattered)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    h0 = state.index_select(0, slots)
    o, ht = fused_recurrent_gated_delta_rule(
        q.unsqueeze(1).contiguous(),
        k.unsqueeze(1).contiguous(),
        v.unsqueeze(1).contiguous(),
        g=g.float().unsqueeze(1).contiguous(),
        beta=beta.float().unsqueeze(1).contiguous(),
        scale=scale,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm,
    )
    out.copy_(o.squeeze(1))
    state.index_copy_(0, slots, ht.to(state.dtype))


# ``out`` has no schema default (callers always pass it): torch 2.11 mishandles a
# trailing optional mutable argument that the dispatcher dropped as a default.
@cached_op(
    "backplane_flashinfer::delta",
    mutates_args=("state", "out"),
    output_shape=DeltaBackend.output_shape,
)
def _delta_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    handle: int,
    scale: float,
    use_qk_l2norm: bool,
    decode_impl: int,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """FlashInfer GDN prefill + fla/torch decode for the step in context (out-buffer contract)."""
    backend: FlashInferDeltaBackend = _common.backend_for(handle)
    step = backend._step_plan()
    batch = step.batch
    shape, dtype = DeltaBackend.output_shape(q, k, v)
    buf = output_buffer(out, shape, dtype, q.device)
    npt = batch.num_prefill_tokens
    n = batch.num_tokens
    np_ = batch.num_prefill_seqs
    if npt:
        _common.require_cuda(q, "delta (prefill)")
        from flashinfer import chunk_gated_delta_rule

        slots = batch.state_slots[:np_].long()
        h0 = state.index_select(0, slots)
        h0 = torch.where(batch.has_initial_state[:np_].view(-1, 1, 1, 1), h0, 0.0)
        qp, kp = q[:npt], k[:npt]
        if use_qk_l2norm:
            qp, kp = _l2norm(qp), _l2norm(kp)
        _, final = chunk_gated_delta_rule(
            qp.contiguous(),
            kp.contiguous(),
            v[:npt].contiguous(),
            g=g[:npt].float().exp().contiguous(),
            beta=beta[:npt].float().contiguous(),
            scale=scale,
            initial_state=h0.transpose(-1, -2).contiguous(),
            output_final_state=True,
            cu_seqlens=step.cu_seqlens,
            output=buf[:npt],
        )
        state.index_copy_(0, slots, final.transpose(-1, -2))
    if n > npt:
        slots = batch.state_slots[np_ : batch.num_seqs].long()
        impl = _decode_fla if decode_impl == _DECODE_IMPLS["fla"] else _decode_torch
        impl(
            q[npt:n],
            k[npt:n],
            v[npt:n],
            g[npt:n],
            beta[npt:n],
            state,
            slots,
            scale,
            use_qk_l2norm,
            buf[npt:n],
        )
    return finish_output(out, buf, n)
