"""The per-step context that cached ops read their batch metadata from.

Cached ops are custom ops whose arguments are only the layer's tensors, its
caches, a few per-layer constants and ``out``. The batch they operate on, and
the per-step plan each backend made for it, come from here: the executor sets
the context once per step, outside any CUDA graph, before running the model.
This keeps per-step values out of traced graphs (where they would be frozen as
constants) and keeps host values on the host.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from backplane.core.families import Backend, BackendPlan
from backplane.core.metadata import BatchMetadata

_local = threading.local()


@dataclass
class ForwardContext:
    """What cached ops see during one step.

    :param batch: the step's batch metadata.
    :param plans: per-family results of ``backend.plan(batch)``.
    """

    batch: BatchMetadata
    plans: dict[str, BackendPlan] = field(default_factory=dict)

    def plan(self, family: str) -> BackendPlan:
        """Return the plan the ``family`` backend made for this step (or ``None``)."""
        return self.plans.get(family)


def get_forward_context() -> ForwardContext:
    """Return the active context.

    :raises RuntimeError: when a cached op runs outside :func:`forward_context`.
    """
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError(
            "a backplane cached op ran outside forward_context(); set the batch metadata first"
        )
    return ctx


def has_forward_context() -> bool:
    """Return True inside :func:`forward_context`."""
    return getattr(_local, "ctx", None) is not None


@contextlib.contextmanager
def forward_context(
    batch: BatchMetadata, plans: Mapping[str, BackendPlan] | None = None
) -> Iterator[ForwardContext]:
    """Make ``batch`` (and the backends' plans) visible to cached ops.

    :param batch: the step's metadata.
    :param plans: ``{family: plan}``, usually from :func:`plan_step`.
    :return: a context manager yielding the :class:`ForwardContext`.
    """
    prev = getattr(_local, "ctx", None)
    _local.ctx = ForwardContext(batch=batch, plans=dict(plans or {}))
    try:
        yield _local.ctx
    finally:
        _local.ctx = prev


def plan_step(backends: Mapping[str, Backend], batch: BatchMetadata) -> dict[str, BackendPlan]:
    """Call ``plan(batch)`` once on each selected backend.

    :param backends: ``{family: backend object}``.
    :param batch: the step's metadata.
    :return: ``{family: plan}`` for :func:`forward_context`.
    """
    return {family: backend.plan(batch) for family, backend in backends.items()}
