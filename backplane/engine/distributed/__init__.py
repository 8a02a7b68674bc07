"""Tensor parallelism: one worker per rank, driven by the engine through an executor.

:class:`~.multiproc.MultiprocExecutor` starts ranks ``1..N-1`` as processes on
this machine (:mod:`.worker_proc` is their entry point) and keeps rank 0 in the
engine's process; :mod:`.group` sets up the torch.distributed group the
model's layers shard over; :mod:`.messages` is what goes down the pipes;
:class:`~.errors.WorkerFailedError` is how a failed rank ends the engine.
"""

from backplane.engine.distributed.errors import WorkerFailedError

__all__ = ["WorkerFailedError"]
