"""What the driver sends its worker processes, and how device tensors travel in it.

Commands go down one pipe per worker as ``(name, argument)`` pairs; the names
are the constants below. Start-up commands are answered (``("ok", value)``);
step commands are not, so a step costs the driver one send per worker. A worker
that fails answers ``("error", message)`` on its pipe and exits.

Device tensors cannot go through a pipe cheaply (CUDA IPC), and the workers
have devices of their own: :func:`to_portable` replaces each device tensor of a
message by a host copy marked :class:`OnDevice`, and :func:`from_portable` puts
those back on the receiving rank's device (host tensors stay on the host).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ADOPT_STEP",
    "EXECUTE",
    "HOST_COPY",
    "HOST_TIER",
    "KEEP_STATES",
    "LOAD",
    "SAMPLE",
    "SHUTDOWN",
    "START",
    "VERIFY_LOGITS",
    "OnDevice",
    "from_portable",
    "to_portable",
]

#: load the model and measure the KV pages it can hold (answered with the page count)
LOAD = "load"
#: allocate the caches for the agreed page count, capture graphs, warm up (answered)
START = "start"
#: take over the step the driver prepared: ``(StepPacket, host bytes)``
ADOPT_STEP = "adopt_step"
#: run the model for the adopted step; the argument is the driver's description of the
#: step's speculative verification states (``VerifyStates``, portable) or ``None``
EXECUTE = "execute"
#: run the sampling head for the step (its LM head may hold collectives): ``SamplingRows``
SAMPLE = "sample"
#: project rows of the step's hidden states through the LM head (its collectives):
#: ``[R]`` int64 row indices (numpy)
VERIFY_LOGITS = "verify_logits"
#: keep the verified sequences' recurrent states: ``(src_slots, dst_slots)``, portable
KEEP_STATES = "keep_states"
#: build a host KV tier of this many pages over the rank's paged caches
HOST_TIER = "host_tier"
#: repeat a copy of the driver's host tier: ``(src_pages, dst_pages, to_host)``
HOST_COPY = "host_copy"
#: release everything and exit (answered)
SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class OnDevice:
    """A device tensor of a message, carried as a host copy.

    :param tensor: the host copy.
    """

    tensor: torch.Tensor


# Any: messages are dataclasses, tuples and lists of arbitrary fields
def to_portable(obj: Any) -> Any:
    """``obj`` with every non-CPU tensor in it replaced by an :class:`OnDevice` host copy.

    :param obj: a tensor, a (frozen) dataclass, tuple, list or dict of them, or anything else.
    :return: the same structure, sharing what needed no copy.
    """
    if isinstance(obj, torch.Tensor):
        return OnDevice(obj.cpu()) if obj.device.type != "cpu" else obj
    return _map(obj, to_portable)


def from_portable(obj: Any, device: torch.device) -> Any:
    """Undo :func:`to_portable` on the receiving rank: :class:`OnDevice` tensors go to ``device``.

    :param obj: what :func:`to_portable` made (after the pipe).
    :param device: the receiving rank's device.
    :return: the structure with the marked tensors on ``device``.
    """
    if isinstance(obj, OnDevice):
        return obj.tensor.to(device)
    return _map(obj, lambda x: from_portable(x, device))


def _map(obj: Any, fn: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            value = getattr(obj, f.name)
            new = fn(value)
            if new is not value:
                changes[f.name] = new
        return dataclasses.replace(obj, **changes) if changes else obj
    if isinstance(obj, tuple):
        items = tuple(fn(x) for x in obj)
        changed = any(a is not b for a, b in zip(items, obj, strict=True))
        if not changed:
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else items
    if isinstance(obj, list):
        return [fn(x) for x in obj]
    if isinstance(obj, dict):
        return {k: fn(v) for k, v in obj.items()}
    return obj
