"""The error a failed tensor-parallel worker process ends its engine with."""

from __future__ import annotations

from backplane.core.errors import EngineFailedError

__all__ = ["WorkerFailedError"]


class WorkerFailedError(EngineFailedError):
    """A tensor-parallel worker process died or raised; the engine cannot go on.

    :param rank: the worker's rank in its tensor-parallel group.
    :param what: what happened (``"died (exit code -9)"``, ``"raised ..."``).
    """

    def __init__(self, rank: int, what: str) -> None:
        super().__init__(
            f"tensor-parallel worker rank {rank} {what}; the engine has stopped and its "
            "worker processes were ended. Check the log above for the worker's error "
            "(out of memory, a device fault) and start a new engine"
        )
        self.rank = rank
