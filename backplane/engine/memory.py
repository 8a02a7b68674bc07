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
another process, leaves this one less.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from backplane.core.forward_context import forward_context, plan_step
from backplane.engine.inputs import InputBatch, scratch_prefill
from backplane.engine.sampling import Sampler, SamplingParams
from backplane.engine.sizes import format_size

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


@torch.inference_mode()
def profile_step_peak(
    model: Any,
    backends: dict[str, Any],
    input_batch: InputBatch,
    sampler: Sampler,
    *,
    max_num_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    page_size: int,
    cache_kw: dict[str, Any],
    device: torch.device,
) -> int:
    """The activation peak of the largest step, measured by running one.

    Binds a two-page cache to the model, runs a prefill of ``max_num_tokens``
    scratch tokens (all on the scratch page and state slot), then the LM head
    and a filtered sampling pass over ``max_num_seqs`` rows. The caller binds
    the real caches afterwards.

    :param model: the loaded ``CausalLM``.
    :param backends: its backends (planned for the profiling batch).
    :param input_batch: the engine's input batch.
    :param sampler: the engine's sampler.
    :param max_num_tokens: tokens of the profiled step.
    :param max_num_seqs: sampled rows.
    :param max_model_len: the longest sequence (the step is split into sequences no longer).
    :param page_size: tokens per page.
    :param cache_kw: the arguments of ``model.cache_specs`` but ``num_pages``.
    :param device: the CUDA device.
    :return: bytes allocated at the peak beyond what was allocated before.
    """
    specs = model.cache_specs(num_pages=2, **cache_kw)
    caches = {
        layer: {name: spec.allocate(device) for name, spec in layer_specs.items()}
        for layer, layer_specs in specs.items()
    }
    model.bind_caches(caches)
    seqs = scratch_prefill(max_num_tokens, max_model_len, page_size)[:max_num_seqs]
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    inputs = input_batch.prepare(seqs)
    with forward_context(inputs.metadata, plan_step(backends, inputs.metadata)):
        hidden = model(inputs.input_ids, inputs.positions)
    rows = hidden[-1:].expand(max_num_seqs, -1)
    logits = model.compute_logits(rows)
    del hidden
    params = [SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01)] * max_num_seqs
    seeds = np.arange(max_num_seqs, dtype=np.int64)
    sampler.sample(logits, params, seeds, np.zeros(max_num_seqs, dtype=np.int64))
    del logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del caches
    return int(max(0, peak))
