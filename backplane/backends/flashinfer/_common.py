"""Pieces shared by the FlashInfer backends: the workspace, backend handles, sub-batches.

FlashInfer is imported lazily (inside functions) so that importing these modules
on a machine without it fails only when a kernel is actually used.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from backplane.core import errors
from backplane.core.errors import BackendUnavailableError
from backplane.core.metadata import BatchMetadata, HostBatch

logger = logging.getLogger(__name__)

#: Environment variable overriding the size of the shared float workspace, in MiB.
WORKSPACE_ENV = "BACKPLANE_FLASHINFER_WORKSPACE_MB"
#: Default float workspace: FlashInfer recommends 128 MiB for decode; long-context
#: prefill with split-KV needs more, and the buffer is allocated once per device.
DEFAULT_WORKSPACE_MB = 256

_workspaces: dict[torch.device, torch.Tensor] = {}
_workspace_lock = threading.Lock()


def outside_inference_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with inference mode off, whatever mode its caller is in.

    FlashInfer wrappers keep the buffers they make while planning and update them
    in place at every later ``plan``. Made under inference mode (graph capture runs
    there), they would be inference tensors, which a later plan outside inference
    mode may not update; made as normal tensors, either mode may update them.

    :param fn: a method that creates or plans FlashInfer wrappers.
    :return: the wrapped function.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode(False):
            return fn(*args, **kwargs)

    return wrapper


@outside_inference_mode
def workspace(device: torch.device) -> torch.Tensor:
    """Return the float workspace every FlashInfer wrapper on ``device`` shares.

    Wrappers only use it while their kernel runs, and kernels of one step run in
    stream order, so one buffer serves attention, MLA, prefill and decode. It is
    sized once (``BACKPLANE_FLASHINFER_WORKSPACE_MB``, default 256) and zeroed as
    FlashInfer requires before first use.

    :param device: a CUDA device.
    :return: a ``uint8`` tensor.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _workspace_lock:
        buf = _workspaces.get(device)
        if buf is None:
            mb = int(os.environ.get(WORKSPACE_ENV, DEFAULT_WORKSPACE_MB))
            buf = torch.zeros(mb * 1024 * 1024, dtype=torch.uint8, device=device)
            _workspaces[device] = buf
            logger.info("FlashInfer float workspace: %d MiB on %s", mb, device)
        return buf


# re-exported: the backends raise it with family="<family>", backend="flashinfer"
UnsupportedLayerError = errors.UnsupportedLayerError


def require_cuda(t: torch.Tensor, what: str) -> None:
    """Raise a clear error when a FlashInfer kernel is handed a non-CUDA tensor."""
    if t.device.type != "cuda":
        raise BackendUnavailableError(
            f"the FlashInfer {what} backend runs only on CUDA tensors, got {t.device}; "
            f"select the torch or triton backend for {t.device.type}"
        )


def require_not_capturing(what: str) -> None:
    """Raise when host-side planning is attempted inside CUDA-graph capture."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"FlashInfer {what}: no plan for this step while a CUDA graph is being captured; "
            "call backend.prepare_capture(mode, batch) and backend.plan(batch) before capture"
        )


# -- backend handles ------------------------------------------------------------
# Custom ops take only tensors and scalars, so an op finds the backend object
# that owns its wrappers through a small integer handle.

_handles: dict[int, Any] = {}
_counter = itertools.count(1)


def register_backend(backend: Any) -> int:
    """Return a new handle for ``backend`` (kept as a weak reference)."""
    handle = next(_counter)
    _handles[handle] = weakref.ref(backend)
    return handle


def backend_for(handle: int) -> Any:
    """Return the backend registered under ``handle``."""
    ref = _handles.get(handle)
    obj = ref() if ref is not None else None
    if obj is None:
        raise RuntimeError(f"FlashInfer backend handle {handle} is no longer alive")
    return obj


# -- batch slices -----------------------------------------------------------------


def host_tensor(a: np.ndarray, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Wrap a host numpy array as a contiguous CPU tensor of ``dtype`` (FlashInfer ``plan`` input)."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


def plan_wrapper(wrapper: Any, *args: Any, **kwargs: Any) -> None:
    """Call ``wrapper.plan(*args, **kwargs)`` once its previous plan reached the device.

    A wrapper's ``plan`` writes the plan into a page-locked host buffer of the
    wrapper's own and queues its copy to the device on the current stream. With
    the next step prepared while the device still runs the last one, a second
    ``plan`` of the same wrapper could rewrite that host buffer before the first
    copy ran, and the step in flight would attend with the next step's plan. So
    each plan records an event after its copy, and the next one waits for it:
    the device reaches that copy as soon as the step before it ends, so the wait
    is short whenever the host is at most a step ahead.

    :param wrapper: a FlashInfer attention or MLA wrapper.
    :param args: ``plan``'s positional arguments.
    :param kwargs: ``plan``'s keyword arguments.
    """
    done: torch.cuda.Event | None = getattr(wrapper, "_backplane_plan_copied", None)
    if done is not None:
        done.synchronize()
    wrapper.plan(*args, **kwargs)
    if done is None:
        done = torch.cuda.Event()
        wrapper._backplane_plan_copied = done
    done.record()


def to_device(
    a: np.ndarray, device: torch.device, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """Copy a host array to ``device`` (host -> device only; never the other way)."""
    t = host_tensor(a, dtype)
    if device.type == "cuda":
        t = t.pin_memory().to(device, non_blocking=True)
    return t


def slice_prefill(batch: BatchMetadata) -> BatchMetadata:
    """Return the prefill/extend part of ``batch`` as a batch of its own.

    Views of the host arrays and device tensors, no copies: sequences
    ``[0, num_prefill_seqs)`` and tokens ``[0, num_prefill_tokens)``, unpadded.
    Used to hand the prefill sequences to a fallback backend while the decode
    sequences run on FlashInfer.
    """
    s = batch.num_prefill_seqs
    t = batch.num_prefill_tokens
    h = batch.host
    npg = int(h.page_indptr[s])
    return BatchMetadata(
        num_prefill_seqs=s,
        num_prefill_tokens=t,
        num_decode_seqs=0,
        num_decode_tokens=0,
        padded_num_tokens=t,
        page_size=batch.page_size,
        max_query_len=int(h.query_lens[:s].max()) if s else 0,
        max_seq_len=int(h.seq_lens[:s].max()) if s else 0,
        host=HostBatch(**_leading(h, s, t, npg)),
        **_leading(batch, s, t, npg),
    )


#: how each per-step array is cut to the first ``s`` sequences / ``t`` tokens
_PER_TOKEN = ("positions", "slot_mapping", "token_seq_ids")
_OFFSETS = ("query_start_loc", "page_indptr")


def _leading(src: Any, s: int, t: int, npg: int) -> dict[str, Any]:
    # the same cut for the host arrays and their device tensors, so the two stay in step
    out: dict[str, Any] = {}
    for f in dataclasses.fields(HostBatch):
        n = npg if f.name == "page_indices" else t if f.name in _PER_TOKEN else s
        out[f.name] = getattr(src, f.name)[: n + 1 if f.name in _OFFSETS else n]
    return out


# -- CUDA-graph decode buckets ----------------------------------------------------


def graph_bucket(batch: BatchMetadata) -> int | None:
    """The decode-graph bucket ``plan`` uses for ``batch``, or ``None`` for the eager wrappers.

    The model runner decided how the step runs (``batch.mode``); only the steps
    of a decode graph run FlashInfer's ops inside a captured graph. Piecewise
    steps run the ops eagerly between captured segments, so they plan like eager
    steps.

    :param batch: the step's metadata.
    :return: the bucket size, or ``None``.
    :raises ValueError: the batch does not fit its decode graph (see ``StepMode.check``).
    """
    mode = batch.mode
    if not mode.is_decode_graph:
        return None
    mode.check(batch.num_seqs, batch.num_decode_seqs, batch.padded_num_tokens)
    return mode.bucket


def bucket_capacity(batch: BatchMetadata, bucket: int) -> int:
    """Page-index capacity of a bucket first seen with ``batch``.

    Covers the batch's pages and ``bucket`` sequences of its block-table width:
    for the graph runner's capture batch (``bucket`` sequences of the full
    width) that is every page a later step of the bucket can reference.
    """
    h = batch.host
    return max(int(h.page_indptr[batch.num_seqs]), bucket * int(h.block_table.shape[1]))


def ensure_bucket(
    prepared: dict[int, GraphBucketBuffers],
    wrappers: dict[tuple[int, Any], Any],
    batch: BatchMetadata,
    bucket: int,
    device: torch.device,
) -> GraphBucketBuffers:
    """Return bucket ``bucket``'s buffers, large enough for ``batch``.

    A bucket is created on first use, and grown (its wrappers dropped, to be rebuilt
    on the new buffers) when a batch references more pages than it holds -- unless it
    was fixed for capture (:func:`fix_bucket`): a captured graph keeps reading the
    buffers it was captured with.
    """
    buf = prepared.get(bucket)
    h = batch.host
    n = batch.num_seqs
    needed = int(h.page_indptr[n]) + max(bucket - n, 0)
    if buf is not None and needed <= len(buf.kv_indices):
        return buf
    if buf is not None and buf.fixed:
        raise ValueError(
            f"CUDA-graph bucket {bucket} holds {len(buf.kv_indices)} page entries but this "
            f"step references {needed}; capture the bucket with its largest batch "
            "(prepare_capture sizes the bucket from the batch it is given)"
        )
    buf = GraphBucketBuffers.allocate(bucket, max(needed, bucket_capacity(batch, bucket)), device)
    prepared[bucket] = buf
    for key in [k for k in wrappers if k[0] == bucket]:
        del wrappers[key]
    return buf


def fix_bucket(
    prepared: dict[int, GraphBucketBuffers],
    wrappers: dict[tuple[int, Any], Any],
    batch: BatchMetadata,
    bucket: int,
    device: torch.device,
) -> GraphBucketBuffers:
    """Size bucket ``bucket``'s buffers for its capture batch and keep them where they are.

    The backends' ``prepare_capture`` calls this before the bucket is captured.
    """
    buf = ensure_bucket(prepared, wrappers, batch, bucket, device)
    buf.fixed = True
    return buf


def require_graph_plan_when_capturing(step_graph: GraphBucketBuffers | None, what: str) -> None:
    """Refuse to be captured on buffers that may move after the capture.

    Eager wrappers reallocate their index buffers at every plan, and a bucket not
    fixed by ``prepare_capture`` may grow; either way a captured graph would
    replay stale indices.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return
    if step_graph is None:
        raise RuntimeError(
            f"FlashInfer {what}: this step was planned on the eager wrappers, whose index "
            "buffers are reallocated by every plan, so a captured graph would replay stale "
            "indices; capture decode graphs with batches whose mode is StepMode.decode_graph"
        )
    if not step_graph.fixed:
        raise RuntimeError(
            f"FlashInfer {what}: CUDA-graph bucket {step_graph.bucket} is captured without "
            "backend.prepare_capture(mode, batch), so its buffers may still move; call it "
            "before capturing"
        )


@dataclass
class GraphBucketBuffers:
    """Fixed device buffers of one CUDA-graph decode bucket.

    A captured decode graph keeps pointing at these tensors; :meth:`fill`
    rewrites their contents from the host batch before every replay. The batch
    is padded to ``bucket`` sequences: padding sequence ``j`` owns the reserved
    scratch page 0 with one token at position 0, so its KV append and attention
    touch no live data, and ``valid`` masks its output rows to zero.

    :param bucket: the decode batch size (= padded token count) of the bucket.
    :param max_pages: capacity of the page-index buffer.
    """

    bucket: int
    max_pages: int
    kv_indptr: torch.Tensor  # int32 [bucket + 1]
    kv_indices: torch.Tensor  # int32 [max_pages]
    kv_last_page_len: torch.Tensor  # int32 [bucket]
    kv_lens: torch.Tensor  # int32 [bucket]
    qo_indptr: torch.Tensor  # int32 [bucket + 1] (0..bucket)
    seq_ids: torch.Tensor  # int32 [bucket] (0..bucket-1)
    positions: torch.Tensor  # int32 [bucket]
    pad_mask: torch.Tensor  # bool [bucket, 1, 1], True on padding rows
    #: Set by ``prepare_capture``: a graph is captured on these buffers; they may not move.
    fixed: bool = False

    @classmethod
    def allocate(cls, bucket: int, max_pages: int, device: torch.device) -> GraphBucketBuffers:
        """Allocate the buffers of one bucket on ``device``."""
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            bucket=bucket,
            max_pages=max_pages,
            kv_indptr=torch.zeros(bucket + 1, **i32),
            kv_indices=torch.zeros(max(max_pages, bucket), **i32),
            kv_last_page_len=torch.ones(bucket, **i32),
            kv_lens=torch.ones(bucket, **i32),
            qo_indptr=torch.arange(bucket + 1, **i32),
            seq_ids=torch.arange(bucket, **i32),
            positions=torch.zeros(bucket, **i32),
            pad_mask=torch.zeros(bucket, 1, 1, dtype=torch.bool, device=device),
        )

    def host_arrays(self, batch: BatchMetadata) -> dict[str, np.ndarray]:
        """Return the padded host arrays for ``batch`` (decode-only, ``num_seqs <= bucket``)."""
        n = batch.num_seqs
        b = self.bucket
        if not batch.is_decode_only or n > b:
            raise ValueError(
                f"CUDA-graph bucket {b} takes decode-only batches of at most {b} sequences; "
                f"got {batch.num_prefill_seqs} prefill + {batch.num_decode_seqs} decode"
            )
        h = batch.host
        pages = int(h.page_indptr[n])
        total = pages + (b - n)
        if total > len(self.kv_indices):
            raise ValueError(
                f"CUDA-graph bucket {b}: the batch uses {pages} pages but the bucket holds "
                f"{self.max_pages}; size the bucket with its largest batch (prepare_capture)"
            )
        indptr = np.empty(b + 1, np.int32)
        indptr[: n + 1] = h.page_indptr[: n + 1]
        indptr[n + 1 :] = pages + np.arange(1, b - n + 1, dtype=np.int32)
        indices = np.zeros(total, np.int32)  # padding sequences -> scratch page 0
        indices[:pages] = h.page_indices[:pages]
        last = np.ones(b, np.int32)
        last[:n] = h.last_page_lens[:n]
        lens = np.ones(b, np.int32)
        lens[:n] = h.seq_lens[:n]
        pos = np.zeros(b, np.int32)
        pos[:n] = h.positions[:n]
        mask = np.ones(b, np.bool_)
        mask[:n] = False
        return {
            "kv_indptr": indptr,
            "kv_indices": indices,
            "kv_last_page_len": last,
            "kv_lens": lens,
            "positions": pos,
            "pad_mask": mask,
        }

    def fill(self, arrays: dict[str, np.ndarray]) -> None:
        """Copy the padded host arrays into the fixed buffers (host -> device, no sync)."""
        for name, arr in arrays.items():
            dst: torch.Tensor = getattr(self, name)
            src = torch.from_numpy(arr).pin_memory()
            dst.view(-1)[: src.numel()].copy_(src, non_blocking=True)
