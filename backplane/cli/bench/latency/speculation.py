"""Speculative decoding in a latency run: the option, the workloads and the figures.

``--speculative-config JSON`` (spelled as for ``serve`` and ``LLM``) measures
every backplane configuration twice, without and with speculation, on the
same prompts and engine settings. The speculative row reports:

- **effective ms per generated token**: the decode phase's wall time (first
  token to last) over the tokens it generated, so several tokens committed by
  one verifying step count as several tokens;
- its ratio to the memory floor (the floor of decoding without speculation:
  one step reading every weight once per token);
- the **speedup** over the same configuration without speculation;
- the **acceptance rate** (accepted over verified draft tokens) and the
  **mean accepted length** (tokens committed per verifying step), summed over
  the batch's requests from their own metrics.

The ``rewrite`` workload asks a trained checkpoint (a ``.gguf`` file, an
installed model such as ``smollm2``, or a model directory whose tokenizer has
a chat template) in a chat turn to rewrite a fixed English paragraph
(:data:`REWRITE_TEXT`); its greedy answer copies long runs of the prompt,
which prompt lookup (``ngram``) drafts. On any other shape each request's
prompt repeats a random document, as a request to rewrite a text would: a
model that copies its context continues the document. A model with random
weights does not copy its prompt; its greedy output falls
into short cycles of its own, which prompt lookup then drafts. The acceptance
printed beside each figure says how much drafting there was to gain from, and
random MTP layers draft almost nothing the target accepts: with random weights
``mtp`` measures the cost of drafting and verifying, not its gain on a trained
checkpoint.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from backplane.core.errors import ConfigError

WORKLOADS: tuple[str, ...] = ("random", "rewrite")
"""The prompt workloads: random tokens, or a text to rewrite."""

REWRITE_INSTRUCTION = (
    "Rewrite the following text in plain modern English, keeping every sentence in order."
)
"""The request of the ``rewrite`` workload's chat turn, before :data:`REWRITE_TEXT`."""

REWRITE_TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of "
    "having nothing to do: once or twice she had peeped into the book her sister was reading, "
    'but it had no pictures or conversations in it, "and what is the use of a book," thought '
    'Alice "without pictures or conversations?" So she was considering in her own mind (as '
    "well as she could, for the hot day made her feel very sleepy and stupid), whether the "
    "pleasure of making a daisy-chain would be worth the trouble of getting up and picking the "
    "daisies, when suddenly a White Rabbit with pink eyes ran close by her."
)
"""The paragraph to rewrite: the opening of Lewis Carroll's *Alice's Adventures in
Wonderland* (1865, in the public domain)."""


def parse_speculative_config(text: str) -> dict[str, Any]:
    """Read ``--speculative-config``: a JSON object, checked as the engine checks it.

    :param text: the flag's value, e.g. ``'{"method": "ngram", "num_speculative_tokens": 4}'``.
    :return: the object, as a dict.
    :raises argparse.ArgumentTypeError: not JSON, not an object, or not a valid
        speculative configuration; the message says what to give instead.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({exc.msg} at character {exc.pos}): {text!r}; give an object "
            'such as \'{"method": "ngram", "num_speculative_tokens": 4}\''
        ) from None
    try:
        check_speculative_config(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def check_speculative_config(value: object) -> None:
    """Check a speculative configuration the way the engine will.

    :param value: what ``--speculative-config`` or :class:`Settings` holds.
    :raises ConfigError: not a mapping, or a field the engine refuses.
    """
    from backplane.engine.spec_decode.config import SpeculativeConfig

    if not isinstance(value, dict):
        raise ConfigError(
            f"--speculative-config must be a JSON object such as "
            f'{{"method": "ngram", "num_speculative_tokens": 4}}, got {type(value).__name__}'
        )
    SpeculativeConfig.from_value(value)


def check_shape_speculation(shape: str, config: dict[str, Any], spec: dict[str, Any]) -> None:
    """Refuse a shape that the speculative method cannot run on, before anything is measured.

    :param shape: the shape's name.
    :param config: its HF config dict.
    :param spec: the speculative configuration.
    :raises ConfigError: ``mtp`` on a shape without multi-token-prediction layers.
    """
    from backplane.models.mtp import num_mtp_layers

    if spec.get("method") == "mtp" and num_mtp_layers(config) <= 0:
        raise ConfigError(
            f"--speculative-config method 'mtp' needs a shape with MTP layers; {shape!r} "
            "declares none (num_nextn_predict_layers / mtp_num_hidden_layers); use e.g. "
            "qwen3-next-1b-mtp, tiny-deepseek-v3 or tiny-qwen3-next, or method 'ngram'"
        )


def speculation_label(spec: dict[str, Any]) -> str:
    """The suffix naming a speculative configuration in tables and plots.

    :param spec: the speculative configuration.
    :return: e.g. ``"ngram k=4"``.
    """
    return f"{spec['method']} k={int(spec['num_speculative_tokens'])}"


def rewrite_prompts(seed: int, batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    """Prompts that ask to rewrite a text: a random document, then its copy begun.

    The document is the first half of the prompt (rounded up); the rest repeats
    it from its start, so copying the context continues the document.

    :param seed: the run's seed.
    :param batch: the batch size (part of the seed).
    :param prompt_len: tokens per prompt.
    :param vocab_size: the shape's vocabulary.
    :return: ``batch`` lists of ``prompt_len`` token ids below ``vocab_size``.
    """
    import numpy as np

    # a seed of its own, so that the random workload's prompts stay what they were
    rng = np.random.default_rng([seed, batch, 1])
    doc_len = (prompt_len + 1) // 2
    docs = rng.integers(0, vocab_size, size=(batch, doc_len))
    reps = -(-prompt_len // doc_len)
    return np.tile(docs, reps)[:, :prompt_len].tolist()


def chat_rewrite_prompt(tokenizer: Any) -> list[int] | None:
    """The ``rewrite`` workload's prompt for a trained model: one chat turn asking it
    to rewrite :data:`REWRITE_TEXT`, rendered with the model's own chat template.

    :param tokenizer: the checkpoint's tokenizer, or ``None``.
    :return: the prompt's token ids (its length is the run's prompt length), or
        ``None`` when there is no tokenizer or it has no chat template (the
        random document is used then).
    """
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        return None
    messages = [{"role": "user", "content": f"{REWRITE_INSTRUCTION}\n\n{REWRITE_TEXT}"}]
    return [int(t) for t in tokenizer.encode_chat(messages)]


def speculation_counts(outputs: list[Any]) -> dict[str, int]:
    """Sum the speculative-decoding metrics of a batch's requests.

    :param outputs: the ``RequestOutput`` of each request (its ``metrics`` may be ``None``).
    :return: ``verify_steps``, ``draft_tokens`` and ``accepted_tokens`` over the batch.
    """
    counts = {"verify_steps": 0, "draft_tokens": 0, "accepted_tokens": 0}
    for out in outputs:
        m = out.metrics
        if m is None:
            continue
        counts["verify_steps"] += m.spec_verify_steps
        counts["draft_tokens"] += m.spec_draft_tokens
        counts["accepted_tokens"] += m.spec_accepted_tokens
    return counts


def acceptance_figures(counts: dict[str, int]) -> dict[str, float | None]:
    """The acceptance rate and mean accepted length of summed counts.

    :param counts: what :func:`speculation_counts` returned.
    :return: ``acceptance_rate`` (accepted / drafted) and ``mean_accepted_length``
        (1 + accepted / verifying steps: the verified token counts); ``None``
        when nothing was drafted.
    """
    drafted, steps = counts["draft_tokens"], counts["verify_steps"]
    return {
        "acceptance_rate": counts["accepted_tokens"] / drafted if drafted else None,
        "mean_accepted_length": 1.0 + counts["accepted_tokens"] / steps if steps else None,
    }


def compare_with_baseline(
    entry: dict[str, Any], baseline: dict[str, Any], floor_rows: list[dict[str, Any]]
) -> None:
    """Put each speculative row beside the run without speculation and the floor.

    :param entry: the speculative configuration's entry (its rows get
        ``baseline_ms_per_token``, ``speedup`` and ``x_floor``).
    :param baseline: the same configuration without speculation.
    :param floor_rows: the floor's rows.
    """
    base = {r["batch"]: r for r in baseline.get("batches", []) if r.get("status") == "ok"}
    floor = {r["batch"]: r["ms_per_token"] for r in floor_rows}
    for row in entry.get("batches", []):
        if row.get("status") != "ok":
            continue
        ms = row["ms_per_token"]
        if row["batch"] in floor:
            row["x_floor"] = ms / floor[row["batch"]]
        ref = base.get(row["batch"])
        if ref is not None:
            row["baseline_ms_per_token"] = ref["ms_per_token"]
            row["speedup"] = ref["ms_per_token"] / ms if ms > 0 else None
