"""The worker interface: what the engine asks of one device's half.

A worker owns everything that lives on one device: the model with its
selected backends, the KV and recurrent-state caches, the persistent input
buffers, the model runner (eager or CUDA graphs) and the sampler. The engine
loop (:mod:`backplane.engine.engine`) never touches those directly; it goes
through an executor (:mod:`backplane.engine.executor`), which calls these
methods on its worker(s).

Start-up, in this order (the names follow vLLM's v1 worker):

1. :meth:`Worker.load_model` -- select backends, build the model, decide the
   CUDA-graph mode;
2. :meth:`Worker.determine_num_kv_pages` -- profile the largest step (CUDA) and
   turn the memory left into KV pages;
3. :meth:`Worker.initialize_cache` -- allocate and bind the caches for an agreed
   page count (the smallest over the workers, with several);
4. :meth:`Worker.compile_or_warm_up_model` -- capture graphs, run the warm-up steps.

Per step: :meth:`Worker.prepare_inputs`, :meth:`Worker.execute_model`,
:meth:`Worker.sample_tokens`. Then :meth:`Worker.shutdown`.

The in-process executor calls these methods directly on one worker; an
executor that runs one worker process per GPU (tensor parallelism) calls the
same methods on every worker, with the collectives inside the workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from backplane.core.families import Backend
from backplane.engine.sampling import SamplerOutput, SamplingRows
from backplane.engine.worker.graph.mode import GraphMode
from backplane.engine.worker.inputs import BatchInputs, ScheduledSeqLike

__all__ = ["ModelFacts", "Worker"]


class ModelFacts(Protocol):
    """What the engine loop needs to know of the loaded model (fixed after loading)."""

    #: tokens of the vocabulary (ids are checked against it)
    vocab_size: int
    #: the longest sequence served: the configured limit within the model's own
    max_model_len: int
    #: ids that end a sequence unless the request ignores EOS
    eos_token_ids: tuple[int, ...]
    #: whether some layer keeps recurrent state (SSM, conv, delta): one slot per sequence
    has_recurrent_state: bool


@runtime_checkable
class Worker(ModelFacts, Protocol):
    """One device's half of the engine (see the module docstring for the call order)."""

    #: the worker's device
    device: torch.device
    #: the CUDA-graph mode decided in :meth:`load_model`
    graph_mode: GraphMode
    #: ``{family: backend}`` of the families the model uses (after :meth:`load_model`)
    backends: Mapping[str, Backend]

    def load_model(self) -> None:
        """Select backends, build the model with them and decide the graph mode.

        :raises BackplaneError: a backend is unknown or unavailable, the model cannot
            be loaded.
        """
        ...

    def determine_num_kv_pages(self) -> int:
        """Pages (including the scratch page 0) the KV memory of this worker holds.

        On CUDA without a configured size this runs one profiling step.

        :return: the page count.
        :raises OutOfKVMemoryError: fewer than two pages fit.
        """
        ...

    def initialize_cache(self, num_pages: int) -> None:
        """Allocate the caches for ``num_pages`` pages and bind them to the model.

        :param num_pages: the page count every worker of the engine uses.
        """
        ...

    def paged_cache_tensors(self) -> list[torch.Tensor]:
        """The paged cache tensors (first dimension counts pages), for a host tier.

        :return: one tensor per paged cache, in a fixed order.
        """
        ...

    def compile_or_warm_up_model(self) -> None:
        """Build the model runner, capture its graphs and run the warm-up steps (CUDA)."""
        ...

    def prepare_inputs(
        self, scheduled: Sequence[ScheduledSeqLike], pending_tokens: torch.Tensor | None = None
    ) -> BatchInputs:
        """Decide how the step runs and prepare its inputs on the device.

        :param scheduled: the scheduler's sequences (prefill/extend first, decode last).
        :param pending_tokens: the tokens of the step still in flight, on the device;
            a sequence whose last token is a placeholder reads it from there.
        :return: the step's inputs.
        """
        ...

    def execute_model(self, inputs: BatchInputs) -> torch.Tensor:
        """Plan every backend once and run the model for a prepared step.

        :param inputs: from :meth:`prepare_inputs`.
        :return: the hidden states of every (padded) token, on the device.
        """
        ...

    def sample_tokens(
        self, hidden: torch.Tensor, inputs: BatchInputs, rows: SamplingRows
    ) -> SamplerOutput:
        """Sample one token per sampling sequence of the step just run.

        :param hidden: what :meth:`execute_model` returned.
        :param inputs: the step's inputs.
        :param rows: the sampling sequences' parameters, in ``inputs.logits_indices`` order.
        :return: the tokens (and logprobs where asked) on the device.
        """
        ...

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Project some rows of the step's hidden states through the LM head (the rows a
        speculative verification scores).

        :param hidden: what :meth:`execute_model` returned.
        :param rows: ``[R]`` int64 row indices into ``hidden``, on its device.
        :return: ``[R, vocab]`` logits.
        """
        ...

    def keep_verified_states(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """After a speculative verification, copy each verified sequence's recurrent state
        at its last accepted token into its own slot (nothing without recurrent state).

        :param src_slots: ``[V]`` the slots holding the states to keep.
        :param dst_slots: ``[V]`` the verifying sequences' own slots.
        """
        ...

    def shutdown(self) -> None:
        """Release the model, caches, graphs and buffers; idempotent."""
        ...
