"""One device's half of the engine: model, caches, input buffers, runner, graphs, sampler.

Rooms: :mod:`~backplane.engine.worker.base` (the typed :class:`Worker` interface
an executor calls), :mod:`~backplane.engine.worker.device_worker` (its
implementation), :mod:`~backplane.engine.worker.inputs` (the persistent input
batch), :mod:`~backplane.engine.worker.runner` (the model-runner seam, eager),
:mod:`~backplane.engine.worker.graph` (CUDA graphs and the graph mode),
:mod:`~backplane.engine.worker.memory` (KV memory planning) and
:mod:`~backplane.engine.worker.warmup` (the start-up scratch steps).
Tensor-parallel collectives belong here too, inside the worker of each rank.
"""

from backplane.engine.worker.base import Worker

__all__ = ["Worker"]
