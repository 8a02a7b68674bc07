"""``backplane serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from backplane.core.errors import ConfigError

DESCRIPTION = """\
Load a model and serve it over HTTP with OpenAI's API: POST /v1/completions and
/v1/chat/completions (streamed as server-sent events or not), GET /v1/models,
/health and /metrics (Prometheus). Binds 127.0.0.1 (this machine only) unless
--host says otherwise. Engine settings come from --config FILE, overridden by
the engine flags below (the same as `backplane generate`'s). Needs the serve
extra: pip install 'backplane[serve]'.

  backplane serve smollm2 --port 8000
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8}'
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` sub-command."""
    from backplane.cli._command import add_command
    from backplane.cli.options import add_engine_arguments

    parser = add_command(
        subparsers,
        "serve",
        help="serve a model over HTTP with OpenAI's API",
        description=DESCRIPTION,
        run=run,
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "model_arg",
        nargs="?",
        metavar="MODEL",
        default=None,
        help="model directory, .gguf file, installed model (smollm2) or preset; same as --model",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="TCP port (8000)")
    server.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 routes "
        "(default: $BACKPLANE_API_KEY, else no key)",
    )
    server.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients send and /v1/models lists (default: MODEL)",
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        metavar="N",
        help="refuse larger request bodies with 413 (default: 8 MiB)",
    )
    server.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        metavar="N",
        help="answer 503 while N requests wait for the engine (1024; 0 = no cap)",
    )
    server.add_argument(
        "--tool-call-parser",
        default="auto",
        metavar="NAME",
        help="the format of the model's tool calls: hermes (<tool_call> JSON: Qwen, SmolLM2), "
        "llama3_json (Llama 3) or auto (by the model family; the default)",
    )
    server.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="return <think> text as the message's reasoning_content: deepseek_r1 (the "
        "prompt may open the block) or qwen3 (the output opens it); default: left in content",
    )
    conn = parser.add_argument_group("connections")
    conn.add_argument(
        "--timeout-request-head",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="close a connection whose request head (request line and headers) is not "
        "complete this long after it opened or its first byte (10; 0 = no limit)",
    )
    conn.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="close an idle keep-alive connection after this long (5)",
    )
    conn.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="answer 503 and close connections beyond N open ones (default: half the "
        "open-file limit, ulimit -n, between 64 and 8192; 0 = no limit)",
    )
    conn.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="uvicorn's cap: answer 503 to requests while N connections or requests are "
        "in flight (default: none)",
    )
    conn.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=None,
        metavar="BYTES",
        help="refuse a request head larger than this with 400 (default: 16384)",
    )
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted; return 0."""
    from backplane.cli.options import config_from_args

    if args.model_arg is not None:
        if getattr(args, "model", args.model_arg) != args.model_arg:
            raise ConfigError(
                f"the model is given twice ({args.model_arg!r} and --model {args.model!r}); "
                "give it once"
            )
        args.model = args.model_arg
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"option --port: {args.port} is not a TCP port (0..65535)")
    if args.max_request_body_bytes is not None and args.max_request_body_bytes < 1:
        raise ConfigError("option --max-request-body-bytes: give a positive number of bytes")
    if args.max_waiting_requests < 0:
        raise ConfigError("option --max-waiting-requests: give 0 (no cap) or a positive number")
    limits = _connection_limits(args)
    _check_parsers(args)
    try:
        from backplane.api.async_llm import AsyncLLM
        from backplane.server.app import DEFAULT_MAX_BODY_BYTES
        from backplane.server.run import run_server
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"backplane serve needs {exc.name!r}, which is not installed; "
            "install the serve extra: pip install 'backplane[serve]'"
        ) from None
    config = config_from_args(args)
    name = args.served_model_name or str(config.model)
    engine = AsyncLLM(config=config, max_waiting_requests=args.max_waiting_requests or None)
    api_key = args.api_key if args.api_key is not None else os.environ.get("BACKPLANE_API_KEY")
    print(f"backplane: serving {name} on http://{args.host}:{args.port}", file=sys.stderr)
    run_server(
        engine,
        model_name=name,
        host=args.host,
        port=args.port,
        api_key=api_key or None,
        max_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES,
        log_level=getattr(args, "log_level", "warning"),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        **limits,
    )
    return 0


def _check_parsers(args: argparse.Namespace) -> None:
    """Refuse an unknown --tool-call-parser or --reasoning-parser before the model loads.

    :param args: the parsed command line.
    :raises ConfigError: naming the flag and the known parsers.
    """
    from backplane.api.reasoning import get_reasoning_parser
    from backplane.api.tool_parsers import get_tool_parser

    try:
        if args.tool_call_parser != "auto":
            get_tool_parser(args.tool_call_parser)
    except ConfigError as exc:
        raise ConfigError(f"option --tool-call-parser: {exc}") from None
    try:
        if args.reasoning_parser is not None:
            get_reasoning_parser(args.reasoning_parser)
    except ConfigError as exc:
        raise ConfigError(f"option --reasoning-parser: {exc}") from None


def _connection_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The connection flags, checked, as :func:`backplane.server.run.uvicorn_config` takes them.

    :param args: the parsed command line.
    :return: ``timeout_request_head``, ``timeout_keep_alive``, ``max_connections``,
        ``limit_concurrency`` and ``h11_max_incomplete_event_size``.
    :raises ConfigError: a flag out of range, naming it.
    """
    for flag, value in (
        ("--timeout-request-head", args.timeout_request_head),
        ("--timeout-keep-alive", args.timeout_keep_alive),
        ("--max-connections", args.max_connections),
    ):
        if value is not None and not value >= 0:
            raise ConfigError(f"option {flag}: {value} is negative; give 0 (no limit) or more")
    for flag, value in (
        ("--limit-concurrency", args.limit_concurrency),
        ("--h11-max-incomplete-event-size", args.h11_max_incomplete_event_size),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"option {flag}: {value}; give a positive number")
    return {
        "timeout_request_head": args.timeout_request_head or None,
        "timeout_keep_alive": args.timeout_keep_alive,
        "max_connections": args.max_connections,
        "limit_concurrency": args.limit_concurrency,
        "h11_max_incomplete_event_size": args.h11_max_incomplete_event_size,
    }
