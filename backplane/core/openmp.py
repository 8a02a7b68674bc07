"""How torch's OpenMP threads wait between parallel regions: asleep, not spinning.

By default the OpenMP runtime torch ships (GNU ``libgomp``) keeps a thread
that waits at a barrier spinning on its core. When another process takes one
of the cores, the spinning thread keeps its own core busy while the thread it
waits for queues behind that process; every parallel region then lasts about a
scheduler time slice. On two cores with one of them busy, batch-1 decode of a
SmolLM2-135M-sized model fell from 18-23 to 0.6 tokens/s with 2 threads; with
``OMP_WAIT_POLICY=PASSIVE`` it ran at 16 tokens/s busy and 17-21 idle
(``docs/benchmarks/cpu.md``).

The runtime reads its settings once, when torch loads it, so
:func:`prefer_passive_waiting` runs on ``import backplane``, before torch is
imported; it only sets a default, and an ``OMP_WAIT_POLICY`` already in the
environment wins. This module must not import torch.
"""

from __future__ import annotations

import os
import sys

#: the OpenMP setting of how waiting threads behave (``ACTIVE`` spins, ``PASSIVE`` sleeps)
WAIT_POLICY_VAR = "OMP_WAIT_POLICY"

#: what the runtime was told when it loaded, as far as this process can know (see
#: :func:`wait_policy`); ``None`` until :func:`prefer_passive_waiting` runs
_policy_at_load: str | None = None


def prefer_passive_waiting() -> str:
    """Make idle OpenMP threads sleep rather than spin, if torch is not loaded yet.

    :return: the policy the OpenMP runtime will use: the environment's
        ``OMP_WAIT_POLICY`` (``PASSIVE`` unless the user set another), or
        ``"unknown"`` when torch was imported first (its runtime has read its
        settings already and ``OMP_WAIT_POLICY`` is not set).
    """
    global _policy_at_load
    if "torch" in sys.modules:
        # the runtime read its environment when torch loaded; a value set now has no
        # effect, and one found now was most likely there at that time (exported)
        if _policy_at_load is None:
            _policy_at_load = os.environ.get(WAIT_POLICY_VAR, "").strip().upper() or "unknown"
        return _policy_at_load
    _policy_at_load = os.environ.setdefault(WAIT_POLICY_VAR, "PASSIVE").strip().upper()
    return _policy_at_load


def wait_policy() -> str:
    """Return the wait policy the OpenMP runtime was loaded with, as recorded on ``import backplane``.

    :return: ``"PASSIVE"``, another value the user set, or ``"unknown"`` when
        torch was imported before backplane without ``OMP_WAIT_POLICY`` set
        (then the runtime's default, spinning, applies).
    """
    return _policy_at_load or prefer_passive_waiting()
