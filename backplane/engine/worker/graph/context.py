"""The phase a graph runner is in, held per runner rather than in globals."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from backplane.engine.worker.graph.capture import GraphPool


class GraphPhase(enum.Enum):
    """What a captured segment does when called.

    ``EAGER``: run the code. ``WARMUP``: run the code and record what capture
    needs (output shapes of dynamic ops). ``CAPTURE``: record a CUDA graph.
    ``REPLAY``: replay the graph recorded for the current bucket.
    """

    EAGER = "eager"
    WARMUP = "warmup"
    CAPTURE = "capture"
    REPLAY = "replay"


@dataclass
class GraphContext:
    """Shared state of one graph runner: phase, bucket, memory pool, statistics.

    :param phase: the current phase.
    :param bucket: the padded size being warmed up, captured or replayed.
    :param pool: the memory pool every graph and out buffer of the runner uses.
    :param pool_bytes: memory the pool grew by while capturing each bucket.
    :param cuda: capture real CUDA graphs (else segments run eagerly in every phase).
    """

    cuda: bool = False
    phase: GraphPhase = GraphPhase.EAGER
    bucket: int | None = None
    pool: GraphPool = None
    pool_bytes: dict[int, int] = field(default_factory=dict)
    #: data pointers of tensors produced by segments during the current capture pass
    produced: set[int] = field(default_factory=set)

    def enter(self, phase: GraphPhase, bucket: int | None) -> None:
        """Switch phase and bucket."""
        self.phase = phase
        self.bucket = bucket
