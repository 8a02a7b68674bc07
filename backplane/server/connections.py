"""Connection guards for uvicorn: a request-head timeout and a cap on open connections.

uvicorn's h11 protocol waits for a request head as long as the client keeps
the connection open, so a client that sends half a head and stops holds a
descriptor (and a place among the open connections) for ever, and enough of
them exhaust the process's descriptors. :class:`GuardedH11Protocol` closes a
connection whose request head is not complete ``head_timeout`` seconds after
its first byte (or after the connection opened), and answers a connection
beyond ``max_connections`` with a 503 and closes it at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_HEAD_TIMEOUT",
    "GuardedH11Protocol",
    "default_max_connections",
    "guarded_h11_protocol",
]

#: Seconds a client has to send a whole request head (request line and headers).
DEFAULT_HEAD_TIMEOUT = 10.0

#: Seconds between two warnings about refused connections (a flood would flood the log).
_WARN_EVERY = 5.0
_last_warning = [float("-inf")]


def default_max_connections() -> int:
    """Half the process's open-file limit (``RLIMIT_NOFILE``), between 64 and 8192.

    The other half is left to the model files, the engine and the listening socket.

    :return: the default cap on open connections.
    """
    try:
        import resource
    except ImportError:  # not a POSIX system: no descriptor limit to read
        return 8192
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 8192
    return max(64, min(8192, int(soft) // 2))


def _refusal(max_connections: int) -> bytes:
    """A whole HTTP response: 503 with OpenAI's error body, closing the connection."""
    body = json.dumps(
        {
            "error": {
                "message": f"the server has {max_connections} open connections, its limit "
                "(--max-connections); retry later or reuse a connection",
                "type": "service_unavailable",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "content-type: application/json\r\n"
        "connection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode("ascii")
    return head + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head timeout and a cap on open connections.

    Use :func:`guarded_h11_protocol` to get a subclass with the limits set; uvicorn
    builds one instance per connection (``uvicorn.Config(http=that_class)``).

    :param args: as ``H11Protocol`` (the uvicorn config and server state).
    :param kwargs: as ``H11Protocol``.
    """

    #: seconds to receive a whole request head; ``None``: no limit.
    head_timeout: float | None = DEFAULT_HEAD_TIMEOUT
    #: open connections beyond this are refused; ``None``: no limit.
    max_connections: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        """Register the connection, refusing it when the server has too many open.

        :param transport: the connection's transport.
        """
        super().connection_made(transport)  # type: ignore[arg-type]
        cap = self.max_connections
        if cap is not None and len(self.connections) > cap:
            now = time.monotonic()
            if now - _last_warning[0] >= _WARN_EVERY:
                _last_warning[0] = now
                logger.warning("refusing connections: %d are open (--max-connections)", cap)
            self.transport.write(_refusal(cap))
            self.transport.close()
            return
        # a connection that sends nothing at all is closed after the head timeout too
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection and its head timer.

        :param exc: the error that closed it, or ``None``.
        """
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the bytes to h11 and start or stop the head timer.

        :param data: the bytes received.
        """
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:
            # part of a head: a keep-alive connection's next request starts its clock here
            if self._head_timer is None:
                self._arm_head_timer()
        else:
            self._disarm_head_timer()

    def _arm_head_timer(self) -> None:
        if self.head_timeout is not None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.debug("closed a connection: no whole request head in %s s", self.head_timeout)
            self.transport.close()


def guarded_h11_protocol(
    *, head_timeout: float | None = DEFAULT_HEAD_TIMEOUT, max_connections: int | None = None
) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` subclass with these limits, for ``uvicorn.Config(http=...)``.

    :param head_timeout: seconds to receive a whole request head (``None``: no limit).
    :param max_connections: open connections beyond this get a 503 and are closed
        (``None``: no limit).
    :return: the protocol class.
    """
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"head_timeout": head_timeout, "max_connections": max_connections},
    )
