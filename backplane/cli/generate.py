"""``backplane generate``: generate from one or more prompts on the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING

from backplane.core.errors import ConfigError

if TYPE_CHECKING:
    from backplane.api import LLM
    from backplane.engine.sampling import SamplingParams

#: New tokens per prompt when neither ``--max-new-tokens`` nor the checkpoint sets a limit:
#: enough for a chat answer of a few paragraphs, which the model normally ends itself.
DEFAULT_MAX_NEW_TOKENS = 512


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` sub-command."""
    from backplane.cli._command import add_command
    from backplane.cli.options import add_engine_arguments

    parser = add_command(
        subparsers,
        "generate",
        help="generate text from prompts",
        description=(
            "Load a model (a directory with config.json + safetensors, a .gguf file, an "
            "installed model such as smollm2, or a preset such as tiny-llama, the default) and "
            "generate from each prompt, or answer each --chat message with the model's chat "
            "template. Engine settings come from --config FILE, overridden by the flags below."
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
        "--chat",
        action="append",
        default=[],
        metavar="TEXT",
        help="a user message, answered through the model's chat template (repeatable)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        metavar="N",
        help=(
            "most tokens to generate for each prompt; generation ends sooner at the model's "
            "end of sequence or end of turn (default: the model's generation_config.json "
            f"max_new_tokens, else {DEFAULT_MAX_NEW_TOKENS}, at most what the model length "
            "leaves after the prompt)"
        ),
    )
    model_default = "default: the model's generation_config.json, else"
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"sampling temperature; 0 = greedy ({model_default} 0)",
    )
    parser.add_argument(
        "--top-k", type=int, default=None, help=f"top-k filter; 0 = off ({model_default} 0)"
    )
    parser.add_argument(
        "--top-p", type=float, default=None, help=f"nucleus filter; 1 = off ({model_default} 1)"
    )
    parser.add_argument(
        "--min-p", type=float, default=None, help=f"min-p filter; 0 = off ({model_default} 0)"
    )
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


def _sampling_params(llm: LLM, args: argparse.Namespace) -> SamplingParams:
    """The flags given, over the model's defaults, over the command's (greedy).

    :param llm: the loaded model.
    :param args: the parsed command line.
    :return: the sampling parameters of every prompt (``max_tokens`` as given, else the
        model's default, else :data:`DEFAULT_MAX_NEW_TOKENS`; see :func:`_fit_to_model`).
    """
    given = {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
    }
    fields = {k: v for k, v in given.items() if v is not None}
    model_defaults = getattr(llm.engine.model, "generation_defaults", None) or {}
    if "temperature" not in fields and "temperature" not in model_defaults:
        fields["temperature"] = 0.0
    if args.max_new_tokens is not None:
        fields["max_tokens"] = args.max_new_tokens
    elif "max_tokens" not in model_defaults:
        fields["max_tokens"] = DEFAULT_MAX_NEW_TOKENS
    return llm.default_sampling_params(
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
        **fields,
    )


def _fit_to_model(
    llm: LLM, params: SamplingParams, prompt_lengths: list[int], explicit: bool
) -> list[SamplingParams]:
    """One set of parameters per prompt, a default length cut to what the model length leaves.

    A limit the user gave is kept as it is, so a prompt it does not fit is refused
    with the engine's message; a default one must never make a prompt fail.

    :param llm: the loaded model.
    :param params: the parameters of every prompt.
    :param prompt_lengths: each prompt's token count.
    :param explicit: ``max_tokens`` came from ``--max-new-tokens``.
    :return: the parameters of each prompt.
    """
    if explicit:
        return [params] * len(prompt_lengths)
    room = int(llm.engine.max_model_len)
    return [
        dataclasses.replace(params, max_tokens=min(params.max_tokens, max(room - n, 1)))
        for n in prompt_lengths
    ]


def run(args: argparse.Namespace) -> int:
    """Generate for every prompt and chat message and print the results; return 0."""
    from backplane.api import LLM
    from backplane.cli.options import config_from_args

    prompts: list[object] = list(args.prompt) + [_parse_token_ids(t) for t in args.prompt_token_ids]
    chats: list[str] = list(args.chat)
    if not prompts and not chats:
        raise ConfigError(
            "give at least one --prompt TEXT, --prompt-token-ids 1,2,3 or --chat TEXT"
        )
    llm = LLM(config=config_from_args(args))
    params = _sampling_params(llm, args)
    explicit = args.max_new_tokens is not None
    conversations = [[{"role": "user", "content": c}] for c in chats]
    lengths = [len(llm.encode(p)) if isinstance(p, str) else len(p) for p in prompts]
    outputs = (
        llm.generate(prompts, _fit_to_model(llm, params, lengths, explicit)) if prompts else []
    )
    if chats:
        lengths = [len(llm.render_chat(c)[1]) for c in conversations]
        outputs += llm.chat(conversations, _fit_to_model(llm, params, lengths, explicit))
    shown_prompts: list[object] = prompts + chats
    for i, out in enumerate(outputs):
        if args.json:
            m = out.metrics
            record = {
                "index": i,
                "request_id": out.request_id,
                "chat": i >= len(prompts),
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
            prompt = shown_prompts[i]
            if not isinstance(prompt, str):
                prompt = f"<{len(out.prompt_token_ids)} ids>"
            print(f"[{i}] {prompt!s} -> {shown!s}  ({out.finish_reason})", file=sys.stdout)
    return 0
