"""Paged attention on FlashInfer's prefill and decode wrappers.

Layout: backplane's paged KV cache ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
is FlashInfer's single-tensor ``NHD`` layout with K and V in dim 1, so the cache
is handed to FlashInfer as is.

Per step
    :meth:`FlashInferAttentionBackend.plan` runs once, outside any CUDA graph,
    from the host arrays of the batch only (``batch.host``: no device -> host
    copy). For every distinct layer configuration (heads, KV heads, head dim,
    sliding window, scale, dtype) it plans a ``BatchPrefillWithPagedKVCacheWrapper``
    over the prefill/extend sequences and a ``BatchDecodeWithPagedKVCacheWrapper``
    over the decode sequences. Every layer's op then only runs kernels:
    ``append_paged_kv_cache`` for this step's keys/values, then ``run(..., out=)``
    of the two wrappers, writing straight into the caller's ``out`` rows.

CUDA graphs (decode)
    A captured graph must find its wrapper's index buffers at the same
    addresses on every replay. The model runner decides how each step runs and
    says so in ``batch.mode``: a step whose mode is the decode graph of bucket
    ``B`` is planned onto that bucket's fixed buffers (page indptr, page
    indices, last-page lengths, positions, a padding mask) and, per layer
    configuration, a decode wrapper built with ``use_cuda_graph=True`` on them;
    ``plan`` pads the batch to ``B`` sequences (padding sequences point at the
    reserved scratch page 0) and re-plans that bucket's wrappers, rewriting the
    fixed buffers -- before warmup, capture and *every* replay (``plan_step``
    does this once per step). Before capturing bucket ``B`` the graph runner
    calls :meth:`FlashInferAttentionBackend.prepare_capture` with the capture
    batch, which sizes the bucket's buffers for the largest step of the bucket
    and fixes them. Every other step (eager, piecewise) uses the eager
    wrappers. The same padded path runs eagerly, so a decode-graph step gives
    identical results with or without a graph.

FP8 KV cache
    A ``float8_e4m3fn`` cache holds ``key / k_scale`` and ``value / v_scale``
    (the layer's scales), saturated at +-448: the op rounds this step's keys
    and values so (FlashInfer's append copies rows of the cache's dtype), the
    wrappers are planned with ``kv_data_type=torch.float8_e4m3fn`` and run
    with ``k_scale`` / ``v_scale`` (FlashInfer folds ``k_scale`` into the
    softmax scale and multiplies the output by ``v_scale``). Queries stay in
    float16/bfloat16, so the FA2 kernels serve (FA3 takes FP8 caches only
    with FP8 queries).

Layers: the configurations to plan are registered with
:meth:`FlashInferAttentionBackend.register_layer`, or on the first step that
runs them (planned then, outside any capture); ``cache_spec`` only checks that
FlashInfer can run the layer.

Workspace: one float workspace per device, shared by all wrappers, allocated
once (see :func:`backplane.backends.flashinfer._common.workspace`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from backplane.backends.flashinfer import _common
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.errors import BackendUnavailableError
from backplane.core.families import AttentionBackend, AttentionLayerSpec
from backplane.core.forward_context import get_forward_context
from backplane.core.layouts import TensorSpec
from backplane.core.metadata import BatchMetadata, StepMode

logger = logging.getLogger(__name__)

#: Head dimensions FlashInfer's FA2/FA3 paged kernels are built for.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
#: the quantised cache dtype (stored scaled, see the module docstring)
FP8_KV_DTYPE = torch.float8_e4m3fn
#: GQA group sizes the CUDA-core decode kernel dispatches; larger groups use the
#: tensor-core (prefill-kernel) decode path, which is also faster for them.
_CUDA_CORE_GROUPS = (1, 2, 3, 4)
#: ``auto`` (tensor cores above group 4), ``always`` or ``never``: which decode kernel to use.
TENSOR_CORES_ENV = "BACKPLANE_FLASHINFER_DECODE_TENSOR_CORES"


@dataclass(frozen=True)
class _LayerKey:
    """What a FlashInfer plan depends on besides the batch."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window_left: int
    scale: float
    dtype: torch.dtype
    #: the cache's dtype: ``dtype``, or :data:`FP8_KV_DTYPE`
    kv_dtype: torch.dtype

    @classmethod
    def of(
        cls, layer: AttentionLayerSpec, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
    ) -> _LayerKey:
        """The key of ``layer`` run in ``dtype`` over a cache of ``kv_dtype`` (default ``dtype``).

        :param layer: the layer's constants.
        :param dtype: the queries' dtype.
        :param kv_dtype: the cache's dtype.
        :return: the key.
        """
        return cls(
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_dim,
            layer.sliding_window - 1 if layer.sliding_window > 0 else -1,
            float(layer.softmax_scale),
            dtype,
            kv_dtype or dtype,
        )


@dataclass
class AttentionStepPlan:
    """What :meth:`FlashInferAttentionBackend.plan` made for one step.

    :param batch: the batch it was made for (ops check identity).
    :param positions: int32 KV positions of the real tokens (eager path).
    :param prefill: planned prefill wrappers per layer configuration.
    :param decode: planned decode wrappers per layer configuration.
    :param graph: the CUDA-graph bucket buffers when this is a graph step.
    """

    batch: BatchMetadata
    positions: torch.Tensor | None = None
    prefill: dict[_LayerKey, Any] = field(default_factory=dict)
    decode: dict[_LayerKey, Any] = field(default_factory=dict)
    graph: _common.GraphBucketBuffers | None = None
    graph_arrays: dict[str, np.ndarray] | None = None


class FlashInferAttentionBackend(AttentionBackend):
    """Paged causal attention (GQA, sliding window) on FlashInfer.

    :param workspace_device: unused until the first plan; the workspace is
        allocated on the batch's device.
    """

    name: ClassVar[str] = "flashinfer"
    supports_fp8_kv_cache = True

    def __init__(self) -> None:
        self.handle = _common.register_backend(self)
        self._keys: set[_LayerKey] = set()
        self._device: torch.device | None = None
        self._prefill_wrappers: dict[_LayerKey, Any] = {}
        self._decode_wrappers: dict[_LayerKey, Any] = {}
        self._graph_buffers: dict[int, _common.GraphBucketBuffers] = {}
        self._graph_wrappers: dict[tuple[int, _LayerKey], Any] = {}

    # -- layer registration and limits ------------------------------------------
    @staticmethod
    def supports(layer: AttentionLayerSpec, dtype: torch.dtype) -> tuple[bool, str]:
        """Say whether FlashInfer's kernels can run ``layer`` in ``dtype``.

        :return: ``(True, "")`` or ``(False, reason)``.
        """
        if dtype not in SUPPORTED_DTYPES:
            return False, f"FlashInfer attention runs in float16/bfloat16, not {dtype}"
        if layer.head_dim not in SUPPORTED_HEAD_DIMS:
            return False, (
                f"FlashInfer attention supports head_dim {SUPPORTED_HEAD_DIMS}, "
                f"not {layer.head_dim}"
            )
        if layer.num_heads % layer.num_kv_heads:
            return False, "num_heads must be a multiple of num_kv_heads"
        return True, ""

    def _check(self, layer: AttentionLayerSpec, dtype: torch.dtype) -> None:
        ok, reason = self.supports(layer, dtype)
        if not ok:
            raise _common.UnsupportedLayerError(
                f"attention backend 'flashinfer' cannot run layer {layer.layer_id}: {reason}; "
                "select backends.attention: triton or torch",
                family="attention",
                backend="flashinfer",
            )

    def register_layer(
        self, layer: AttentionLayerSpec, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
    ) -> None:
        """Make :meth:`plan` prepare ``layer``'s configuration every step.

        :param layer: the layer's constants.
        :param dtype: the queries' dtype.
        :param kv_dtype: the cache's dtype (default ``dtype``; or :data:`FP8_KV_DTYPE`).
        """
        self._check(layer, dtype)
        self._keys.add(_LayerKey.of(layer, dtype, kv_dtype))

    def cache_spec(
        self, layer: AttentionLayerSpec, *, num_pages: int, page_size: int, dtype: torch.dtype
    ) -> dict[str, TensorSpec]:
        """Return the shared paged-KV layout, after checking FlashInfer can run ``layer``.

        An FP8 (``float8_e4m3fn``) cache is checked as a bfloat16 model's
        would be: the queries keep the model's dtype.
        """
        self._check(layer, torch.bfloat16 if dtype == FP8_KV_DTYPE else dtype)
        return super().cache_spec(layer, num_pages=num_pages, page_size=page_size, dtype=dtype)

    def dynamic_ops(self) -> tuple[Any, ...]:
        """The attention op (the piecewise graph runner leaves it out of segments)."""
        return (torch.ops.backplane_flashinfer.attention.default,)

    # -- wrappers ----------------------------------------------------------------
    def _ensure_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise BackendUnavailableError(
                f"the FlashInfer attention backend needs a CUDA batch, got {device}"
            )
        if self._device is None:
            self._device = device
            _common.workspace(device)

    def _prefill_wrapper(self, key: _LayerKey) -> Any:
        w = self._prefill_wrappers.get(key)
        if w is None:
            import flashinfer

            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                _common.workspace(self._device), kv_layout="NHD"
            )
            self._prefill_wrappers[key] = w
        return w

    def _decode_wrapper(self, key: _LayerKey) -> Any:
        w = self._decode_wrappers.get(key)
        if w is None:
            import flashinfer

            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                _common.workspace(self._device),
                kv_layout="NHD",
                use_tensor_cores=self._tensor_cores(key),
            )
            self._decode_wrappers[key] = w
        return w

    @staticmethod
    def _tensor_cores(key: _LayerKey) -> bool:
        mode = os.environ.get(TENSOR_CORES_ENV, "auto").strip().lower()
        if mode in ("1", "always", "true"):
            return True
        if mode in ("0", "never", "false"):
            if key.num_heads // key.num_kv_heads not in _CUDA_CORE_GROUPS:
                logger.warning("GQA group > 4 has no CUDA-core decode kernel; using tensor cores")
                return True
            return False
        return key.num_heads // key.num_kv_heads not in _CUDA_CORE_GROUPS

    @_common.outside_inference_mode
    def prepare_capture(self, mode: StepMode, batch: BatchMetadata) -> None:
        """Size and fix the buffers of a decode-graph bucket before it is captured.

        :param mode: the bucket about to be captured; piecewise buckets need
            nothing (the op runs eagerly between captured segments).
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

    def _graph_wrapper(self, bucket: int, key: _LayerKey) -> Any:
        w = self._graph_wrappers.get((bucket, key))
        if w is None:
            import flashinfer

            _common.require_not_capturing("attention (creating a CUDA-graph wrapper)")
            buf = self._graph_buffers[bucket]
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                _common.workspace(self._device),
                kv_layout="NHD",
                use_cuda_graph=True,
                use_tensor_cores=self._tensor_cores(key),
                paged_kv_indptr_buffer=buf.kv_indptr,
                paged_kv_indices_buffer=buf.kv_indices,
                paged_kv_last_page_len_buffer=buf.kv_last_page_len,
            )
            self._graph_wrappers[(bucket, key)] = w
        return w

    # -- planning ----------------------------------------------------------------
    @_common.outside_inference_mode
    def plan(self, batch: BatchMetadata) -> AttentionStepPlan:
        """Plan every known layer configuration for ``batch`` (host arrays only).

        :param batch: the step's metadata; a decode-graph ``batch.mode`` selects
            that bucket's CUDA-graph wrappers, any other mode the eager ones.
        :return: the step plan ops read from the forward context.
        """
        self._ensure_device(batch.device)
        step = AttentionStepPlan(batch=batch)
        bucket = _common.graph_bucket(batch)
        if bucket is not None:
            buf = _common.ensure_bucket(
                self._graph_buffers, self._graph_wrappers, batch, bucket, self._device
            )
            step.graph = buf
            step.graph_arrays = buf.host_arrays(batch)
            buf.fill(step.graph_arrays)
        else:
            n = batch.num_tokens
            step.positions = _common.to_device(batch.host.positions[:n], batch.device)
        for key in self._keys:
            self._plan_key(step, key)
        return step

    @_common.outside_inference_mode
    def _plan_key(self, step: AttentionStepPlan, key: _LayerKey) -> None:
        batch = step.batch
        common = dict(
            num_qo_heads=key.num_heads,
            num_kv_heads=key.num_kv_heads,
            page_size=batch.page_size,
            window_left=key.window_left,
            sm_scale=key.scale,
            q_data_type=key.dtype,
            kv_data_type=key.kv_dtype,
        )
        if step.graph is not None:
            a = step.graph_arrays
            w = self._graph_wrapper(step.graph.bucket, key)
            _common.plan_wrapper(
                w,
                _common.host_tensor(a["kv_indptr"]),
                _common.host_tensor(a["kv_indices"]),
                _common.host_tensor(a["kv_last_page_len"]),
                head_dim=key.head_dim,
                **common,
            )
            step.decode[key] = w
            return
        h = batch.host
        np_ = batch.num_prefill_seqs
        n = batch.num_seqs
        split = int(h.page_indptr[np_])
        if np_:
            w = self._prefill_wrapper(key)
            _common.plan_wrapper(
                w,
                _common.host_tensor(h.query_start_loc[: np_ + 1]),
                _common.host_tensor(h.page_indptr[: np_ + 1]),
                _common.host_tensor(h.page_indices[:split]),
                _common.host_tensor(h.last_page_lens[:np_]),
                head_dim_qk=key.head_dim,
                causal=True,
                **common,
            )
            step.prefill[key] = w
        if n > np_:
            w = self._decode_wrapper(key)
            _common.plan_wrapper(
                w,
                _common.host_tensor(h.page_indptr[np_ : n + 1] - split),
                _common.host_tensor(h.page_indices[split : int(h.page_indptr[n])]),
                _common.host_tensor(h.last_page_lens[np_:n]),
                head_dim=key.head_dim,
                **common,
            )
            step.decode[key] = w

    def _step_plan(self, key: _LayerKey) -> AttentionStepPlan:
        """The current step's plan, planning lazily (eagerly, never in capture) when missing."""
        ctx = get_forward_context()
        step = ctx.plan("attention")
        if not isinstance(step, AttentionStepPlan) or step.batch is not ctx.batch:
            _common.require_not_capturing("attention")
            step = self.plan(ctx.batch)
            ctx.plans["attention"] = step
        if key not in self._keys:
            self._keys.add(key)
        if key not in step.decode and key not in step.prefill and ctx.batch.num_seqs:
            _common.require_not_capturing("attention")
            logger.debug("planning attention configuration %s lazily", key)
            self._plan_key(step, key)
        return step

    # -- forward -----------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: AttentionLayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append this step's keys/values to ``kv_cache`` and attend (see the family contract)."""
        self._check(layer, q.dtype)
        key = _LayerKey.of(layer, q.dtype, kv_cache.dtype)
        return _attention_op(
            q,
            k,
            v,
            kv_cache,
            self.handle,
            key.num_heads,
            key.num_kv_heads,
            key.head_dim,
            key.window_left,
            key.scale,
            float(layer.k_scale),
            float(layer.v_scale),
            out,
        )


def _to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` rounded to e4m3, saturated at +-448 (e4m3fn has no infinity)."""
    limit = torch.finfo(FP8_KV_DTYPE).max
    return (x.float() / scale).clamp_(-limit, limit).to(FP8_KV_DTYPE)


# ``out`` has no schema default (callers always pass it): torch 2.11 mishandles a
# trailing optional mutable argument that the dispatcher dropped as a default.
@cached_op(
    "backplane_flashinfer::attention",
    mutates_args=("kv_cache", "out"),
    output_shape=AttentionBackend.output_shape,
)
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    handle: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window_left: int,
    scale: float,
    k_scale: float,
    v_scale: float,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """FlashInfer paged attention for the step in the forward context (out-buffer contract).

    ``k_scale`` / ``v_scale`` are the layer's scales of an FP8 cache (see the
    module docstring); other caches ignore them.
    """
    import flashinfer

    _common.require_cuda(q, "attention")
    backend: FlashInferAttentionBackend = _common.backend_for(handle)
    fp8 = kv_cache.dtype == FP8_KV_DTYPE
    key = _LayerKey(num_heads, num_kv_heads, head_dim, window_left, scale, q.dtype, kv_cache.dtype)
    # FlashInfer folds k_scale into the softmax scale and multiplies the output by v_scale
    scales: dict[str, float] = {"k_scale": k_scale, "v_scale": v_scale} if fp8 else {}
    step = backend._step_plan(key)
    _common.require_graph_plan_when_capturing(step.graph, "attention")
    batch = step.batch
    buf = output_buffer(out, q.shape, q.dtype, q.device)
    if not q.is_contiguous():
        q = q.contiguous()
    if step.graph is not None:
        g = step.graph
        b = g.bucket
        kb, vb = (_to_fp8(k[:b], k_scale), _to_fp8(v[:b], v_scale)) if fp8 else (k[:b], v[:b])
        flashinfer.append_paged_kv_cache(
            kb,
            vb,
            g.seq_ids,
            g.positions,
            kv_cache,
            g.kv_indices,
            g.kv_indptr,
            g.kv_last_page_len,
            kv_layout="NHD",
        )
        step.decode[key].run(q[:b], kv_cache, out=buf[:b], **scales)
        # Padding rows are masked on the device, so a replayed graph zeroes
        # exactly the rows that are padding in *that* step.
        buf[:b].masked_fill_(g.pad_mask, 0)
        if b < buf.shape[0]:
            buf[b:].zero_()
        return buf.new_empty(0) if out is not None else buf
    n = batch.num_tokens
    npt = batch.num_prefill_tokens
    if n:
        kn, vn = (_to_fp8(k[:n], k_scale), _to_fp8(v[:n], v_scale)) if fp8 else (k[:n], v[:n])
        flashinfer.append_paged_kv_cache(
            kn,
            vn,
            batch.token_seq_ids[:n],
            step.positions,
            kv_cache,
            batch.page_indices,
            batch.page_indptr,
            batch.last_page_lens,
            kv_layout="NHD",
        )
    if npt:
        step.prefill[key].run(q[:npt], kv_cache, out=buf[:npt], **scales)
    if n > npt:
        step.decode[key].run(q[npt:n], kv_cache, out=buf[npt:n], **scales)
    return finish_output(out, buf, n)
