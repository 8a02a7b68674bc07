"""The model runner seam: how the engine turns scheduled sequences into hidden states.

A :class:`ModelRunner` does two things per step:

1. :meth:`~ModelRunner.prepare_inputs` decides how the step runs -- its
   :class:`~backplane.core.metadata.StepMode`: eager, the decode graph of a
   batch-size bucket, or the piecewise graphs of a token-count bucket -- and
   prepares the step's inputs for that mode (padded to the bucket). The mode
   travels with the inputs (``inputs.mode``, the same value as
   ``inputs.metadata.mode``), so backends' ``plan`` and :meth:`~ModelRunner.run`
   read the decision instead of making it again.
2. :meth:`~ModelRunner.run` runs the model for the prepared step, dispatching on
   its mode. The engine calls it under the forward context (batch metadata
   plus every backend's plan).
3. :meth:`~ModelRunner.sample` turns the step's hidden states into one token
   per sampling sequence on the device (LM head and sampler; a graph runner
   replays both, captured, for decode-graph steps).

:class:`EagerModelRunner` runs every step eagerly;
:class:`backplane.engine.worker.graph.runner.GraphModelRunner` captures CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from backplane.engine.sampling import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingRows,
    compute_logprobs,
)
from backplane.engine.worker.inputs import BatchInputs, InputBatch, ScheduledSeqLike

__all__ = ["EagerModelRunner", "ModelRunner", "sample_eagerly"]


#: Bytes of float32 logits one LM-head pass over prompt-logprob rows may make: a long
#: prompt chunk's rows go through the LM head and ``log_softmax`` in slices of at most
#: ``PROMPT_LOGITS_BYTES // (vocab * 4)`` rows, so the step's peak stays near what the
#: memory profile measured (the sampling rows' logits) whatever the chunk's length.
PROMPT_LOGITS_BYTES = 256 * 2**20


def sample_eagerly(
    model: torch.nn.Module,
    sampler: Sampler,
    hidden: torch.Tensor,
    inputs: BatchInputs,
    rows: SamplingRows,
    logits: torch.Tensor | None = None,
) -> SamplerOutput:
    """Gather each sampling sequence's last hidden state, project it to logits, sample.

    Prompt positions whose logprobs are asked for (``rows.prompt``) join the
    same gather behind the sampling rows; their logits give the prompt
    logprobs (``log_softmax`` in float32, ``topk``), in slices when there are
    many (:data:`PROMPT_LOGITS_BYTES`).

    :param model: the ``CausalLM`` (its ``compute_logits`` is the LM head).
    :param sampler: the engine's sampler.
    :param hidden: the step's hidden states.
    :param inputs: the step's inputs (``logits_indices`` picks the rows).
    :param rows: what each sampling sequence samples, in ``logits_indices`` order.
    :param logits: logits of every hidden row when already computed (a decode
        graph's output); gathered instead of projecting again.
    :return: ``[len(rows)]`` int64 tokens on the device, with their logprobs where
        a row asks, and the prompt logprobs (no host synchronisation).
    """
    prompt = rows.prompt
    n = len(rows)
    m = 0 if prompt is None else len(prompt)
    empty = torch.empty(0, dtype=torch.int64, device=hidden.device)
    if not m:
        if not n:
            return SamplerOutput(empty)
        if logits is not None:
            logits = logits.index_select(0, inputs.logits_indices)
        else:
            logits = model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        return sampler.sample_rows(logits, rows)
    assert prompt is not None
    # one gather: the sampling rows, then the prompt rows
    index = torch.cat([inputs.logits_indices, prompt.indices])
    src = logits if logits is not None else hidden
    gathered = src.index_select(0, index)

    def head(x: torch.Tensor) -> torch.Tensor:
        return x if logits is not None else model.compute_logits(x)

    vocab = logits.shape[-1] if logits is not None else int(model.vocab_size)
    block = max(1, PROMPT_LOGITS_BYTES // (4 * vocab))
    if n + m <= block:  # the common case: one LM-head pass over every row
        projected = head(gathered)
        out = sampler.sample_rows(projected[:n], rows) if n else SamplerOutput(empty)
        lps = [compute_logprobs(projected[n:], prompt.targets, prompt.k)]
    else:  # slice by slice: each slice's logits are freed before the next is made
        out = sampler.sample_rows(head(gathered[:n]), rows) if n else SamplerOutput(empty)
        lps = [
            compute_logprobs(
                head(gathered[n + s : n + s + block]), prompt.targets[s : s + block], prompt.k
            )
            for s in range(0, m, block)
        ]
    out.prompt_logprobs = (
        lps[0]
        if len(lps) == 1
        else LogprobsTensors(
            torch.cat([p.token_ids for p in lps]),
            torch.cat([p.logprobs for p in lps]),
            torch.cat([p.ranks for p in lps]),
        )
    )
    return out


@runtime_checkable
class ModelRunner(Protocol):
    """What the engine needs from a model runner."""

    def prepare_inputs(self, scheduled: Sequence[ScheduledSeqLike]) -> BatchInputs:
        """Choose how the step runs and prepare its inputs for that.

        :param scheduled: the scheduler's sequences (prefill/extend first).
        :return: the step's inputs; ``inputs.mode`` says how :meth:`run` runs them.
        """
        ...

    def run(self, inputs: BatchInputs) -> torch.Tensor:
        """Run the model for a prepared step, under the engine's forward context.

        :param inputs: from :meth:`prepare_inputs`.
        :return: ``[padded_num_tokens, hidden]`` hidden states (valid until the next step).
        """
        ...

    def sample(
        self, hidden: torch.Tensor, inputs: BatchInputs, rows: SamplingRows
    ) -> SamplerOutput:
        """Sample one token per sampling sequence of the step just run.

        :param hidden: what :meth:`run` returned for ``inputs``.
        :param inputs: the step's inputs.
        :param rows: the sampling sequences' parameters, in ``inputs.logits_indices`` order.
        :return: ``[len(rows)]`` int64 tokens on the device (valid until the next step)
            and their logprobs where a row asks.
        """
        ...

    def capture(self) -> None:
        """Capture whatever the runner replays later (once, before the first step)."""
        ...

    def memory_report(self) -> dict[str, int | dict[int, int]]:
        """Device memory the runner holds beyond the model and caches, in bytes."""
        ...

    def release(self) -> None:
        """Drop everything captured (graphs, pools, compiled code); the runner is done."""
        ...


class EagerModelRunner:
    """Runs every step eagerly: no capture, no padding unless :meth:`padded_num_tokens` asks.

    :param model: the loaded ``CausalLM``.
    :param input_batch: the engine's persistent :class:`~backplane.engine.worker.inputs.InputBatch`.
    :param sampler: the sampler (default: a new :class:`Sampler`; it is stateless).
    """

    def __init__(
        self, model: torch.nn.Module, input_batch: InputBatch, sampler: Sampler | None = None
    ) -> None:
        self.model = model
        self.input_batch = input_batch
        self.sampler = sampler if sampler is not None else Sampler()

    def padded_num_tokens(self, num_tokens: int, num_seqs: int, is_decode_only: bool) -> int:
        """Return the token count to pad a step to (no padding).

        A runner that pads eager steps (to exercise padding without graphs)
        overrides this.

        :param num_tokens: real tokens of the step.
        :param num_seqs: sequences of the step.
        :param is_decode_only: whether every sequence decodes one token.
        :return: the padded token count, at least ``num_tokens``.
        """
        return num_tokens

    def prepare_inputs(self, scheduled: Sequence[ScheduledSeqLike]) -> BatchInputs:
        """Prepare an eager step, padded as :meth:`padded_num_tokens` says.

        :param scheduled: the scheduler's sequences (prefill/extend first).
        :return: the step's inputs (mode eager).
        """
        num_tokens = 0
        num_decode = 0
        for s in scheduled:  # O(1) per sequence
            num_tokens += s.num_new_tokens
            num_decode += s.num_new_tokens == 1 and s.num_cached_tokens > 0
        n = len(scheduled)
        padded = self.padded_num_tokens(num_tokens, n, n > 0 and num_decode == n)
        if padded == num_tokens:
            return self.input_batch.prepare(scheduled)
        return self.input_batch.prepare(scheduled, padded_num_tokens=padded)

    @torch.inference_mode()
    def run(self, inputs: BatchInputs) -> torch.Tensor:
        """Run the model forward op by op.

        :param inputs: the prepared step inputs.
        :return: ``[padded_num_tokens, hidden]`` hidden states.
        """
        return self.model(inputs.input_ids, inputs.positions)

    @torch.inference_mode()
    def sample(
        self, hidden: torch.Tensor, inputs: BatchInputs, rows: SamplingRows
    ) -> SamplerOutput:
        """LM head and sampler, op by op (see :func:`sample_eagerly`)."""
        return sample_eagerly(self.model, self.sampler, hidden, inputs, rows)

    def capture(self) -> None:
        """Nothing to capture."""

    def memory_report(self) -> dict[str, int | dict[int, int]]:
        """No graph memory: ``{"total": 0}``."""
        return {"total": 0}

    def release(self) -> None:
        """Nothing captured to drop."""
