"""Seeded inputs of the routed-expert op, shared by its interpreter and GPU tests."""

from __future__ import annotations

import math

import torch


def moe_case(
    shape: tuple[int, int, int, int, int], gated: bool, seed: int
) -> tuple[torch.Tensor, ...]:
    """Float32 CPU inputs of ``moe_experts`` for ``shape = (T, k, E, I, H)``.

    Each token routes to ``k`` distinct experts, as top-k picks them (with few
    experts, tokens share them); routing weights lie in ``[0, 1)``; weights are
    scaled so outputs are of order one.

    :param shape: tokens, slots per token, experts, intermediate and hidden sizes.
    :param gated: ``w_in`` holds gate and up rows (``[E, 2I, H]``), else up rows only.
    :param seed: the generator's seed.
    :return: ``(x [T, H], ids [T, k], weights [T, k], w_in, w_down [E, H, I])``.
    """
    num_tokens, k, experts, inter, hidden = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, k, generator=g)
    rows = 2 * inter if gated else inter
    w_in = torch.randn(experts, rows, hidden, generator=g) / math.sqrt(hidden)
    w_down = torch.randn(experts, hidden, inter, generator=g) / math.sqrt(inter)
    return x, ids, weights, w_in, w_down
