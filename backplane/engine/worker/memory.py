"""Device memory at start-up: what the engine may use, and how much of it the KV cache gets.

On CUDA the engine may use ``gpu_memory_utilization`` of the device's total
memory in all (vLLM's meaning). Before the KV cache is allocated the engine
measures what else it needs:

* the weights: device memory allocated while the model loaded;
* the activation peak of the largest step: one profiling forward of
  ``max_num_tokens`` scratch tokens (on the scratch page and state slot of a
  two-page cache), with the LM head and the sampler over ``max_num_seqs`` rows;
* CUDA graphs: the piecewise pool holds about one activation peak, and every
  decode bucket keeps its float32 logits;
* memory outside torch's allocator that loading and profiling added (CUDA
  context, cuBLAS and kernel workspaces).

The KV cache (with the recurrent states) gets the rest, and never more than
the device has free at that moment: another engine alive in the process, or
another process, leaves this one less. On the CPU the pool is sized by
:func:`~backplane.engine.sizes.cpu_kv_budget`. :func:`num_kv_pages` turns the
budget into pages. The profiling step itself is a start-up scratch step and
lives with the others in :mod:`backplane.engine.worker.warmup`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backplane.core.errors import OutOfKVMemoryError
from backplane.core.layouts import CacheFootprint
from backplane.engine.sizes import cpu_kv_budget, format_size
from backplane.engine.worker.graph.mode import GraphMode

logger = logging.getLogger(__name__)

#: left free beyond the estimates: allocator fragmentation and small late allocations
SAFETY_MARGIN = 256 << 20


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a CUDA device's memory (bytes).

    :param free: free on the device (driver's view, all processes).
    :param total: the device's total memory.
    :param reserved: held by this process's torch caching allocator.
    :param allocated: in live tensors of this process.
    """

    free: int
    total: int
    reserved: int
    allocated: int

    @classmethod
    def read(cls, device: torch.device) -> DeviceMemory:
        """Read the device's memory now.

        :param device: a CUDA device.
        :return: the reading.
        """
        free, total = torch.cuda.mem_get_info(device)
        return cls(
            free=int(free),
            total=int(total),
            reserved=int(torch.cuda.memory_reserved(device)),
            allocated=int(torch.cuda.memory_allocated(device)),
        )

    @property
    def available(self) -> int:
        """What this process can still allocate: free memory plus its allocator's cached blocks."""
        return self.free + self.reserved - self.allocated

    @property
    def outside_torch(self) -> int:
        """Device memory in use that torch's allocator does not hold (context, other processes)."""
        return self.total - self.free - self.reserved


@dataclass(frozen=True)
class KVBudget:
    """The KV cache's share of the engine's memory, and how it was reached (bytes).

    :param kv: bytes for the KV cache and the recurrent states.
    :param limit: ``gpu_memory_utilization`` x the device's total memory.
    :param weights: the model's weights.
    :param activations: the profiled activation peak of a full step.
    :param graphs: reserved for CUDA graphs.
    :param outside_torch: memory loading and profiling added outside torch's allocator.
    :param available: what the device had free for the engine after profiling.
    :param capped: the free memory, not the utilisation limit, set ``kv``.
    """

    kv: int
    limit: int
    weights: int
    activations: int
    graphs: int
    outside_torch: int
    available: int
    capped: bool

    def explain(self) -> str:
        """One line of the arithmetic, for the log and for errors."""
        f = format_size
        line = (
            f"{f(self.limit)} (gpu_memory_utilization x device memory) - weights "
            f"{f(self.weights)} - activations {f(self.activations)} - CUDA graphs "
            f"{f(self.graphs)} - other {f(self.outside_torch)}"
        )
        if self.capped:
            line += f"; capped by the free device memory ({f(self.available)} available)"
        return line


def kv_budget(
    *,
    utilization: float,
    start: DeviceMemory,
    loaded: DeviceMemory,
    now: DeviceMemory,
    activations: int,
    graphs: int,
) -> KVBudget:
    """Bytes the KV cache may take.

    :param utilization: ``gpu_memory_utilization``.
    :param start: the reading before the model loaded.
    :param loaded: the reading right after it loaded.
    :param now: the reading after profiling (profiling tensors freed).
    :param activations: the profiled activation peak.
    :param graphs: bytes reserved for CUDA graphs (0 without them).
    :return: the budget, never negative.
    """
    limit = int(utilization * start.total)
    weights = max(0, loaded.allocated - start.allocated)
    outside = max(0, now.outside_torch - start.outside_torch)
    share = limit - weights - activations - graphs - outside - SAFETY_MARGIN
    # the activations and graphs are allocated later, from what is free now
    room = now.available - activations - graphs - SAFETY_MARGIN
    return KVBudget(
        kv=max(0, min(share, room)),
        limit=limit,
        weights=weights,
        activations=activations,
        graphs=graphs,
        outside_torch=outside,
        available=now.available,
        capped=room < share,
    )


def decode_graph_bytes(buckets: Sequence[int], vocab_size: int) -> int:
    """Memory the decode graphs keep beyond the piecewise pool: each bucket's float32 logits.

    :param buckets: the decode batch sizes captured.
    :param vocab_size: the model's vocabulary.
    :return: bytes.
    """
    return int(sum(buckets)) * int(vocab_size) * 4


def graph_bytes(
    mode: GraphMode, *, activations: int, decode_bucket_sizes: Sequence[int], vocab_size: int
) -> int:
    """Memory the CUDA graphs of ``mode`` will take, reserved before the KV cache is sized.

    :param mode: the worker's graph mode.
    :param activations: the profiled activation peak (the piecewise pool holds about one).
    :param decode_bucket_sizes: the decode batch sizes captured.
    :param vocab_size: the model's vocabulary.
    :return: bytes.
    """
    total = activations if mode.has_piecewise else 0
    if mode.has_decode:
        total += decode_graph_bytes(decode_bucket_sizes, vocab_size)
    return total


def num_kv_pages(
    footprint: CacheFootprint,
    *,
    num_kv_pages: int | None,
    kv_memory: int | None,
    budget: KVBudget | None,
    page_size: int,
    max_num_seqs: int,
    max_pages_per_seq: int,
) -> int:
    """Pages (including the scratch page 0) that fit the KV memory.

    :param footprint: per-page and recurrent-state bytes of the model's caches.
    :param num_kv_pages: the configured page count, taken as is when set.
    :param kv_memory: the configured KV bytes, when set.
    :param budget: the profiled CUDA budget (``None`` elsewhere, or when configured).
    :param page_size: tokens per page.
    :param max_num_seqs: most sequences at once (sizes the CPU pool).
    :param max_pages_per_seq: pages of the longest sequence.
    :return: the page count.
    :raises OutOfKVMemoryError: fewer than two pages fit.
    """
    per_page, state_bytes = footprint.page_bytes, footprint.state_bytes
    if num_kv_pages is not None:
        n = int(num_kv_pages)
    elif per_page == 0:  # no paged layers: pages are bookkeeping only
        n = max_num_seqs * max_pages_per_seq + 1
    else:
        if kv_memory is not None:
            kv = int(kv_memory)
        elif budget is not None:
            kv = budget.kv
        else:
            kv, why = cpu_kv_budget(
                page_bytes=per_page,
                state_bytes=state_bytes,
                max_num_seqs=max_num_seqs,
                max_pages_per_seq=max_pages_per_seq,
            )
            logger.info("KV memory on cpu: %s (%s)", format_size(kv), why)
        n = int((kv - state_bytes) // per_page)
    if n < 2:
        how = f" (KV budget {format_size(budget.kv)} = {budget.explain()})" if budget else ""
        raise OutOfKVMemoryError(
            f"the KV memory holds {max(n, 0)} page(s) of {page_size} tokens after "
            f"{state_bytes} bytes of recurrent state; at least 2 are needed (page 0 is "
            f"scratch), one page takes {per_page} bytes{how}. Raise "
            f"gpu_memory_utilization, lower max_num_tokens / max_num_seqs, or set "
            f"kv_memory or num_kv_pages"
        )
    return n
