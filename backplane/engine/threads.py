"""The engine's CPU thread count: the cores this process may use, or the ``threads`` setting.

torch's intra-op pool (OpenMP) starts with one thread per core of the machine,
not per core this process is allowed to run on (``taskset``, a container's CPU
set), and every parallel region waits for its slowest thread: a thread on a core
another process holds stalls the whole product. The engine therefore sets the
count once at start-up, before the model is built, from ``EngineConfig.threads``
or the process's CPU affinity. How the threads wait (asleep, so that a busy
core costs little) is set before torch loads: :mod:`backplane.core.openmp`.
"""

from __future__ import annotations

import logging
import os

import torch

from backplane.core.openmp import WAIT_POLICY_VAR, wait_policy

logger = logging.getLogger(__name__)

#: whether the spinning-threads warning was given (once per process: it names the process's set-up)
_warned_spinning = False


def available_cores() -> int:
    """Return how many cores this process may run on.

    :return: the size of the process's CPU affinity set where the platform
        reports one (Linux), else ``os.cpu_count()``, and at least 1.
    """
    if hasattr(os, "sched_getaffinity"):
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except OSError:
            pass
    return max(1, os.cpu_count() or 1)


def resolve_threads(threads: int | None) -> int:
    """Return the thread count a ``threads`` setting means.

    :param threads: a positive count, or ``None`` for :func:`available_cores`.
    :return: the count.
    """
    return available_cores() if threads is None else int(threads)


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count for the engine (call once, at start-up).

    With ``threads`` unset, a count the application chose already
    (``torch.set_num_threads``) is kept when it fits the cores this process may
    use; only a count above them (torch's default on a machine whose cores are
    shared out by ``taskset`` or a container) is lowered.

    :param threads: ``EngineConfig.threads``: a positive count, or ``None`` for
        the cores this process may use.
    :return: the count now in effect (``torch.get_num_threads()``).
    """
    global _warned_spinning
    cores = available_cores()
    count = min(torch.get_num_threads(), cores) if threads is None else int(threads)
    if count > cores:
        logger.warning(
            "threads=%d but this process may use %d cores: threads that share a core wait "
            "for each other at every product; set threads to at most %d",
            count,
            cores,
            cores,
        )
    if count > 1 and wait_policy() == "unknown" and not _warned_spinning:
        _warned_spinning = True
        logger.warning(
            "torch was imported before backplane, so its OpenMP threads spin while they wait: "
            "with %d threads, a core taken by another process can slow every product tenfold "
            "or more; import backplane first or set %s=PASSIVE in the environment",
            count,
            WAIT_POLICY_VAR,
        )
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    logger.info("CPU threads: %d (%d cores available)", count, cores)
    return torch.get_num_threads()
