"""Logits processing before sampling: repetition, frequency and presence penalties,
``min_tokens`` suppression and grammar bitmasks, vectorised over the step's rows."""

from __future__ import annotations

import numpy as np
import torch

from backplane.engine.sampling.rows import GrammarBitmask, SamplingRows, TokenPairs

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _pair_index(pairs: TokenPairs, vocab: int, device: torch.device) -> torch.Tensor:
    return host_to_device(np.ascontiguousarray(pairs.rows * vocab + pairs.tokens), device)


def apply_processing(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Apply the rows' penalties and ``min_tokens`` suppression, vectorised.

    Token counts come from one ``scatter_add_`` of flat ``(row, token)`` pairs
    into ``[m, vocab]`` for the ``m`` penalty rows only. Order (as vLLM):
    repetition penalty on prompt and output tokens, then frequency and presence
    penalties on output tokens, then suppressed tokens set to ``-inf``.

    :param logits: ``[n, vocab]`` logits.
    :param rows: the rows (``rows.processing`` set).
    :return: float32 ``[n, vocab]`` processed logits (a new tensor).
    """
    x = logits.float().clone()
    proc = rows.processing
    if proc is None:
        return x
    n, vocab = x.shape
    device = x.device
    if proc.penalty_rows is not None and len(proc.penalty_rows):
        m = len(proc.penalty_rows)
        params = [rows.params[i] for i in proc.penalty_rows.tolist()]
        idx = host_to_device(np.ascontiguousarray(proc.penalty_rows, dtype=np.int64), device)
        counts = torch.zeros(m * vocab, dtype=torch.int32, device=device)
        if proc.output is not None and len(proc.output.rows):
            flat = _pair_index(proc.output, vocab, device)
            counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        if proc.pending is not None:
            prow, ptok = proc.pending
            flat = prow * vocab + ptok
            counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        counts = counts.view(m, vocab)
        sub = x.index_select(0, idx)
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
        if (rep != 1.0).any():
            seen = counts > 0
            if proc.prompt is not None and len(proc.prompt.rows):
                seen = seen.view(-1).clone()
                seen[_pair_index(proc.prompt, vocab, device)] = True
                seen = seen.view(m, vocab)
            r = rep.to(device).unsqueeze(1)
            # a small penalty divides a positive logit past float32's range; the largest
            # float keeps it the most likely without an inf that turns softmax to NaN
            penalised = torch.where(sub > 0, (sub / r).clamp(max=_FLOAT32_MAX), sub * r)
            sub = torch.where(seen, penalised, sub)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
        sub = sub - freq.to(device).unsqueeze(1) * counts.to(torch.float32)
        sub = sub - pres.to(device).unsqueeze(1) * (counts > 0).to(torch.float32)
        x = x.index_copy(0, idx, sub)
    if proc.suppress is not None and len(proc.suppress.rows):
        x.view(-1)[_pair_index(proc.suppress, vocab, device)] = float("-inf")
    return x


def apply_token_bitmask(logits: torch.Tensor, grammar: GrammarBitmask) -> torch.Tensor:
    """Set the logits of tokens a row's grammar does not allow to ``-inf``, on the device.

    The int32 bitmask is copied to the logits' device once and unpacked there
    (one shift-and-test per token); rows without a grammar are untouched.

    :param logits: ``[n, vocab]`` float logits.
    :param grammar: the constrained rows and their bitmask.
    :return: ``[n, vocab]`` logits (a new tensor; ``logits`` is left as it was).
    """
    n, vocab = logits.shape
    device = logits.device
    words = grammar.bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    # bit t % 32 of word t // 32: an arithmetic shift keeps bit 31 readable with & 1
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().view(len(grammar), -1)
    width = allowed.shape[1]
    if width < vocab:  # ids past the mask (a padded vocabulary) are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - width), value=False)
    allowed = allowed[:, :vocab]
    idx = host_to_device(np.ascontiguousarray(grammar.rows, dtype=np.int64), device)
    masked = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, idx, masked)


def host_to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device`` (a non-blocking copy; the array itself on the CPU).

    :param arr: a contiguous numpy array (pinned or not).
    :param device: where the tensor must live.
    :return: the tensor.
    """
    t = torch.from_numpy(arr)
    return t.to(device, non_blocking=True) if device.type != "cpu" else t
