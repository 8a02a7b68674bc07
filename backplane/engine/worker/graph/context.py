"""The phase a graph runner is in, held per runner rather than in globals."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from backplane.engine.worker.graph.capture import GraphPool


class GraphPhase(enum.Enum):
    """What a piecewise runner is doing.

    ``EAGER``: running the code. ``WARMUP``: running a bucket once before its
    capture (kernels compile, lazy state is made). ``CAPTURE``: recording the
    bucket's graphs. ``REPLAY``: replaying the current bucket.
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

    def enter(self, phase: GraphPhase, bucket: int | None) -> None:
        """Switch phase and bucket."""
        self.phase = phase
        self.bucket = bucket
