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

:class:`EagerModelRunner` runs every step eagerly;
:class:`backplane.engine.graph.runner.GraphModelRunner` captures CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from backplane.engine.inputs import BatchInputs, InputBatch, ScheduledSeqLike

__all__ = ["EagerModelRunner", "ModelRunner"]


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

    def capture(self) -> None:
        """Capture whatever the runner replays later (once, before the first step)."""
        ...

    def memory_report(self) -> dict[str, Any]:
        """Device memory the runner holds beyond the model and caches, in bytes."""
        ...


class EagerModelRunner:
    """Runs every step eagerly: no capture, no padding unless :meth:`padded_num_tokens` asks.

    :param model: the loaded ``CausalLM``.
    :param input_batch: the engine's persistent :class:`~backplane.engine.inputs.InputBatch`.
    """

    def __init__(self, model: torch.nn.Module, input_batch: InputBatch) -> None:
        self.model = model
        self.input_batch = input_batch

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

    def capture(self) -> None:
        """Nothing to capture."""

    def memory_report(self) -> dict[str, Any]:
        """No graph memory: ``{"total": 0}``."""
        return {"total": 0}
