"""Run the server with uvicorn until interrupted."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from backplane.api.async_llm import AsyncLLM
from backplane.core.errors import EngineFailedError
from backplane.server.app import DEFAULT_MAX_BODY_BYTES, build_app
from backplane.server.connections import (
    DEFAULT_HEAD_TIMEOUT,
    default_max_connections,
    guarded_h11_protocol,
)

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_TIMEOUT_KEEP_ALIVE", "run_server", "uvicorn_config"]

#: Seconds an idle keep-alive connection stays open (uvicorn's default).
DEFAULT_TIMEOUT_KEEP_ALIVE = 5


def uvicorn_config(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE,
    timeout_request_head: float | None = DEFAULT_HEAD_TIMEOUT,
    max_connections: int | None = None,
    limit_concurrency: int | None = None,
    h11_max_incomplete_event_size: int | None = None,
) -> Any:
    """The uvicorn configuration the server runs with: the guarded h11 protocol and its limits.

    :param app: the ASGI application.
    :param host: the address to bind.
    :param port: the TCP port.
    :param log_level: uvicorn's log level (access lines at ``debug`` and ``info``).
    :param timeout_keep_alive: seconds an idle keep-alive connection stays open.
    :param timeout_request_head: seconds a client has to send a whole request head
        (``None``: no limit).
    :param max_connections: open connections beyond this get a 503 and are closed
        (``None``: :func:`~backplane.server.connections.default_max_connections`;
        ``0``: no limit).
    :param limit_concurrency: uvicorn's cap on connections and requests in flight,
        beyond which requests get a 503 (``None``: none).
    :param h11_max_incomplete_event_size: most bytes of a request head (``None``: h11's 16 KiB).
    :return: a ``uvicorn.Config``.
    """
    import uvicorn

    if max_connections is None:
        max_connections = default_max_connections()
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level in ("debug", "info"),
        timeout_graceful_shutdown=5,
        timeout_keep_alive=timeout_keep_alive,  # type: ignore[arg-type]
        limit_concurrency=limit_concurrency,
        h11_max_incomplete_event_size=h11_max_incomplete_event_size,
        http=guarded_h11_protocol(
            head_timeout=timeout_request_head, max_connections=max_connections or None
        ),
    )


def run_server(
    engine: AsyncLLM,
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "warning",
    tool_call_parser: str = "auto",
    reasoning_parser: str | None = None,
    **limits: Any,
) -> None:
    """Serve ``engine`` over HTTP until SIGINT / SIGTERM, then stop the engine loop.

    :param engine: the engine (already loaded: the port opens once it is ready).
    :param model_name: the model name clients use.
    :param host: the address to bind (127.0.0.1: this machine only).
    :param port: the TCP port.
    :param api_key: require ``Authorization: Bearer <api_key>`` on ``/v1`` routes.
    :param max_body_bytes: refuse larger request bodies (413).
    :param log_level: uvicorn's log level.
    :param tool_call_parser: the format of the model's tool calls (``"auto"``: by its family).
    :param reasoning_parser: returns ``<think>`` text as ``reasoning_content`` (``None``: not).
    :param limits: connection limits, as :func:`uvicorn_config` takes them
        (``timeout_keep_alive``, ``timeout_request_head``, ``max_connections``,
        ``limit_concurrency``, ``h11_max_incomplete_event_size``).
    """
    import uvicorn

    app = build_app(
        engine,
        model_name=model_name,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )
    config = uvicorn_config(app, host=host, port=port, log_level=log_level, **limits)
    server = uvicorn.Server(config)
    died = _stop_when_engine_dies(engine, server)
    logger.info("serving %s on http://%s:%d", model_name, host, port)
    try:
        server.run()
    finally:
        engine.shutdown()
    if died.is_set():
        raise EngineFailedError(
            "the engine loop stopped (the log above says why), so the server stopped too; "
            "fix the cause and start the server again"
        )


#: Seconds the server keeps answering 503 after its engine died, before it exits.
ENGINE_DEAD_GRACE = 2.0


def _stop_when_engine_dies(engine: AsyncLLM, server: Any) -> threading.Event:
    """Watch ``engine`` and make ``server`` exit when its loop stops on its own.

    Requests meanwhile get 503 (the engine is dead); after
    :data:`ENGINE_DEAD_GRACE` seconds the server exits, and :func:`run_server`
    raises, so a supervisor sees a non-zero exit and can restart it.

    :param engine: the served engine.
    :param server: the ``uvicorn.Server``.
    :return: an event set when the server was stopped because the engine died.
    """
    died = threading.Event()

    def watch() -> None:
        while not server.should_exit:
            if not engine.is_alive:
                logger.error(
                    "the engine loop stopped; the server exits in %.0f s", ENGINE_DEAD_GRACE
                )
                time.sleep(ENGINE_DEAD_GRACE)
                died.set()
                server.should_exit = True
                return
            time.sleep(0.25)

    threading.Thread(target=watch, name="backplane-engine-watch", daemon=True).start()
    return died
