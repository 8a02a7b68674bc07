"""The CUDA-graph mode of a worker: decided once, at start-up, and read everywhere after.

The user's ``cuda_graphs`` setting (``EngineConfig.cuda_graphs``, parsed and
checked by the configuration) says what is wanted; :func:`decide_graph_mode`
turns it into the :class:`GraphMode` the worker runs with, from the device and
the capabilities its selected backends declare. The memory planner sizes the
graphs' share from that value and the graph runner captures what it says;
neither decides again. Per step, the runner picks a
:class:`~backplane.core.metadata.StepMode` within this mode (a captured bucket,
or eager), which travels with the step's inputs.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping

import torch

from backplane.core.backend_spec import BackendSpec

logger = logging.getLogger(__name__)

__all__ = ["CUDA_GRAPH_CAPABILITY", "GraphMode", "decide_graph_mode"]

#: The capability a backend declares (``BackendSpec.capabilities``) when its ops may be
#: captured in a CUDA graph.
CUDA_GRAPH_CAPABILITY = "cuda_graph"


class GraphMode(str, enum.Enum):
    """Which CUDA graphs a worker captures and replays.

    The values are the configuration's spellings, so a mode compares equal to
    the string the user wrote.
    """

    #: every step eagerly
    OFF = "off"
    #: monolithic graphs for decode-only steps (forward, LM head, sampling)
    DECODE = "decode"
    #: piecewise graphs (split at the backends' dynamic ops) for every step
    PIECEWISE = "piecewise"
    #: both: decode graphs for decode-only steps, piecewise graphs for the rest
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @property
    def has_decode(self) -> bool:
        """Whether decode-only steps replay monolithic decode graphs."""
        return self in (GraphMode.DECODE, GraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise(self) -> bool:
        """Whether steps run through piecewise graphs."""
        return self in (GraphMode.PIECEWISE, GraphMode.FULL_AND_PIECEWISE)

    @property
    def captures(self) -> bool:
        """Whether any graph is captured."""
        return self is not GraphMode.OFF


def decide_graph_mode(
    requested: str | None, device: torch.device, specs: Mapping[str, BackendSpec]
) -> GraphMode:
    """Decide the worker's CUDA-graph mode: the one place this is decided.

    * Not on a CUDA device: :attr:`GraphMode.OFF` (a mode asked for is ignored,
      with a warning, as graphs need CUDA).
    * ``None`` (not set): :attr:`GraphMode.FULL_AND_PIECEWISE` on CUDA.
    * A selected backend whose spec does not declare the ``cuda_graph``
      capability: :attr:`GraphMode.OFF`, with one warning naming it, since its
      ops could otherwise be captured into a graph they cannot replay in.

    :param requested: the configured ``cuda_graphs`` value (already checked to be
        one of the mode names, or ``None``).
    :param device: the worker's device.
    :param specs: ``{family: spec}`` of the backends selected for the model.
    :return: the mode the worker captures and runs with.
    :raises ValueError: ``requested`` names no mode.
    """
    wanted = GraphMode.FULL_AND_PIECEWISE if requested is None else GraphMode(requested)
    if device.type != "cuda":
        if requested is not None and wanted is not GraphMode.OFF:
            logger.warning(
                "cuda_graphs=%s ignored: device %s is not CUDA; running eagerly",
                wanted.value,
                device,
            )
        return GraphMode.OFF
    if wanted is GraphMode.OFF:
        return wanted
    unfit = sorted(
        f"{family}={spec.name}"
        for family, spec in specs.items()
        if CUDA_GRAPH_CAPABILITY not in spec.capabilities
    )
    if unfit:
        logger.warning(
            "cuda_graphs=%s turned off: backend(s) %s do not declare the %r capability, "
            "so their ops cannot be captured; running eagerly",
            wanted.value,
            ", ".join(unfit),
            CUDA_GRAPH_CAPABILITY,
        )
        return GraphMode.OFF
    return wanted
