"""Monolithic CUDA graphs of the whole forward for decode-only batches."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from backplane.engine.worker.graph.capture import (
    CapturedGraph,
    GraphPool,
    GraphValues,
    Progress,
    capture,
    capture_buckets,
    new_pool,
)


class DecodeGraphs:
    """One captured graph of ``forward_fn`` per decode batch-size bucket.

    A decode step is replayed at the smallest bucket holding its sequences;
    the input preparation pads the batch with sequences that point at the
    scratch page and state slot, so padding rows touch no live data.

    :param forward_fn: the computation to capture (model forward and LM head).
    :param buckets: batch sizes to capture.
    :param pool: a memory pool shared with the piecewise graphs (default: new).
    :param cuda: record real CUDA graphs (default: when CUDA is available);
        otherwise eager stand-ins with the same phases.
    """

    def __init__(
        self,
        forward_fn: Callable[..., Any],
        buckets: list[int],
        pool: GraphPool = None,
        cuda: bool | None = None,
    ) -> None:
        self.forward_fn = forward_fn
        self.buckets = sorted(buckets)
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.pool = pool if pool is not None else (new_pool() if self.cuda else None)
        self.graphs: dict[int, CapturedGraph] = {}
        self.failed: dict[int, str] = {}
        self.pool_bytes: dict[int, int] = {}

    def capture(
        self,
        make_inputs: Callable[[int], AbstractContextManager[tuple[Any, ...]]],
        postprocess_fn: Callable[..., None] | None = None,
        progress: Progress = None,
    ) -> None:
        """Capture every bucket, largest first.

        :param make_inputs: ``make_inputs(bucket)`` prepares a padded decode
            batch in the persistent buffers (and sets its forward context) and
            yields the forward's arguments.
        :param postprocess_fn: restores inputs the forward mutates (see
            :func:`backplane.engine.worker.graph.capture.capture`).
        :param progress: an optional tqdm-like bar, advanced once per bucket.
        """

        def capture_one(bucket: int) -> None:
            with make_inputs(bucket) as args:
                self.graphs[bucket] = capture(
                    self.forward_fn, postprocess_fn, args, pool=self.pool, cuda=self.cuda
                )

        capture_buckets(
            self.buckets,
            capture_one,
            pool=self.pool,
            label="decode batch",
            failed=self.failed,
            grown=self.pool_bytes,
            progress=progress,
        )

    def has(self, bucket: int) -> bool:
        """True when ``bucket`` was captured."""
        return bucket in self.graphs

    def replay(self, bucket: int) -> GraphValues:
        """Replay the graph of ``bucket`` and return its outputs (valid until the next replay).

        :raises KeyError: ``bucket`` was not captured (or its capture failed).
        """
        graph = self.graphs.get(bucket)
        if graph is None:
            raise KeyError(
                f"decode graph of batch {bucket} is not captured (captured: "
                f"{sorted(self.graphs)}); run such steps eagerly"
            )
        return graph.replay()
