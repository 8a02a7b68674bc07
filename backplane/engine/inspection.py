"""Read access to what an engine's worker holds, for inspection.

The engine loop never holds the model, caches or runner; tests, benchmarks and
the API (a model's generation defaults, the chosen backends) still look at
them. :class:`WorkerView` gives them that view of the executor's driver worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from backplane.core.families import Backend
from backplane.engine.sampling import Sampler
from backplane.engine.worker.inputs import InputBatch

if TYPE_CHECKING:
    from backplane.engine.executor import Executor
    from backplane.engine.worker.device_worker import DeviceWorker
    from backplane.engine.worker.memory import KVBudget
    from backplane.engine.worker.runner import ModelRunner
    from backplane.models.base import CausalLM

__all__ = ["WorkerView"]


class WorkerView:
    """What the executor's driver worker holds, as attributes of the engine (read-only but
    :attr:`runner`, which a test may replace)."""

    executor: Executor

    @property
    def _worker(self) -> DeviceWorker:
        return self.executor.driver

    @property
    def model(self) -> CausalLM | None:
        """The worker's model (``None`` after :meth:`shutdown`)."""
        return self._worker.model

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (Any: whatever its checkpoint's loader made, HF or GGUF)."""
        return self._worker.tokenizer

    @property
    def model_config(self) -> Mapping[str, Any]:
        """The model's configuration (a ``ModelConfig``: values of any JSON type)."""
        return self._worker.model_config

    @property
    def backends(self) -> Mapping[str, Backend] | None:
        """``{family: backend}`` of the families the model uses (``None`` after shutdown)."""
        return self._worker.backends

    @property
    def caches(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """The worker's caches, ``{layer: {name: tensor}}`` (``None`` after shutdown)."""
        return self._worker.caches

    @property
    def runner(self) -> ModelRunner | None:
        """The worker's model runner (``None`` after shutdown)."""
        return self._worker.runner

    @runner.setter
    def runner(self, runner: ModelRunner) -> None:
        self._worker.runner = runner

    @property
    def input_batch(self) -> InputBatch | None:
        """The worker's persistent input batch (``None`` after shutdown)."""
        return self._worker.input_batch

    @property
    def sampler(self) -> Sampler | None:
        """The worker's :class:`~backplane.engine.sampling.Sampler` (``None`` after shutdown)."""
        return self._worker.sampler

    @property
    def kv_budget(self) -> KVBudget | None:
        """How the KV memory was sized on CUDA (``None`` when configured or on CPU)."""
        return self._worker.kv_budget
