"""The drafting steps of a model-running proposer, replayed from graphs captured at start-up.

A draft model or an MTP layer drafts one token per sequence per step: an MTP
layer from its first step on, a draft model once it has caught up on the
tokens committed since its last draft (one token per sequence, unless the
target accepted every draft or the sequence is new: the tokens before the last
then run eagerly first). Those steps differ only in the token fed, the
position and the one cache entry they add, so :class:`ChainedDraftGraphs`
captures them all as one graph per batch bucket, its inputs describing the
first chained step: each later step
first *advances* the step's metadata by one token in place (positions, cached
and sequence lengths, the cache slot it writes, the page's fill), then every
step runs the proposer's forward and LM head and feeds its greedy token to the
next step. The graph therefore mutates its own inputs;
:func:`retreat_metadata` is the capture's ``postprocess_fn`` that undoes it, so
each warm-up and the capture start from the same batch.

The graphs replay under a decode-graph :class:`~backplane.core.metadata.StepMode`:
backends read every length from the device tensors there, which is what lets
the lengths move inside one graph. A backend whose plan for such a step is not
``None`` (it prepares host-side work per step) cannot be chained this way, and
the proposer then runs every step eagerly (:meth:`ChainedDraftGraphs.planned_families`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any

import numpy as np
import torch

from backplane.core.families import Backend
from backplane.core.forward_context import forward_context, plan_step
from backplane.core.metadata import NULL_PAGE, BatchMetadata, HostBatch, StepMode
from backplane.core.packing import build_batch_metadata
from backplane.engine.sizes import pages_per_seq
from backplane.engine.worker.graph.buckets import decode_buckets, pick_bucket
from backplane.engine.worker.graph.capture import (
    CapturedGraph,
    GraphPool,
    capture,
    capture_buckets,
    new_pool,
)

__all__ = [
    "ChainedDraftGraphs",
    "DraftStepFn",
    "advance_metadata",
    "chained_draft_graphs",
    "replay_drafts",
    "retreat_metadata",
]

logger = logging.getLogger(__name__)

#: ``step_fn(step, input_ids, positions, hidden)`` runs one draft step of one token per
#: sequence and returns ``(output hidden rows or None, logits)``; ``hidden`` is the
#: previous step's output (``None`` for a proposer that does not read it).
DraftStepFn = Callable[
    [int, torch.Tensor, torch.Tensor, "torch.Tensor | None"],
    tuple["torch.Tensor | None", torch.Tensor],
]

#: the device tensors a chained step moves by one token
_MOVING = ("positions", "cached_lens", "seq_lens", "slot_mapping", "last_page_lens")


def advance_metadata(batch: BatchMetadata, positions: torch.Tensor, steps: int = 1) -> None:
    """Move a one-token-per-sequence batch ``steps`` tokens on, in place, on the device.

    This is the pre-processing of each chained draft step: every sequence's
    new token sits ``steps`` entries further into its cache.

    :param batch: a decode batch of one token per sequence (no padding tokens) whose
        block table is wide enough for the new lengths.
    :param positions: the positions the forward reads (rotary), moved with it.
    :param steps: tokens to move by (negative moves back).
    """
    n = batch.num_decode_seqs
    batch.positions[:n].add_(steps)
    batch.cached_lens.add_(steps)
    batch.seq_lens.add_(steps)
    positions.add_(steps)
    _refresh_slots(batch)


def retreat_metadata(batch: BatchMetadata, positions: torch.Tensor, steps: int) -> None:
    """Undo :func:`advance_metadata` by ``steps`` tokens (the capture's ``postprocess_fn``).

    :param batch: the batch the chained steps advanced.
    :param positions: the positions advanced with it.
    :param steps: how many tokens it moved them by.
    """
    advance_metadata(batch, positions, -steps)


def _refresh_slots(batch: BatchMetadata) -> None:
    # the cache slot of each token and its page's fill follow from the moved positions
    n, page = batch.num_decode_seqs, batch.page_size
    pos = batch.positions[:n]
    rows = torch.arange(n, device=pos.device)
    pages = batch.block_table[rows, torch.div(pos, page, rounding_mode="floor")].to(pos.dtype)
    batch.slot_mapping[:n].copy_(pages * page + pos % page)
    batch.last_page_lens.copy_((batch.seq_lens - 1) % page + 1)


class _Bucket:
    """The persistent inputs of one bucket's graph: tokens, positions, hidden rows, metadata."""

    def __init__(self, batch: BatchMetadata, hidden_size: int, dtype: torch.dtype) -> None:
        n = batch.num_decode_seqs
        device = batch.device
        self.batch = batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        # the rotary positions of the capture start at 0: any position the model knows will do
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.hidden = (
            torch.zeros(n, hidden_size, dtype=dtype, device=device) if hidden_size else None
        )
        self.graph: CapturedGraph | None = None

    def load(self, batch: BatchMetadata) -> None:
        """Copy a step's metadata into the persistent tensors (same shapes, or a prefix)."""
        for f in fields(HostBatch):
            src, dst = getattr(batch, f.name), getattr(self.batch, f.name)
            dst.view(-1)[: src.numel()].copy_(src.reshape(-1), non_blocking=True)
        self.batch.host = batch.host


class ChainedDraftGraphs:
    """Draft steps ``first_step .. first_step + num_steps - 1`` as one graph per batch bucket.

    :param step_fn: one draft step (see :data:`DraftStepFn`).
    :param backends: ``{family: backend}`` the step's cached ops run on.
    :param num_steps: steps chained in each graph (``k - 1``).
    :param first_step: the step index of the first chained step (passed to ``step_fn``).
    :param max_num_seqs: the most sequences drafted for at once (the largest bucket).
    :param max_model_len: the most cache entries a sequence holds, drafts included.
    :param page_size: tokens per page of the proposer's cache.
    :param hidden_size: width of the hidden rows carried between steps (0: none).
    :param dtype: their dtype.
    :param device: the proposer's device.
    :param cuda: record real CUDA graphs (default: on a CUDA device); otherwise eager
        stand-ins with the same phases, which keeps the logic testable on a CPU.
    :param bucket_sizes: batch buckets (default: powers of two up to ``max_num_seqs``).
    :param pool: the memory pool to capture into (default: a new one on CUDA).
    """

    def __init__(
        self,
        step_fn: DraftStepFn,
        backends: Mapping[str, Backend],
        *,
        num_steps: int,
        first_step: int = 0,
        max_num_seqs: int,
        max_model_len: int,
        page_size: int,
        hidden_size: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        cuda: bool | None = None,
        bucket_sizes: Sequence[int] | None = None,
        pool: GraphPool = None,
    ) -> None:
        self.step_fn = step_fn
        self.backends = dict(backends)
        self.num_steps = int(num_steps)
        self.first_step = int(first_step)
        self.page_size = int(page_size)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" if cuda is None else bool(cuda)
        self.pool = pool if pool is not None else (new_pool() if self.cuda else None)
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.buckets = decode_buckets(max_num_seqs, bucket_sizes)
        #: block-table columns: a sequence's whole cache, the chained steps' entries included
        self.width = pages_per_seq(max_model_len + self.num_steps + 1, self.page_size)
        self._slots: dict[int, _Bucket] = {}
        self.failed: dict[int, str] = {}
        self.pool_bytes: dict[int, int] = {}
        #: why nothing was captured (a backend that plans per step), else ``None``
        self.unsupported: str | None = None

    # -- capture ------------------------------------------------------------------
    def _chain(
        self, batch: BatchMetadata
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
        def chain(
            input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None
        ) -> torch.Tensor:
            ids, tokens = input_ids, []
            for s in range(self.num_steps):
                if s:
                    advance_metadata(batch, positions)
                hidden, logits = self.step_fn(self.first_step + s, ids, positions, hidden)
                ids = logits.argmax(dim=-1)
                tokens.append(ids)
            return torch.stack(tokens, dim=1)

        return chain

    def _scratch_batch(self, bucket: int) -> BatchMetadata:
        # Worst case, as the decode graphs: every sequence as long as the chain allows,
        # on the scratch page, so the graph is sized for any length it replays at.
        cached = self.width * self.page_size - self.num_steps
        table = np.full(self.width, NULL_PAGE, dtype=np.int32)
        return self._batch([cached] * bucket, [table] * bucket, [0] * bucket, bucket)

    def _batch(
        self,
        cached: Sequence[int],
        tables: Sequence[np.ndarray],
        slots: Sequence[int],
        bucket: int,
    ) -> BatchMetadata:
        batch = build_batch_metadata(
            [1] * len(cached),
            cached,
            tables,
            self.page_size,
            state_slots=slots,
            block_table_width=self.width,
            device=self.device,
            mode=StepMode.decode_graph(bucket),
        )
        # The packer lists the pages this one token needs; the chained steps write further
        # on, into pages reserved ahead, so the table gets every page of each sequence.
        full = np.full((len(tables), self.width), NULL_PAGE, dtype=np.int32)
        for row, table in zip(full, tables, strict=True):
            row[: len(table)] = table
        batch.host.block_table[...] = full
        batch.block_table.copy_(torch.from_numpy(full))
        return batch

    def capture(
        self, postprocess: bool = True, progress: Callable[[int], None] | None = None
    ) -> None:
        """Capture every bucket, largest first (a failed bucket runs eagerly).

        :param postprocess: undo the chained steps' metadata moves after each warm-up
            and the capture (:func:`retreat_metadata`); only a test turns it off, to
            show what goes wrong without it.
        :param progress: called with each bucket once it is done.
        """

        planned = self.planned_families()
        if planned:
            self.unsupported = (
                f"the {', '.join(planned)} backend plans each decode-graph step on the host, "
                "and chained draft steps cannot plan again between steps"
            )
            logger.info("draft steps run eagerly: %s", self.unsupported)
            return

        def capture_one(bucket: int) -> None:
            batch = self._scratch_batch(bucket)
            plans = plan_step(self.backends, batch)
            slot = _Bucket(batch, self.hidden_size, self.dtype)
            for backend in self.backends.values():
                backend.prepare_capture(batch.mode, batch)

            def restore(_ids: torch.Tensor, pos: torch.Tensor, _hidden: object) -> None:
                retreat_metadata(batch, pos, self.num_steps - 1)

            with forward_context(batch, plans):
                slot.graph = capture(
                    self._chain(batch),
                    restore if postprocess else None,
                    (slot.input_ids, slot.positions, slot.hidden),
                    pool=self.pool,
                    cuda=self.cuda,
                )
            self._slots[bucket] = slot
            if progress is not None:
                progress(bucket)

        with torch.inference_mode():
            capture_buckets(
                self.buckets,
                capture_one,
                pool=self.pool,
                label="draft-step batch",
                failed=self.failed,
                grown=self.pool_bytes,
            )

    def planned_families(self) -> list[str]:
        """The families whose backend returns a plan for a decode-graph step (sorted).

        Such a plan holds host-side work done for one step (split counts, buffers
        filled from host lengths), which a chain of steps in one graph cannot redo
        between its steps; with any of them the steps run eagerly.

        :return: the family names, empty when every step can be chained.
        """
        plans = plan_step(self.backends, self._scratch_batch(self.buckets[-1]))
        return sorted(f for f, p in plans.items() if p is not None)

    def has(self, bucket: int) -> bool:
        """True when ``bucket`` was captured."""
        return bucket in self._slots

    def bucket_for(self, num_seqs: int) -> int | None:
        """The captured bucket a batch of ``num_seqs`` sequences replays, or ``None`` (eager)."""
        bucket = pick_bucket(num_seqs, self.buckets)
        return bucket if bucket is not None and self.has(bucket) else None

    # -- replay -------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        cached_lens: Sequence[int],
        tables: Sequence[np.ndarray],
        slots: Sequence[int],
        hidden: torch.Tensor | None = None,
    ) -> list[list[int]] | None:
        """Replay the chained steps for a batch described by its first chained step.

        :param input_ids: per sequence, the token the first chained step is fed.
        :param positions: per sequence, that step's position.
        :param cached_lens: per sequence, the cache entries before that step's (at least one:
            a sequence without context is a prefill, which the graphs do not hold).
        :param tables: per sequence, its pages (holding ``cached + num_steps`` entries).
        :param slots: per sequence, its state slot.
        :param hidden: ``[n, hidden_size]`` rows the first chained step reads (when carried).
        :return: per sequence, the ``num_steps`` drafted tokens; ``None`` when no captured
            bucket holds the batch (run the steps eagerly).
        """
        n = len(input_ids)
        bucket = self.bucket_for(n)
        if bucket is None:
            return None
        slot = self._slots[bucket]
        pad = bucket - n
        # Padding sequences sit on the scratch page and slot, one entry in.
        scratch = np.full(self.width, NULL_PAGE, dtype=np.int32)
        batch = self._batch(
            list(cached_lens) + [1] * pad,
            list(tables) + [scratch] * pad,
            list(slots) + [0] * pad,
            bucket,
        )
        slot.load(batch)
        ids = torch.as_tensor(list(input_ids) + [0] * pad, dtype=torch.int64)
        pos = torch.as_tensor(list(positions) + [1] * pad, dtype=torch.int64)
        slot.input_ids.copy_(ids, non_blocking=True)
        slot.positions.copy_(pos, non_blocking=True)
        if slot.hidden is not None and hidden is not None:
            slot.hidden[:n].copy_(hidden)
            slot.hidden[n:].zero_()
        with forward_context(slot.batch, plan_step(self.backends, slot.batch)):
            tokens = slot.graph.replay()
        return tokens[:n].tolist()

    def release(self) -> None:
        """Drop every graph and persistent input."""
        self._slots.clear()
        self.pool = None


def chained_draft_graphs(
    step_fn: DraftStepFn,
    backends: Mapping[str, Backend],
    *,
    enabled: bool,
    num_speculative_tokens: int,
    first_step: int = 0,
    **settings: Any,
) -> ChainedDraftGraphs | None:
    """A proposer's chained graphs for steps ``first_step..k-1``, captured now, or ``None``.

    :param step_fn: one draft step (see :data:`DraftStepFn`).
    :param backends: ``{family: backend}`` the step's cached ops run on.
    :param enabled: the worker replays decode graphs.
    :param num_speculative_tokens: ``k``.
    :param first_step: the first step the graphs hold (the steps before it run eagerly).
    :param settings: the other keywords of :class:`ChainedDraftGraphs`.
    :return: the captured graphs, or ``None`` (disabled, or no step left to chain).
    """
    if not enabled or num_speculative_tokens <= first_step:
        return None
    graphs = ChainedDraftGraphs(
        step_fn,
        backends,
        num_steps=num_speculative_tokens - first_step,
        first_step=first_step,
        **settings,
    )
    graphs.capture()
    return graphs


def replay_drafts(
    graphs: ChainedDraftGraphs | None,
    cache: Any,
    order: Sequence[int],
    requests: Sequence[Any],
    seqs: Mapping[int, Any],
    fed: Sequence[int],
    positions: Sequence[int],
    hidden: torch.Tensor | None = None,
) -> list[list[int]] | None:
    """The chained steps of a proposer replayed from its graphs, one token per sequence.

    :param graphs: the proposer's graphs (``None``: none were captured).
    :param cache: the proposer's own cache (:class:`~.own_cache.OwnCache`).
    :param order: indices into ``requests`` of the sequences drafted for.
    :param requests: the proposal requests (their ``max_tokens``).
    :param seqs: per index, the sequence's cache entry list (``tokens``, ``slot``), holding
        every entry before the first chained step's; the replayed steps' entries are appended.
    :param fed: per sequence, the token the first chained step is fed.
    :param positions: per sequence, that step's position.
    :param hidden: the rows the first chained step reads, for a proposer that carries them.
    :return: per sequence, the drafts of the chained steps; ``None``: run the steps eagerly
        (no graphs, a sequence drafting fewer than ``k`` or without cached context, or no
        captured bucket).
    """
    if graphs is None:
        return None
    k = graphs.first_step + graphs.num_steps
    cached = [len(seqs[i].tokens) for i in order]
    if (
        any(requests[i].max_tokens < k for i in order)
        or not all(cached)
        or graphs.bucket_for(len(order)) is None
    ):
        return None
    n = graphs.num_steps
    tables = [cache.reserve(seqs[i], c + n) for i, c in zip(order, cached, strict=True)]
    slots = [seqs[i].slot for i in order]
    rest = graphs.run(fed, positions, cached, tables, slots, hidden)
    if rest is None:
        return None
    for i, first, more in zip(order, fed, rest, strict=True):
        # each chained step was fed the token the step before it drafted
        seqs[i].tokens.extend([first, *more[:-1]])
    return rest
