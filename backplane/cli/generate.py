"""``backplane generate``: generate from one or more prompts on the command line."""

from __future__ import annotations

import argparse
import json
import sys

from backplane.core.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` sub-command."""
    from backplane.cli._command import add_command
    from backplane.cli.options import add_engine_arguments

    parser = add_command(
        subparsers,
        "generate",
        help="generate text from prompts",
        description=(
            "Load a model (a directory with config.json + safetensors, or a preset such as "
            "tiny-llama, the default) and generate from each prompt. Engine settings come "
            "from --config FILE, overridden by the flags below."
        ),
        run=run,
        json_help="print one JSON object per prompt (token_ids, text, finish_reason, ...)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a text prompt (repeatable; needs the model's tokenizer)",
    )
    parser.add_argument(
        "--prompt-token-ids",
        action="append",
        default=[],
        metavar="ID,ID,...",
        help="a prompt given as comma-separated token ids (repeatable)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=16, metavar="N", help="tokens to generate (16)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (0)"
    )
    parser.add_argument("--top-k", type=int, default=0, help="top-k filter; 0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus filter; 1 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="min-p filter; 0 = off")
    parser.add_argument(
        "--sampling-seed", type=int, default=None, metavar="N", help="per-request sampling seed"
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-sequence"
    )
    add_engine_arguments(parser)


def _parse_token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ConfigError(
            f"option --prompt-token-ids: expected comma-separated integers such as 1,2,3, "
            f"got {text!r}"
        ) from None
    if not ids:
        raise ConfigError("option --prompt-token-ids: give at least one token id")
    return ids


def run(args: argparse.Namespace) -> int:
    """Generate for every prompt and print the results; return 0."""
    from backplane.api import LLM
    from backplane.cli.options import config_from_args
    from backplane.engine.sampling import SamplingParams

    prompts: list[object] = list(args.prompt) + [_parse_token_ids(t) for t in args.prompt_token_ids]
    if not prompts:
        raise ConfigError("give at least one --prompt TEXT or --prompt-token-ids 1,2,3")
    params = SamplingParams(
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(config=config_from_args(args))
    outputs = llm.generate(prompts, params)
    for i, out in enumerate(outputs):
        if args.json:
            m = out.metrics
            record = {
                "index": i,
                "request_id": out.request_id,
                "prompt_token_ids": out.prompt_token_ids,
                "token_ids": out.token_ids,
                "text": out.text,
                "finish_reason": out.finish_reason,
                "time_to_first_token": m.time_to_first_token if m else None,
                "prompt_tokens_reused": m.prompt_tokens_reused if m else 0,
            }
            print(json.dumps(record), flush=True)
        else:
            shown = out.text if llm.tokenizer is not None else " ".join(map(str, out.token_ids))
            prompt = (
                prompts[i] if isinstance(prompts[i], str) else f"<{len(out.prompt_token_ids)} ids>"
            )
            print(f"[{i}] {prompt!s} -> {shown!s}  ({out.finish_reason})", file=sys.stdout)
    return 0
