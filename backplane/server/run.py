"""Run the server with uvicorn until interrupted."""

from __future__ import annotations

import logging

from backplane.api.async_llm import AsyncLLM
from backplane.server.app import DEFAULT_MAX_BODY_BYTES, build_app

logger = logging.getLogger(__name__)

__all__ = ["run_server"]


def run_server(
    engine: AsyncLLM,
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "warning",
) -> None:
    """Serve ``engine`` over HTTP until SIGINT / SIGTERM, then stop the engine loop.

    :param engine: the engine (already loaded: the port opens once it is ready).
    :param model_name: the model name clients use.
    :param host: the address to bind (127.0.0.1: this machine only).
    :param port: the TCP port.
    :param api_key: require ``Authorization: Bearer <api_key>`` on ``/v1`` routes.
    :param max_body_bytes: refuse larger request bodies (413).
    :param log_level: uvicorn's log level.
    """
    import uvicorn

    app = build_app(engine, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level in ("debug", "info"),
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    logger.info("serving %s on http://%s:%d", model_name, host, port)
    try:
        server.run()
    finally:
        engine.shutdown()
