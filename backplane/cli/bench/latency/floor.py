"""The memory floor of a decode step: the device's read bandwidth and the bytes a step moves.

Floor ``ms = bytes / bandwidth``: the time a step would take if it did nothing
but read (and write back) what it must, at the measured bandwidth.
"""

from __future__ import annotations

import math
import time
from typing import Any

from backplane.cli.bench.latency.weights import WeightsInfo


def measure_bandwidth(device: Any, *, nbytes: int | None = None, repeats: int = 10) -> dict:
    """Measure the device's memory read bandwidth with a large reduction.

    A float32 sum over a tensor much larger than the caches reads every byte
    once and writes one number, so its rate is the read bandwidth a decode step
    can hope for. On CUDA it is timed with events (after a warm-up), on a CPU
    with ``time.perf_counter``; the best of ``repeats`` is kept.

    :param device: a ``torch.device``.
    :param nbytes: tensor size (default: 1 GiB on CUDA, or a quarter of the free
        memory if less; 256 MiB on a CPU).
    :param repeats: timed reductions.
    :return: ``{"bytes_per_s", "tensor_bytes", "method"}``.
    """
    import torch

    if nbytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            nbytes = min(1 << 30, free // 4)
        else:
            nbytes = 256 << 20
    n = max(nbytes // 4, 1)
    x = torch.ones(n, dtype=torch.float32, device=device)
    best = math.inf
    if device.type == "cuda":
        per_timing = 4
        for _ in range(3):
            x.sum()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            for _ in range(per_timing):
                x.sum()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / per_timing)
        method = f"float32 sum over {n * 4 / 2**30:.2f} GiB, CUDA events, best of {repeats}"
    else:
        x.sum()
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        method = f"float32 sum over {n * 4 / 2**20:.0f} MiB, wall clock, best of {repeats}"
    del x
    return {"bytes_per_s": n * 4 / best, "tensor_bytes": n * 4, "method": method}


def floor_bytes(info: WeightsInfo, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Bytes one decode step of ``batch`` sequences must move to and from memory.

    Weights: everything once, except the embedding (only ``batch`` rows are
    looked up; the LM head is read in full) and routed experts (at most
    ``batch * experts_per_token`` of each layer's experts are used). KV: each
    sequence reads its cache at the mean context length of the timed steps
    (steps 2..N see ``prompt_len + 1`` .. ``prompt_len + N - 1`` tokens) and
    writes one token. Recurrent state: read and written back once per step.

    :param info: the saved model's sizes.
    :param batch: sequences decoded together.
    :param prompt_len: prompt tokens per sequence.
    :param new_tokens: generated tokens per sequence.
    :return: the parts and their ``total``.
    """
    rows = min(batch, info.embedding_bytes // max(info.embedding_row_bytes, 1))
    embedding_read = rows * info.embedding_row_bytes
    experts_read = info.expert_bytes
    if info.num_experts and info.experts_per_token:
        used = min(info.num_experts, batch * info.experts_per_token)
        experts_read = info.expert_bytes * used / info.num_experts
    other = info.weight_bytes - info.expert_bytes - info.embedding_bytes
    if not info.tied:
        other -= info.lm_head_bytes
    weights = other + info.lm_head_bytes + embedding_read + experts_read
    mean_context = prompt_len + new_tokens / 2
    kv = batch * info.kv_bytes_per_token * (mean_context + 1)
    state = 2 * batch * info.state_bytes_per_seq
    return {
        "weights": int(weights),
        "kv_cache": int(kv),
        "recurrent_state": int(state),
        "mean_context": mean_context,
        "total": int(weights + kv + state),
    }
