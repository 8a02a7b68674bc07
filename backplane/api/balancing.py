"""Which engine replica runs a request: the one with the fewest live requests.

A replica's load is the number of requests assigned to it that have not
finished: running, waiting for admission, or still queued for its engine loop.
Counting them here, at assignment, rather than reading the replicas' last
snapshots, sees the requests a burst has just assigned, so a burst of
submissions spreads instead of piling onto the replica that looked idle a step
ago. Ties go round-robin, starting after the replica chosen last.
"""

from __future__ import annotations

import threading

from backplane.core.errors import InvalidFieldError

__all__ = ["LoadBalancer"]


class LoadBalancer:
    """Assigns requests to replicas by load (fewest live requests; ties round-robin).

    Safe to call from any thread.

    :param num_replicas: how many replicas there are (at least 1).
    :raises ValueError: ``num_replicas`` is below 1.
    """

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"a balancer needs at least one replica, got {num_replicas}")
        self._loads = [0] * num_replicas
        self._owners: dict[str, int] = {}
        self._next = 0  # where the round-robin among equally loaded replicas starts
        self._lock = threading.Lock()

    @property
    def num_replicas(self) -> int:
        """How many replicas requests are spread over."""
        return len(self._loads)

    def loads(self) -> list[int]:
        """The live requests of each replica, in replica order.

        :return: one count per replica.
        """
        with self._lock:
            return list(self._loads)

    def assign(self, request_id: str) -> int:
        """Choose the replica for a new request and count it there until :meth:`release`.

        :param request_id: the request's id, unique among live requests.
        :return: the replica's index.
        :raises InvalidFieldError: a live request already has this id.
        """
        with self._lock:
            if request_id in self._owners:
                raise InvalidFieldError(
                    f"request id {request_id!r} is already in use (a request keeps its id until "
                    "its final output was returned, aborted ones too); pass a unique request_id",
                    field="request_id",
                )
            n = len(self._loads)
            order = [(self._next + k) % n for k in range(n)]
            chosen = min(order, key=lambda i: self._loads[i])  # min keeps the first of a tie
            self._loads[chosen] += 1
            self._owners[request_id] = chosen
            self._next = (chosen + 1) % n
            return chosen

    def owner(self, request_id: str) -> int | None:
        """The replica a live request was assigned to.

        :param request_id: the request's id.
        :return: the replica's index, or ``None`` when no live request has this id.
        """
        with self._lock:
            return self._owners.get(request_id)

    def release(self, request_id: str) -> None:
        """Stop counting a request (it finished, was aborted or was refused).

        Releasing an id that is not live does nothing, so a request may be
        released by whichever of its ends comes first.

        :param request_id: the request's id.
        """
        with self._lock:
            replica = self._owners.pop(request_id, None)
            if replica is not None:
                self._loads[replica] -= 1
