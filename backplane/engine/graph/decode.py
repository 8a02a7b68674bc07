"""Monolithic CUDA graphs of the whole forward for decode-only batches."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from backplane.engine.graph.capture import CapturedGraph, capture, new_pool, pool_bytes

logger = logging.getLogger(__name__)


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
        pool: Any = None,
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
        progress: Any = None,
    ) -> None:
        """Capture every bucket, largest first.

        :param make_inputs: ``make_inputs(bucket)`` prepares a padded decode
            batch in the persistent buffers (and sets its forward context) and
            yields the forward's arguments.
        :param postprocess_fn: restores inputs the forward mutates (see
            :func:`backplane.engine.graph.capture.capture`).
        :param progress: an optional tqdm-like bar, advanced once per bucket.
        """
        for bucket in sorted(self.buckets, reverse=True):
            before = pool_bytes(self.pool)
            try:
                with make_inputs(bucket) as args:
                    self.graphs[bucket] = capture(
                        self.forward_fn, postprocess_fn, args, pool=self.pool, cuda=self.cuda
                    )
            except Exception as exc:  # that bucket runs eagerly; the others still replay
                self.failed[bucket] = f"{type(exc).__name__}: {exc}"
                logger.warning(
                    "decode graph capture of batch %d failed, it will run eagerly: %s", bucket, exc
                )
            self.pool_bytes[bucket] = pool_bytes(self.pool) - before
            if progress is not None:
                progress.set_postfix_str(
                    f"decode batch {bucket}, pool {pool_bytes(self.pool) / 2**20:.1f} MiB"
                )
                progress.update(1)

    def has(self, bucket: int) -> bool:
        """True when ``bucket`` was captured."""
        return bucket in self.graphs

    def replay(self, bucket: int) -> Any:
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
