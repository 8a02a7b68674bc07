"""Executors: how the engine loop reaches its worker(s).

The engine loop (:class:`~backplane.engine.engine.Engine`) schedules, commits
tokens and keeps the requests; everything on a device sits behind an
:class:`Executor`. :class:`InProcessExecutor` drives one
:class:`~backplane.engine.worker.device_worker.DeviceWorker` in this process.
A multi-process executor (one worker process per GPU, for tensor parallelism)
implements the same protocol by calling the same
:class:`~backplane.engine.worker.base.Worker` methods on every worker, in the
same order, and returning rank 0's results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

from backplane.engine.sampling import SamplerOutput, SamplingRows
from backplane.engine.worker.device_worker import DeviceWorker
from backplane.engine.worker.inputs import BatchInputs, ScheduledSeqLike

if TYPE_CHECKING:
    from backplane.core.registry import BackendRegistry
    from backplane.engine.config import EngineConfig
    from backplane.engine.kv_cache.host_tier import HostTier

__all__ = ["Executor", "InProcessExecutor", "create_executor"]


@runtime_checkable
class Executor(Protocol):
    """What the engine loop asks of its workers, whether they run here or in other processes.

    After construction the workers are ready: model loaded, caches allocated for
    :attr:`num_pages` pages, graphs captured, warm-up done.
    """

    #: the worker that answers for the model and the caches (rank 0 with several)
    driver: DeviceWorker
    #: KV pages every worker allocated (including the scratch page 0)
    num_pages: int

    def prepare_inputs(
        self, scheduled: Sequence[ScheduledSeqLike], pending_tokens: torch.Tensor | None = None
    ) -> BatchInputs:
        """Prepare a scheduled step on the worker(s): :meth:`Worker.prepare_inputs`.

        :param scheduled: the scheduler's sequences (prefill/extend first).
        :param pending_tokens: the in-flight step's tokens on the device, or ``None``.
        :return: the step's inputs (the driver's).
        """
        ...

    def execute_model(self, inputs: BatchInputs) -> torch.Tensor:
        """Run the model for a prepared step on the worker(s): :meth:`Worker.execute_model`.

        :param inputs: from :meth:`prepare_inputs`.
        :return: the driver's hidden states.
        """
        ...

    def sample_tokens(
        self, hidden: torch.Tensor, inputs: BatchInputs, rows: SamplingRows
    ) -> SamplerOutput:
        """Sample the step on the driver: :meth:`Worker.sample_tokens`.

        :param hidden: from :meth:`execute_model`.
        :param inputs: the step's inputs.
        :param rows: the sampling sequences' parameters.
        :return: tokens (and logprobs where asked) on the device.
        """
        ...

    def compute_logits(self, hidden: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """Project rows of the step's hidden states through the LM head on the worker(s):
        :meth:`DeviceWorker.compute_logits` (the rows a speculative verification scores).

        :param hidden: from :meth:`execute_model`.
        :param rows: ``[R]`` int64 row indices.
        :return: the driver's ``[R, vocab]`` logits.
        """
        ...

    def keep_verified_states(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Keep each verified sequence's recurrent state at its last accepted token on the
        worker(s): :meth:`DeviceWorker.keep_verified_states`.

        :param src_slots: ``[V]`` the slots holding the states to keep (driver's device).
        :param dst_slots: ``[V]`` the verifying sequences' own slots.
        """
        ...

    def check_results(self) -> None:
        """Raise if results the host read from the device since the last step may be wrong.

        Called once the host has a step's tokens, before it uses them. A rank that
        died in the middle of a step leaves the others' results undefined (an
        all-reduce given up on is not a sum); the step is refused and the engine ends.

        :raises EngineFailedError: the results cannot be used (naming the rank lost).
        """
        ...

    def mirror_host_tier(self, tier: HostTier) -> None:
        """Make every page copy of the host KV tier (built over the driver's caches) reach
        every worker, so each rank's cache shard moves the same pages.

        :param tier: the engine's host tier.
        """
        ...

    def shutdown(self) -> None:
        """Shut every worker down; idempotent."""
        ...


class InProcessExecutor:
    """An :class:`Executor` with one :class:`DeviceWorker` in this process.

    Runs the worker's start-up sequence (load the model, size and allocate the
    caches, capture graphs and warm up) and then forwards each call to it.

    :param config: the engine configuration.
    :param registry: the plugin registry backends are chosen from (the process-wide
        one if ``None``).
    :raises BackplaneError: a backend or the model cannot be loaded, or the KV
        memory holds fewer than two pages.
    """

    def __init__(self, config: EngineConfig, registry: BackendRegistry | None = None) -> None:
        worker = DeviceWorker(config, registry)
        worker.load_model()
        num_pages = worker.determine_num_kv_pages()
        worker.initialize_cache(num_pages)
        worker.compile_or_warm_up_model()
        self.driver = worker
        self.num_pages = num_pages

    def prepare_inputs(
        self, scheduled: Sequence[ScheduledSeqLike], pending_tokens: torch.Tensor | None = None
    ) -> BatchInputs:
        """See :meth:`Executor.prepare_inputs`."""
        return self.driver.prepare_inputs(scheduled, pending_tokens)

    def execute_model(self, inputs: BatchInputs) -> torch.Tensor:
        """See :meth:`Executor.execute_model`."""
        return self.driver.execute_model(inputs)

    def sample_tokens(
        self, hidden: torch.Tensor, inputs: BatchInputs, rows: SamplingRows
    ) -> SamplerOutput:
        """See :meth:`Executor.sample_tokens`."""
        return self.driver.sample_tokens(hidden, inputs, rows)

    def compute_logits(self, hidden: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """See :meth:`Executor.compute_logits`."""
        return self.driver.compute_logits(hidden, torch.from_numpy(rows).to(hidden.device))

    def keep_verified_states(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """See :meth:`Executor.keep_verified_states`."""
        self.driver.keep_verified_states(src_slots, dst_slots)

    def check_results(self) -> None:
        """Nothing to check: one worker's results depend on no other process."""

    def mirror_host_tier(self, tier: HostTier) -> None:
        """Nothing to do: the tier's copies move the only worker's pages (see the protocol)."""

    def shutdown(self) -> None:
        """See :meth:`Executor.shutdown`."""
        self.driver.shutdown()


def create_executor(config: EngineConfig, registry: BackendRegistry | None = None) -> Executor:
    """The executor the configuration asks for: the one place an engine's executor is chosen.

    ``tensor_parallel_size == 1`` runs one worker in this process
    (:class:`InProcessExecutor`); more ranks run one worker process per rank
    (``distributed_executor_backend="mp"``:
    :class:`~backplane.engine.distributed.multiproc.MultiprocExecutor`) or one
    Ray actor per rank (``"ray"``:
    :class:`~backplane.engine.distributed.ray_executor.RayExecutor`).

    :param config: the engine configuration.
    :param registry: the plugin registry backends are chosen from.
    :return: the started executor.
    :raises ConfigError: a combination the executors do not support.
    """
    from backplane.engine.worker.graph.compile_cache import configure_compile_caches

    # before any worker compiles a kernel; worker processes inherit the variables
    configure_compile_caches()
    if int(config.tensor_parallel_size) == 1:
        return InProcessExecutor(config, registry)
    from backplane.core.errors import ConfigError

    backend = config.distributed_executor_backend
    if backend == "mp":
        from backplane.engine.distributed.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, registry)
    if backend == "ray":
        from backplane.engine.distributed.ray_executor import RayExecutor

        return RayExecutor(config, registry)
    raise ConfigError(
        f"distributed_executor_backend={backend!r} has no executor here; use 'mp' or 'ray'"
    )
