"""What one step samples: its rows, their logits processing and the prompt positions it scores.

Plain data built by the engine loop for every step and read by the sampler
(:mod:`.sampler`), the logits processing (:mod:`.processing`) and the graph
runner's sampling head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backplane.engine.sampling.params import SamplingParams


@dataclass(frozen=True)
class TokenPairs:
    """``(row, token)`` pairs of a step's rows, flat: one entry per occurrence.

    :param rows: ``[m]`` int64 row of each pair (a row of the logits being processed).
    :param tokens: ``[m]`` int64 token id of each pair.
    """

    rows: np.ndarray
    tokens: np.ndarray


@dataclass(frozen=True)
class LogitsProcessing:
    """What changes a step's logits before sampling (only built when some row asks).

    :param penalty_rows: ``[m]`` int64 rows with a penalty, or ``None`` when none has one.
    :param output: ``(i, token)`` per output token of penalty row ``penalty_rows[i]``
        known on the host (a token may repeat: it is counted).
    :param pending: the penalty rows' output tokens still on the device (an
        asynchronous step's): ``(i, token)`` device tensors, or ``None``.
    :param prompt: ``(i, token)`` per prompt token of penalty row ``penalty_rows[i]``
        whose ``repetition_penalty`` is on.
    :param suppress: ``(row, token)`` pairs that cannot be sampled (``min_tokens``).
    """

    penalty_rows: np.ndarray | None = None
    output: TokenPairs | None = None
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    prompt: TokenPairs | None = None
    suppress: TokenPairs | None = None


@dataclass(frozen=True)
class PromptLogprobRows:
    """The prompt positions of a step whose logprobs are asked for (``prompt_logprobs``).

    Each is a hidden row of the step (a prompt token of a prefill chunk) whose
    logits give the logprobs of the prompt token after it. The rows join the
    step's logits gather behind the sampling rows; only they and the sampling
    rows go through the LM head.

    :param indices: ``[m]`` int64 flat token rows of the step's hidden states (device).
    :param targets: ``[m]`` int64 the prompt token each row predicts (device).
    :param k: top logprobs per row (the most any of the step's requests asks for).
    """

    indices: torch.Tensor
    targets: torch.Tensor
    k: int

    def __len__(self) -> int:
        return int(self.indices.shape[0])


@dataclass(frozen=True)
class GrammarBitmask:
    """The tokens that the grammars of a step's constrained rows allow next.

    Bit ``t % 32`` of word ``t // 32`` of a row is 1 when token ``t`` is
    allowed (xgrammar's layout); tokens past the mask's width are not allowed.

    :param rows: ``[m]`` int64 the constrained rows (rows of the step's logits), increasing.
    :param bitmask: ``[m, ceil(vocab / 32)]`` int32 on the host, one row per entry of
        ``rows``; the sampler copies it to the device once per step.
    """

    rows: np.ndarray
    bitmask: torch.Tensor

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class SamplingRows:
    """What a step samples: one row per sampling sequence, in logits-row order.

    :param params: each row's :class:`SamplingParams`.
    :param seeds: ``[n]`` int64 per-row seeds.
    :param offsets: ``[n]`` int64 index of the token each row samples in its request.
    :param processing: penalties and ``min_tokens`` suppression, or ``None`` when no row asks.
    :param num_logprobs: the most top logprobs a row asks for, ``-1`` when none asks.
    :param prompt: prompt positions whose logprobs the step computes too, or ``None``.
    :param grammar: the allowed tokens of the rows with a grammar (structured output),
        or ``None`` when no row has one.
    """

    params: Sequence[SamplingParams]
    seeds: np.ndarray
    offsets: np.ndarray
    processing: LogitsProcessing | None = None
    num_logprobs: int = -1
    prompt: PromptLogprobRows | None = None
    grammar: GrammarBitmask | None = None

    def __len__(self) -> int:
        return len(self.params)

    @property
    def needs_eager(self) -> bool:
        """True when a row asks for what the captured sampling graphs do not do."""
        return (
            self.processing is not None
            or self.num_logprobs >= 0
            or self.prompt is not None
            or self.grammar is not None
        )
