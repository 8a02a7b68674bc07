"""Start-up warm-up of one worker: the scratch steps that run before any request does.

Two kinds of scratch step live here, the one home of start-up warm-up:

* :func:`profile_step_peak` runs the largest step once, before the KV cache is
  sized, to measure its activation peak (the memory planner,
  :mod:`backplane.engine.worker.memory`, gives the KV cache what is left);
* :func:`warm_up_kernels` runs :func:`warmup_steps` once the caches and graphs
  exist, so kernels compiled on first use are compiled before any request.

JIT-compiled kernels, Triton's above all, build one variant per combination of
compile-time constants the first time it is launched. The attention kernels
have several such classes: the tile configuration follows the longest query of
a prefill, a prefill that extends cached context reads keys through the pages,
and the decode's key-split count follows the longest context of the step. The
CUDA-graph captures meet only some of them (fresh prompts of each bucket size,
decode at the longest context); a serving process meets the rest in its first
mixed steps, where each new variant costs a second or more of compilation
inside some request's time to first token.

:func:`warmup_steps` lists one scratch step per class, built like the capture
batches from :class:`~backplane.engine.worker.inputs.ScratchSeq` (zero tokens, every
page the scratch page, the scratch state slot), so running them touches no live
cache data. The worker runs them through its model runner at start-up, the way
a real step of that shape runs (piecewise graphs included); with Triton's disk
cache warm, they take milliseconds.

On a cold cache their kernels compile ahead, side by side with those of the
graph captures (:func:`warm_up_forwards` in the graph runner's compile-only
pass, :mod:`backplane.core.compile_ahead`); the profiling step's compile in a
compile-only pass of their own before it is measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from backplane.core import compile_ahead
from backplane.core.families import Backend
from backplane.core.forward_context import forward_context, plan_step
from backplane.engine.sampling import Sampler, SamplingParams
from backplane.engine.worker.inputs import (
    BatchInputs,
    InputBatch,
    ScheduledSeqLike,
    ScratchSeq,
    scratch_prefill,
    scratch_seq,
)
from backplane.engine.worker.startup_timings import startup_detail
from backplane.models.base import CausalLM

logger = logging.getLogger(__name__)

__all__ = [
    "KEYS_PER_SPLIT",
    "PREFILL_LENGTHS",
    "PROFILE_AHEAD_DETAIL",
    "profile_step_peak",
    "step_kind",
    "warm_up_forwards",
    "warm_up_kernels",
    "warmup_steps",
]

#: Prompt lengths that reach every prefill tile class of the attention kernels
#: (tiny <= 32 < short <= 64 < medium < 2048 <= long; 4096 adds the
#: tensor-descriptor loads of very long prompts).
PREFILL_LENGTHS = (16, 48, 128, 2048, 4096)

#: Context length that gives a decode sequence one key split; each doubling doubles it.
KEYS_PER_SPLIT = 128

#: the start-up detail that the compile-only pass of the profiling step adds its seconds to
PROFILE_AHEAD_DETAIL = f"{compile_ahead.AHEAD_DETAIL}: memory profiling"


def warmup_steps(
    *, max_num_tokens: int, max_num_seqs: int, max_model_len: int, page_size: int
) -> list[list[ScratchSeq]]:
    """The scratch steps to run at start-up, prefill sequences first in each.

    * every prefill length class, as a fresh prompt and as an extension of
      one cached page;
    * decode at contexts of 128, 256, ... up to ``max_model_len`` tokens (one
      more key split per doubling), beside a short fresh prompt so that the
      step is a mixed one, as it is in serving (a decode-only step replays its
      captured graph);
    * the widest mixed step: the prompt beside ``max_num_seqs - 1`` short decodes.

    Every step respects the engine's limits, so some classes drop out for
    small ``max_num_tokens`` or ``max_model_len``.

    :param max_num_tokens: most tokens in one step.
    :param max_num_seqs: most sequences in one step.
    :param max_model_len: the longest sequence.
    :param page_size: tokens per page.
    :return: the steps, each a list of sequences.
    """
    steps: list[list[ScratchSeq]] = []
    lengths = sorted({min(q, max_num_tokens, max_model_len) for q in PREFILL_LENGTHS})
    for q in lengths:
        steps.append([scratch_seq(q, 0, page_size)])
        cached = min(page_size, max_model_len - q)
        if cached > 0:
            steps.append([scratch_seq(q, cached, page_size)])
    # a decode needs one cached token; the prompt beside it one token of budget
    prompt = min(PREFILL_LENGTHS[0], max_num_tokens - 1, max_model_len)
    beside = [scratch_seq(prompt, 0, page_size)] if prompt > 0 and max_num_seqs > 1 else []
    contexts = []
    length = KEYS_PER_SPLIT
    while length < max_model_len:
        contexts.append(length)
        length *= 2
    contexts.append(max_model_len)
    for context in contexts:
        if context >= 2:
            steps.append([*beside, scratch_seq(1, context - 1, page_size)])
    width = min(max_num_seqs - len(beside), max_num_tokens - (prompt if beside else 0))
    if width > 1 and max_model_len >= 2:
        steps.append([*beside, *(scratch_seq(1, 1, page_size) for _ in range(width))])
    return steps


def step_kind(seqs: list[ScratchSeq]) -> str:
    """The class of a warm-up step, to say where warm-up time goes.

    :param seqs: one step of :func:`warmup_steps`.
    :return: ``"prefill"`` (prompts only), ``"decode"`` (one decode, at some
        context, beside at most a prompt) or ``"mixed"`` (several decodes).
    """
    decodes = sum(1 for s in seqs if s.num_new_tokens == 1 and s.num_cached_tokens > 0)
    if decodes == 0:
        return "prefill"
    return "decode" if decodes == 1 else "mixed"


def warm_up_kernels(
    prepare: Callable[[list[ScheduledSeqLike]], BatchInputs],
    execute: Callable[[BatchInputs], torch.Tensor],
    *,
    max_num_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    page_size: int,
    device: torch.device,
) -> None:
    """Run the scratch steps of :func:`warmup_steps` once, through the worker's runner.

    Kernels compiled on first use (Triton's) are compiled here rather than
    inside the first requests' steps. A step that fails is logged and
    skipped: the shape it stands for then compiles on first use, or fails
    there with the same error.

    :param prepare: the worker's input preparation (its runner's ``prepare_inputs``).
    :param execute: the worker's forward (plans the backends, runs the runner).
    :param max_num_tokens: most tokens in one step.
    :param max_num_seqs: most sequences in one step.
    :param max_model_len: the longest sequence.
    :param page_size: tokens per page.
    :param device: the worker's CUDA device (synchronised before the time is logged).
    """
    steps = warmup_steps(
        max_num_tokens=max_num_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        page_size=page_size,
    )
    start = time.perf_counter()
    for seqs in steps:
        with startup_detail(f"warm-up {step_kind(seqs)}"):
            try:
                execute(prepare(list(seqs)))
            except Exception as exc:  # noqa: BLE001 - logged; serving can still go on
                logger.warning(
                    "warm-up step of %d sequence(s), %d token(s) failed (%s: %s); "
                    "its kernels compile on first use",
                    len(seqs),
                    sum(s.num_new_tokens for s in seqs),
                    type(exc).__name__,
                    exc,
                )
    torch.cuda.synchronize(device)
    logger.info(
        "warm-up: %d scratch steps (every kernel shape class) in %.2f s",
        len(steps),
        time.perf_counter() - start,
    )


def warm_up_forwards(
    prepare: Callable[[list[ScheduledSeqLike]], BatchInputs],
    execute: Callable[[BatchInputs], torch.Tensor],
    *,
    max_num_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    page_size: int,
) -> None:
    """Run the forward of each step of :func:`warmup_steps`, untimed, for a compile-only pass.

    What :func:`warm_up_kernels` runs, inside :func:`~backplane.core.compile_ahead.compile_only`
    so that its kernels compile side by side with the rest of the pass; a step
    that fails is logged and the others still run.

    :param prepare: the worker's input preparation (its runner's ``prepare_inputs``).
    :param execute: the worker's forward (plans the backends, runs the runner).
    :param max_num_tokens: most tokens in one step.
    :param max_num_seqs: most sequences in one step.
    :param max_model_len: the longest sequence.
    :param page_size: tokens per page.
    """
    steps = warmup_steps(
        max_num_tokens=max_num_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        page_size=page_size,
    )
    for seqs in steps:
        compile_ahead.attempt(
            f"the warm-up step of {len(seqs)} sequence(s)",
            lambda seqs=seqs: execute(prepare(list(seqs))),
        )


@torch.inference_mode()
def profile_step_peak(
    model: CausalLM,
    backends: Mapping[str, Backend],
    input_batch: InputBatch,
    sampler: Sampler,
    *,
    max_num_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    page_size: int,
    num_slots: int,
    dtype: torch.dtype,
    device: torch.device,
    ahead: bool = False,
) -> int:
    """The activation peak of the largest step, measured by running one.

    Binds a two-page cache to the model, runs a prefill of ``max_num_tokens``
    scratch tokens (all on the scratch page and state slot), then the LM head
    and a filtered sampling pass over ``max_num_seqs`` rows. The caller binds
    the real caches afterwards. With ``ahead``, where
    :func:`~backplane.core.compile_ahead.can_compile_ahead` allows it, the
    prefill and the LM head first run in a compile-only pass (before the
    measurement), so that their Triton kernels compile side by side.

    :param model: the loaded ``CausalLM``.
    :param backends: its backends (planned for the profiling batch).
    :param input_batch: the worker's input batch.
    :param sampler: the worker's sampler.
    :param max_num_tokens: tokens of the profiled step.
    :param max_num_seqs: sampled rows.
    :param max_model_len: the longest sequence (the step is split into sequences no longer).
    :param page_size: tokens per page.
    :param num_slots: recurrent-state slots of the caches.
    :param dtype: the caches' dtype.
    :param device: the CUDA device.
    :param ahead: compile the step's kernels ahead (see above).
    :return: bytes allocated at the peak beyond what was allocated before.
    """
    specs = model.cache_specs(num_pages=2, page_size=page_size, num_slots=num_slots, dtype=dtype)
    caches = {
        layer: {name: spec.allocate(device) for name, spec in layer_specs.items()}
        for layer, layer_specs in specs.items()
    }
    model.bind_caches(caches)
    seqs = scratch_prefill(max_num_tokens, max_model_len, page_size)[:max_num_seqs]
    if ahead and compile_ahead.can_compile_ahead():
        # the logits of a compile-only pass are not real: nothing is sampled from them
        compile_ahead.run_ahead(
            "the memory-profiling step",
            _largest_step_logits,
            model,
            backends,
            input_batch,
            seqs,
            max_num_seqs,
            detail=PROFILE_AHEAD_DETAIL,
        )
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    logits = _largest_step_logits(model, backends, input_batch, seqs, max_num_seqs)
    params = [SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01)] * max_num_seqs
    seeds = np.arange(max_num_seqs, dtype=np.int64)
    sampler.sample(logits, params, seeds, np.zeros(max_num_seqs, dtype=np.int64))
    del logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del caches
    return int(max(0, peak))


def _largest_step_logits(
    model: CausalLM,
    backends: Mapping[str, Backend],
    input_batch: InputBatch,
    seqs: list[ScratchSeq],
    rows: int,
) -> torch.Tensor:
    """The profiling step's forward over ``seqs`` and its LM head over ``rows`` rows.

    :return: ``[rows, vocab]`` logits (the last token's, repeated).
    """
    inputs = input_batch.prepare(seqs)
    with forward_context(inputs.metadata, plan_step(backends, inputs.metadata)):
        hidden = model(inputs.input_ids, inputs.positions)
    return model.compute_logits(hidden[-1:].expand(rows, -1))
