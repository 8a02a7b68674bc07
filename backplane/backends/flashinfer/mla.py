"""DeepSeek MLA on FlashInfer's ``BatchMLAPagedAttentionWrapper``.

The latent cache ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`` is
handed to FlashInfer as two strided views (``ckv = cache[..., :512]``,
``kpe = cache[..., 512:]``); FlashInfer's kernels take the page and token
strides, so nothing is copied. ``append_paged_mla_kv_cache`` writes this step's
latent and rotary key into those views.

The wrapper computes attention in the absorbed form for prefill, extend and
decode alike (one causal plan for the whole batch): the query is
``q_nope @ w_uk`` per head (``[T, H, 512]``), scores are
``(q_lat . ckv + q_pe . kpe) * scale`` and the latent output is mapped back with
``w_uv``, written straight into ``out``. FlashInfer builds these kernels for
``kv_lora_rank == 512`` and ``qk_rope_head_dim == 64`` only; other shapes are
unavailable with that reason.

Planning (once per step, host arrays only) and CUDA-graph decode buckets work as
for attention: a step whose ``batch.mode`` is the decode graph of a bucket is
planned onto that bucket's fixed buffers and its ``use_cuda_graph=True``
wrapper (re-planned before every replay);
:meth:`FlashInferMLABackend.prepare_capture` sizes and fixes the buffers before
the bucket is captured. Layer configurations are registered with
:meth:`FlashInferMLABackend.register_layer` or on the first step that runs them;
``cache_spec`` only checks the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from backplane.backends.flashinfer import _common
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.errors import BackendUnavailableError
from backplane.core.families import MLABackend, MLALayerSpec
from backplane.core.forward_context import get_forward_context
from backplane.core.layouts import TensorSpec
from backplane.core.metadata import BatchMetadata, StepMode

KV_LORA_RANK = 512
ROPE_DIM = 64
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _MLAKey:
    num_heads: int
    scale: float
    dtype: torch.dtype


@dataclass
class MLAStepPlan:
    """What :meth:`FlashInferMLABackend.plan` made for one step."""

    batch: BatchMetadata
    positions: torch.Tensor | None = None
    wrappers: dict[_MLAKey, Any] = field(default_factory=dict)
    graph: _common.GraphBucketBuffers | None = None
    graph_arrays: dict[str, np.ndarray] | None = None


class FlashInferMLABackend(MLABackend):
    """Multi-head latent attention (kv_lora_rank 512, rope 64) on FlashInfer."""

    name: ClassVar[str] = "flashinfer"

    def __init__(self) -> None:
        self.handle = _common.register_backend(self)
        self._keys: set[_MLAKey] = set()
        self._device: torch.device | None = None
        self._wrappers: dict[_MLAKey, Any] = {}
        self._graph_buffers: dict[int, _common.GraphBucketBuffers] = {}
        self._graph_wrappers: dict[tuple[int, _MLAKey], Any] = {}

    @staticmethod
    def supports(layer: MLALayerSpec, dtype: torch.dtype) -> tuple[bool, str]:
        """Say whether FlashInfer's MLA kernels can run ``layer`` in ``dtype``."""
        if layer.kv_lora_rank != KV_LORA_RANK or layer.qk_rope_head_dim != ROPE_DIM:
            return False, (
                f"FlashInfer MLA supports kv_lora_rank {KV_LORA_RANK} with qk_rope_head_dim "
                f"{ROPE_DIM} only (got {layer.kv_lora_rank} + {layer.qk_rope_head_dim})"
            )
        if dtype not in SUPPORTED_DTYPES:
            return False, f"FlashInfer MLA runs in float16/bfloat16, not {dtype}"
        return True, ""

    def _check(self, layer: MLALayerSpec, dtype: torch.dtype) -> None:
        ok, reason = self.supports(layer, dtype)
        if not ok:
            raise _common.UnsupportedLayerError(
                f"mla backend 'flashinfer' cannot run layer {layer.layer_id}: {reason}; "
                "select backends.mla: triton or torch",
                family="mla",
                backend="flashinfer",
            )

    def register_layer(self, layer: MLALayerSpec, dtype: torch.dtype) -> None:
        """Make :meth:`plan` prepare ``layer``'s configuration every step."""
        self._check(layer, dtype)
        self._keys.add(_MLAKey(layer.num_heads, float(layer.scale), dtype))

    def cache_spec(
        self, layer: MLALayerSpec, *, num_pages: int, page_size: int, dtype: torch.dtype
    ) -> dict[str, TensorSpec]:
        """Return the shared latent layout, after checking FlashInfer can run ``layer``."""
        self._check(layer, dtype)
        return super().cache_spec(layer, num_pages=num_pages, page_size=page_size, dtype=dtype)

    def dynamic_ops(self) -> tuple[Any, ...]:
        """The MLA op."""
        return (torch.ops.backplane_flashinfer.mla.default,)

    def _ensure_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise BackendUnavailableError(
                f"the FlashInfer MLA backend needs a CUDA batch, got {device}"
            )
        if self._device is None:
            self._device = device
            _common.workspace(device)

    @_common.outside_inference_mode
    def prepare_capture(self, mode: StepMode, batch: BatchMetadata) -> None:
        """Size and fix the buffers of a decode-graph bucket before it is captured.

        :param mode: the bucket about to be captured (piecewise buckets need nothing).
        :param batch: the capture batch, the largest of its bucket.
        """
        if not mode.is_decode_graph:
            return
        self._ensure_device(batch.device)
        _common.fix_bucket(
            self._graph_buffers, self._graph_wrappers, batch, mode.bucket, self._device
        )

    def graph_buckets(self) -> list[int]:
        """The decode buckets that have CUDA-graph buffers."""
        return sorted(self._graph_buffers)

    def _wrapper(self, key: _MLAKey, bucket: int | None) -> Any:
        import flashinfer

        if bucket is None:
            w = self._wrappers.get(key)
            if w is None:
                w = flashinfer.mla.BatchMLAPagedAttentionWrapper(_common.workspace(self._device))
                self._wrappers[key] = w
            return w
        w = self._graph_wrappers.get((bucket, key))
        if w is None:
            _common.require_not_capturing("MLA (creating a CUDA-graph wrapper)")
            buf = self._graph_buffers[bucket]
            w = flashinfer.mla.BatchMLAPagedAttentionWrapper(
                _common.workspace(self._device),
                use_cuda_graph=True,
                qo_indptr=buf.qo_indptr,
                kv_indptr=buf.kv_indptr,
                kv_indices=buf.kv_indices,
                kv_len_arr=buf.kv_lens,
            )
            self._graph_wrappers[(bucket, key)] = w
        return w

    @_common.outside_inference_mode
    def plan(self, batch: BatchMetadata) -> MLAStepPlan:
        """Plan every known MLA configuration for ``batch`` from its host arrays.

        :param batch: the step's metadata; a decode-graph ``batch.mode`` selects
            that bucket's CUDA-graph wrapper, any other mode the eager one.
        :return: the step plan ops read from the forward context.
        """
        self._ensure_device(batch.device)
        step = MLAStepPlan(batch=batch)
        bucket = _common.graph_bucket(batch)
        if bucket is not None:
            buf = _common.ensure_bucket(
                self._graph_buffers, self._graph_wrappers, batch, bucket, self._device
            )
            step.graph = buf
            step.graph_arrays = buf.host_arrays(batch)
            buf.fill(step.graph_arrays)
        else:
            step.positions = _common.to_device(
                batch.host.positions[: batch.num_tokens], batch.device
            )
        for key in self._keys:
            self._plan_key(step, key)
        return step

    @_common.outside_inference_mode
    def _plan_key(self, step: MLAStepPlan, key: _MLAKey) -> None:
        batch = step.batch
        if step.graph is not None:
            a = step.graph_arrays
            b = step.graph.bucket
            qo = np.arange(b + 1, dtype=np.int32)
            indptr, indices, lens = a["kv_indptr"], a["kv_indices"], a["kv_lens"]
        else:
            if not batch.num_seqs:
                return
            h = batch.host
            n = batch.num_seqs
            qo = h.query_start_loc[: n + 1]
            indptr = h.page_indptr[: n + 1]
            indices = h.page_indices[: int(h.page_indptr[n])]
            lens = h.seq_lens[:n]
            b = None
        w = self._wrapper(key, b)
        _common.plan_wrapper(
            w,
            _common.host_tensor(qo),
            _common.host_tensor(indptr),
            _common.host_tensor(indices),
            _common.host_tensor(lens),
            key.num_heads,
            KV_LORA_RANK,
            ROPE_DIM,
            batch.page_size,
            True,  # causal: extend queries sit at the end of their sequence
            key.scale,
            key.dtype,
            key.dtype,
        )
        step.wrappers[key] = w

    def _step_plan(self, key: _MLAKey) -> MLAStepPlan:
        ctx = get_forward_context()
        step = ctx.plan("mla")
        if not isinstance(step, MLAStepPlan) or step.batch is not ctx.batch:
            _common.require_not_capturing("MLA")
            step = self.plan(ctx.batch)
            ctx.plans["mla"] = step
        self._keys.add(key)
        if key not in step.wrappers and ctx.batch.num_seqs:
            _common.require_not_capturing("MLA")
            self._plan_key(step, key)
        return step

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        layer: MLALayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append the latent and rotary key to the cache and attend (family contract)."""
        self._check(layer, q_nope.dtype)
        return _mla_op(
            q_nope,
            q_pe,
            kv_c,
            k_pe,
            latent_cache,
            w_uk,
            w_uv,
            self.handle,
            layer.num_heads,
            float(layer.scale),
            out,
        )


# ``out`` has no schema default (callers always pass it): torch 2.11 mishandles a
# trailing optional mutable argument that the dispatcher dropped as a default.
@cached_op(
    "backplane_flashinfer::mla",
    mutates_args=("latent_cache", "out"),
    output_shape=MLABackend.output_shape,
)
def _mla_op(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    handle: int,
    num_heads: int,
    scale: float,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """FlashInfer MLA for the step in the forward context (out-buffer contract)."""
    import flashinfer

    _common.require_cuda(q_nope, "MLA")
    backend: FlashInferMLABackend = _common.backend_for(handle)
    key = _MLAKey(num_heads, scale, q_nope.dtype)
    step = backend._step_plan(key)
    _common.require_graph_plan_when_capturing(step.graph, "MLA")
    batch = step.batch
    t = q_nope.shape[0]
    buf = output_buffer(out, (t, num_heads, w_uv.shape[1]), q_nope.dtype, q_nope.device)
    ckv = latent_cache[..., :KV_LORA_RANK]
    kpe = latent_cache[..., KV_LORA_RANK:]
    if step.graph is not None:
        g = step.graph
        rows = g.bucket
        flashinfer.page.append_paged_mla_kv_cache(
            kv_c[:rows],
            k_pe[:rows],
            g.seq_ids,
            g.positions,
            ckv,
            kpe,
            g.kv_indices,
            g.kv_indptr,
            g.kv_last_page_len,
        )
    else:
        rows = batch.num_tokens
        if rows:
            flashinfer.page.append_paged_mla_kv_cache(
                kv_c[:rows],
                k_pe[:rows],
                batch.token_seq_ids[:rows],
                step.positions,
                ckv,
                kpe,
                batch.page_indices,
                batch.page_indptr,
                batch.last_page_lens,
            )
    if rows:
        # Absorb w_uk into the query: [H, rows, Dn] @ [H, Dn, L] -> [H, rows, L],
        # viewed as [rows, H, L] (FlashInfer takes the token and head strides).
        q_lat = torch.empty(
            (rows, num_heads, KV_LORA_RANK), dtype=q_nope.dtype, device=q_nope.device
        )
        torch.bmm(q_nope[:rows].transpose(0, 1), w_uk, out=q_lat.transpose(0, 1))
        qp = q_pe[:rows] if q_pe.stride(-1) == 1 else q_pe[:rows].contiguous()
        o_lat = torch.empty(
            (rows, num_heads, KV_LORA_RANK), dtype=q_nope.dtype, device=q_nope.device
        )
        step.wrappers[key].run(q_lat, qp, ckv, kpe, out=o_lat)
        # Map the latent output back per head, straight into the out rows.
        torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=buf[:rows].transpose(0, 1))
    if step.graph is not None:
        rows_b = step.graph.bucket
        buf[:rows_b].masked_fill_(step.graph.pad_mask, 0)
        if rows_b < t:
            buf[rows_b:].zero_()
        return buf.new_empty(0) if out is not None else buf
    return finish_output(out, buf, rows)
