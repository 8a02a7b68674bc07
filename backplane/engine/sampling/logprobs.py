"""Log-probabilities: of sampled tokens and of prompt tokens, on the device and as host dicts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability (vLLM's shape).

    :param logprob: natural log of its probability under the raw model distribution.
    :param rank: 1 for the most likely token, 2 for the next...
    :param decoded_token: the token's text, when a tokenizer is known.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class LogprobsTensors:
    """Logprobs of one step's rows on the device: column 0 is the sampled token.

    :param token_ids: ``[n, 1 + k]`` int64: the sampled token, then the top ``k``.
    :param logprobs: ``[n, 1 + k]`` float32 log-probabilities of those tokens.
    :param ranks: ``[n]`` int64 rank of the sampled token.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprobs of the given tokens and the top ``k``, from the raw logits.

    ``log_softmax`` in float32 over every row at once, one ``gather`` and one
    ``topk``: used for sampled tokens and for prompt tokens alike.

    :param logits: ``[n, vocab]`` raw model logits.
    :param tokens: ``[n]`` the tokens whose logprob and rank column 0 holds (the sampled
        ones, or the prompt token each row predicts).
    :param k: top logprobs per row (the most any row asks for).
    :return: the step's :class:`LogprobsTensors` (device work only, no host sync).
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, tokens.unsqueeze(1))
    ranks = (lp > picked).sum(dim=-1) + 1
    ids, vals = tokens.unsqueeze(1), picked
    if k > 0:
        top_vals, top_ids = lp.topk(k, dim=-1)
        ids = torch.cat([ids, top_ids], dim=1)
        vals = torch.cat([vals, top_vals], dim=1)
    return LogprobsTensors(ids, vals, ranks)


def logprob_dicts(
    token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, ks: Sequence[int | None]
) -> list[dict[int, Logprob] | None]:
    """Per row, ``{token_id: Logprob}`` of the sampled token and the row's top ``k``.

    :param token_ids: ``[n, 1 + K]`` host copy of :attr:`LogprobsTensors.token_ids`.
    :param logprobs: ``[n, 1 + K]`` host copy of the logprobs.
    :param ranks: ``[n]`` ranks of the sampled tokens.
    :param ks: each row's ``SamplingParams.logprobs`` (``None``: the row gets ``None``).
    :return: one dict (or ``None``) per row.
    """
    out: list[dict[int, Logprob] | None] = []
    for i, k in enumerate(ks):
        if k is None:
            out.append(None)
            continue
        ids = token_ids[i].tolist()
        vals = logprobs[i].tolist()
        d = {ids[0]: Logprob(vals[0], int(ranks[i]))}
        for j in range(1, k + 1):
            d.setdefault(ids[j], Logprob(vals[j], j))
        out.append(d)
    return out
