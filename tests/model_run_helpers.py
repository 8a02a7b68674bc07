"""Running a model directly, without an engine: its torch backends and a schedule of steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from backplane.core.forward_context import forward_context, plan_step
from backplane.core.packing import build_batch_metadata
from backplane.core.registry import get_registry
from backplane.models.base import CausalLM
from backplane.testing.plugin import load_backend

#: one step of a schedule: ``(sequence index, tokens it runs)`` per sequence in the step
Step = list[tuple[int, int]]


def torch_backends(families: Sequence[str]) -> dict[str, Any]:
    """The torch backend of each family.

    :param families: the op families (``"attention"``, ``"ssm"``, ``"mla"``, ``"delta"``).
    :return: ``{family: backend object}``.
    """
    registry = get_registry()
    return {f: load_backend(registry.get(f, "torch")) for f in families}


def run_schedule(
    lm: CausalLM,
    backends: dict[str, Any],
    schedule: Sequence[Step],
    *,
    tables: Sequence[np.ndarray],
    slots: Sequence[int],
    page_size: int,
    step_ids: Callable[[Step, list[int]], torch.Tensor],
) -> list[torch.Tensor]:
    """Run ``schedule`` through ``lm`` on caches it already holds; return each step's logits.

    :param lm: the model, its caches allocated.
    :param backends: ``{family: backend object}`` it runs on.
    :param schedule: the steps, in order.
    :param tables: each sequence's page table.
    :param slots: each sequence's state slot.
    :param page_size: tokens per page.
    :param step_ids: the token ids a step feeds, from the step and the tokens each
        sequence has run so far.
    :return: each step's logits ``[tokens, vocab]``.
    """
    lens = [0] * len(tables)
    out = []
    for step in schedule:
        batch = build_batch_metadata(
            [n for _, n in step],
            [lens[s] for s, _ in step],
            [tables[s] for s, _ in step],
            page_size,
            state_slots=[int(slots[s]) for s, _ in step],
            device="cpu",
        )
        ids = step_ids(step, lens)
        with torch.no_grad(), forward_context(batch, plan_step(backends, batch)):
            hidden = lm(ids, batch.positions)
            out.append(lm.compute_logits(hidden[: batch.num_tokens]).clone())
        for s, n in step:
            lens[s] += n
    return out
