"""Input preparation: from the scheduler's output to the step's device inputs.

:class:`InputBatch` owns one pinned host buffer and one device buffer, both
sized at startup for the engine's limits (``max_num_tokens``,
``max_num_seqs``, pages per sequence). Each step it

1. reads the few per-sequence facts it needs from the scheduled sequences
   (O(1) Python work per sequence: a handful of attribute reads);
2. packs every field of the step's layout straight into typed views of the host
   buffer, back to back, with :func:`backplane.core.packing.pack_batch` -- the
   packer :func:`~backplane.core.packing.build_batch_metadata` uses too, so the
   conformance kit tests the layout the engine runs;
3. issues ONE host-to-device copy of the packed prefix of the buffer;
4. returns :class:`BatchInputs`: the step's
   :class:`~backplane.core.metadata.BatchMetadata`, ``input_ids``,
   ``positions`` and the indices of the hidden rows to turn into logits.

The views handed out are valid until the next :meth:`InputBatch.prepare`.
Before overwriting the host buffer, ``prepare`` waits for the previous copy
to finish (an event on CUDA), so callers need not synchronise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from backplane.core.block_table import PersistentBlockTable
from backplane.core.launch import cdiv
from backplane.core.metadata import (
    EAGER,
    NULL_PAGE,
    NULL_SLOT,
    BatchMetadata,
    ChainedRows,
    HostBatch,
    StepMode,
)
from backplane.core.packing import measure_batch, pack_batch

#: HostBatch fields that live in a fixed section of the buffers (page indices are sized per step)
_SECTION_FIELDS = tuple(f.name for f in dataclasses.fields(HostBatch) if f.name != "page_indices")
# Every section starts 16-byte aligned: typed device views need 8, and JIT
# kernels (Triton) specialise on whether each pointer is 16-byte aligned, so an
# alignment that varied with the step's shape compiled a new kernel variant
# for it mid-serving.
_ALIGN = 16


class ScheduledSeqLike(Protocol):
    """The fields of a scheduled sequence that input preparation reads."""

    request: Any
    num_new_tokens: int
    num_cached_tokens: int
    page_ids: np.ndarray
    state_slot: int
    is_prefill_chunk_final: bool


@dataclass
class BatchInputs:
    """Everything the model runner and the sampler need for one step.

    :param metadata: the batch description read by cached ops.
    :param input_ids: ``[padded_num_tokens]`` int64 on the device (0 in padding).
    :param positions: ``[padded_num_tokens]`` int64 on the device (same tensor as
        ``metadata.positions``).
    :param logits_indices: ``[num_sample]`` int64 on the device: the flat token
        row of the last token of each sequence that samples this step.
    :param sample_seqs: host indices (into the scheduled list as given to
        :meth:`InputBatch.prepare`) of the sequences that sample this step, in
        the order of ``logits_indices``.
    :param order: the packing order (``order[j]`` is the index, in the list given
        to :meth:`InputBatch.prepare`, of the ``j``-th packed sequence), or
        ``None`` when it is the given order.
    :param seq_rows: for a step whose chunks run as one decode row per position
        (:func:`position_rows`), the first row of each scheduled sequence;
        ``None`` when the metadata's sequences are the scheduled ones.
    :param logits: logits of every row when the step's graph projected them
        all (a decode graph), set by the runner; ``None`` otherwise.
    :param row_chain: the host side of ``metadata.chained_rows`` (a verify graph's
        rows of a model with recurrent state), else ``None``.
    """

    metadata: BatchMetadata
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    sample_seqs: np.ndarray
    order: np.ndarray | None = None
    seq_rows: np.ndarray | None = None
    logits: torch.Tensor | None = None
    row_chain: RowChain | None = None

    def first_token_rows(self, seqs: np.ndarray) -> np.ndarray:
        """The flat token row of the first new token of each of ``seqs``.

        :param seqs: indices into the scheduled list as given to :meth:`InputBatch.prepare`.
        :return: int64 rows of the step's hidden states (host; valid with the step).
        """
        seqs = np.asarray(seqs, dtype=np.int64)
        if self.seq_rows is not None:
            return self.seq_rows[seqs]
        qsl = self.metadata.host.query_start_loc
        if self.order is not None:
            packed = np.empty(len(self.order), dtype=np.int64)
            packed[self.order] = np.arange(len(self.order))
            seqs = packed[seqs]
        return qsl[seqs].astype(np.int64)

    @property
    def num_tokens(self) -> int:
        """Real tokens in the step."""
        return self.metadata.num_tokens

    @property
    def padded_num_tokens(self) -> int:
        """Tokens including padding (the model's input length)."""
        return self.metadata.padded_num_tokens

    @property
    def mode(self) -> StepMode:
        """How the step runs (the metadata's :class:`~backplane.core.metadata.StepMode`)."""
        return self.metadata.mode


class InputBatch:
    """Persistent pinned host buffer + device mirror and the per-step preparation.

    :param max_num_tokens: most (padded) tokens in one step.
    :param max_num_seqs: most sequences in one step.
    :param max_pages_per_seq: most KV pages one sequence can hold
        (``ceil(max_model_len / page_size)``).
    :param page_size: tokens per KV page.
    :param device: where the model runs.
    :param pin_memory: pin the host buffer (default: when ``device`` is CUDA).
    """

    def __init__(
        self,
        *,
        max_num_tokens: int,
        max_num_seqs: int,
        max_pages_per_seq: int,
        page_size: int,
        device: torch.device | str = "cpu",
        pin_memory: bool | None = None,
    ) -> None:
        self.max_num_tokens = int(max_num_tokens)
        self.max_num_seqs = int(max_num_seqs)
        self.max_pages_per_seq = max(int(max_pages_per_seq), 1)
        self.page_size = int(page_size)
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        pin = on_cuda if pin_memory is None else bool(pin_memory)
        t, s, p = self.max_num_tokens, self.max_num_seqs, self.max_pages_per_seq
        # capacity in bytes of every section at its largest (+ alignment slack)
        sizes = [
            (s + 1) * 4,  # query_start_loc
            s * 4,  # query_lens
            s * 4,  # cached_lens
            s * 4,  # seq_lens
            (s + 1) * 4,  # page_indptr
            s * p * 4,  # page_indices
            s * 4,  # last_page_lens
            s * p * 4,  # block_table
            s * 4,  # state_slots
            s,  # has_initial_state
            t * 8,  # positions
            t * 8,  # slot_mapping
            t * 4,  # token_seq_ids
            s * 8,  # last_token_indices
            t * 8,  # input_ids
            s * 8,  # logits_indices
            s * 8,  # pending_src
            3 * s * 8,  # chain_position, chain_src, chain_dst
        ]
        nbytes = cdiv(sum(x + _ALIGN for x in sizes), _ALIGN) * _ALIGN
        host_t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._dev = (
            host_t
            if self.device.type == "cpu"
            else torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        )
        # Two host buffers, used in turn, when the device has its own: with
        # asynchronous steps, step N+1 is packed while step N may still be reading
        # its host metadata (a backend's plan may copy from it without blocking).
        # A buffer is reused only two steps later, after its step's tokens arrived.
        self._host_ts = [host_t] + (
            [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)]
            if self._dev is not host_t
            else []
        )
        self._host_typeds = [
            {
                np.int32: h.numpy().view(np.int32),
                np.int64: h.numpy().view(np.int64),
                np.bool_: h.numpy().view(np.bool_),
            }
            for h in self._host_ts
        ]
        self._turn = 0
        self._host_t = host_t
        self._host_typed = self._host_typeds[0]
        self._dev_typed = {
            np.int32: self._dev.view(torch.int32),
            np.int64: self._dev.view(torch.int64),
            np.bool_: self._dev.view(torch.bool),
        }
        # per host buffer: the event after the last copy that read it
        self._copy_events: list[torch.cuda.Event | None] = [None] * len(self._host_ts)
        self._on_cuda = on_cuda
        self._layouts: dict[tuple[int, int, int, int], _Layout] = {}
        # the page tables of the last step, rewritten only where a sequence's pages changed
        self._block_table = PersistentBlockTable(s, p)
        #: The previous step's sampled tokens (``[rows]`` int64 on the device) while
        #: that step is still running: decode tokens whose request's last token is a
        #: placeholder (``request.pending_source_row >= 0``) are read from it on the
        #: device. ``None``: every input token is known on the host.
        self.pending_source: torch.Tensor | None = None
        #: the packet of the last step prepared or adopted (``None`` before the first)
        self.last_step: StepPacket | None = None

    @property
    def nbytes(self) -> int:
        """Size of the host (and device) buffer in bytes."""
        return int(self._host_t.numel())

    # -- packing ---------------------------------------------------------------

    def _layout(self, n: int, padded: int, width: int) -> _Layout:
        """Return the packed layout (host and device views) for a step's shape.

        Sections are packed back to back in the order of :data:`_SECTIONS`
        (``page_indices``, whose length changes most often, last; the logits
        indices get room for every sequence). So the device address of every
        tensor depends only on ``(num_seqs, padded_num_tokens, block-table
        width)``: a CUDA graph captured for that shape reads the current step's
        values from the same addresses. Layouts are cached by shape, so a steady
        decode step creates only the ``page_indices`` and ``logits_indices`` views.
        """
        key = (n, padded, width, self._turn)
        layout = self._layouts.get(key)
        if layout is not None:
            return layout
        if len(self._layouts) >= 256:
            self._layouts.clear()
        counts = {"seq": n, "seq1": n + 1, "tok": padded, "table": n * width}
        host: dict[str, np.ndarray] = {}
        dev: dict[str, torch.Tensor] = {}
        off = 0
        for name, dtype, dim in _SECTIONS:
            count = counts[dim]
            size = _ITEMSIZE[dtype]
            start = off // size
            h = self._host_typed[dtype][start : start + count]
            d = self._dev_typed[dtype][start : start + count]
            if name == "block_table":
                h, d = h.reshape(n, width), d.view(n, width)
            host[name], dev[name] = h, d
            off += cdiv(count * size, _ALIGN) * _ALIGN
        layout = _Layout(host, dev, off // 4, off)
        self._layouts[key] = layout
        return layout

    def _copy(self, nbytes: int) -> None:
        """The step's one host-to-device copy of the packed prefix of the buffer."""
        if self._dev is not self._host_t:
            self._dev[:nbytes].copy_(self._host_t[:nbytes], non_blocking=True)
            if self._on_cuda:
                event = self._copy_events[self._turn]
                if event is None:
                    event = self._copy_events[self._turn] = torch.cuda.Event()
                event.record()

    # -- the step ---------------------------------------------------------------

    def prepare(
        self,
        scheduled: Sequence[ScheduledSeqLike],
        *,
        padded_num_tokens: int | None = None,
        block_table_width: int | None = None,
        mode: StepMode = EAGER,
        chain: RowChain | None = None,
    ) -> BatchInputs:
        """Build the step's inputs from the scheduled sequences.

        :param scheduled: prefill/extend sequences first, decode sequences last
            (a sequence adding one token to cached context counts as decode;
            out-of-order ones are moved behind the others, see ``sample_seqs``).
        :param padded_num_tokens: pad the flat token dimension to this count
            (CUDA-graph buckets); default: no padding.
        :param block_table_width: fixed column count of the dense block table
            (default: the most pages any sequence of the step needs, at least 1).
        :param mode: how the step will run, carried on its metadata.
        :param chain: the recurrent chain of decode rows that are chunk positions
            (:func:`chain_rows`), packed with the step and set as
            ``metadata.chained_rows``; rows past its length are padding (slot 0).
        :return: the step's :class:`BatchInputs`.
        :raises ValueError: when the step exceeds the sizes given at startup, a
            sequence's page table is too short, the batch does not fit ``mode``,
            or ``chain`` is given for a batch that is not all decode rows.
        """
        self._turn = (self._turn + 1) % len(self._host_ts)
        self._host_t = self._host_ts[self._turn]
        self._host_typed = self._host_typeds[self._turn]
        event = self._copy_events[self._turn]
        if event is not None:
            event.synchronize()  # that buffer's last copy must have read it
        n = len(scheduled)
        if n > self.max_num_seqs:
            raise ValueError(
                f"{n} sequences exceed max_num_seqs={self.max_num_seqs}; schedule fewer per step"
            )

        # -- O(1) Python per sequence: read the scheduler's facts ---------------
        q = np.fromiter((s.num_new_tokens for s in scheduled), np.int32, n)
        c = np.fromiter((s.num_cached_tokens for s in scheduled), np.int32, n)
        shape = measure_batch(
            q,
            c,
            self.page_size,
            padded_num_tokens=padded_num_tokens,
            block_table_width=block_table_width,
        )
        perm = shape.order
        if perm is not None:
            scheduled = [scheduled[i] for i in perm]
        padded = shape.padded_num_tokens
        if padded > self.max_num_tokens:
            raise ValueError(
                f"{padded} tokens exceed max_num_tokens={self.max_num_tokens}; "
                "schedule fewer tokens per step"
            )
        if shape.max_pages > self.max_pages_per_seq:
            raise ValueError(
                f"a sequence needs {shape.max_pages} pages, more than "
                f"max_pages_per_seq={self.max_pages_per_seq}"
            )
        slots = np.fromiter((s.state_slot for s in scheduled), np.int32, n)
        final = np.fromiter((s.is_prefill_chunk_final for s in scheduled), np.bool_, n)
        tables = [s.page_ids for s in scheduled]
        num_prefill = shape.num_prefill_seqs
        num_decode = n - num_prefill
        layout = self._layout(n, padded, shape.block_table_width)
        h = layout.host
        decodes = scheduled[num_prefill:]
        if chain is not None:
            if num_prefill or perm is not None:
                raise ValueError(
                    "chained rows are one-token decode rows in their given order; this batch "
                    "has prefill sequences: give no chain for it"
                )
            _pack_chain(h, chain, n)
        pending = None
        every = False
        if self.pending_source is not None and num_decode:
            src = h["pending_src"][:num_decode]
            src[:] = np.fromiter(
                (s.request.pending_source_row for s in decodes), np.int64, num_decode
            )
            held = src >= 0
            if held.any():
                pending = src
                every = bool(held.all())
        # prompt/extend slices, then the one token of each decode (at position num_cached_tokens)
        token_ids = [
            s.request.token_buffer[s.num_cached_tokens : s.num_cached_tokens + s.num_new_tokens]
            for s in scheduled[:num_prefill]
        ]
        if every:
            # Every decode token is a placeholder (value 0 on the host) that the device fills
            # in from the step in flight: the steady state of asynchronous decoding, where
            # reading each request's buffer would only fetch those zeros.
            token_ids.append(_zeros(num_decode))
        elif num_decode:
            token_ids.append(
                np.fromiter(
                    (s.request.token_buffer[s.num_cached_tokens] for s in decodes),
                    np.int64,
                    num_decode,
                )
            )

        # -- vectorised: every field, straight into the pinned buffer -------------

        total_pages = shape.total_pages
        pi_start = layout.page_indices_start
        page_indices = self._host_typed[np.int32][pi_start : pi_start + total_pages]
        host = HostBatch(page_indices=page_indices, **{f: h[f] for f in _SECTION_FIELDS})
        sample_rows = pack_batch(
            shape,
            tables,
            slots,
            host,
            token_ids=token_ids,
            input_ids=h["input_ids"],
            sample=final,
            logits_indices=h["logits_indices"],
            table=self._block_table,
        )
        num_sample = len(sample_rows)
        sample_seqs = sample_rows if perm is None else perm[sample_rows]

        # -- one host-to-device copy; device views cached by shape ----------------
        self._copy(layout.page_indices_offset + total_pages * 4)
        if pending is not None:
            self._fill_pending(layout.dev, shape.num_tokens - num_decode, num_decode, every)
        if mode is not EAGER:
            mode.check(n, num_decode, padded)
        step = StepPacket(
            num_seqs=n,
            num_prefill_seqs=num_prefill,
            num_prefill_tokens=shape.num_tokens - num_decode,
            padded_num_tokens=padded,
            block_table_width=shape.block_table_width,
            total_pages=total_pages,
            num_sample=num_sample,
            max_query_len=shape.max_query_len,
            max_seq_len=shape.max_seq_len,
            mode=mode,
            sample_seqs=sample_seqs,
            order=perm,
            nbytes=layout.page_indices_offset + total_pages * 4,
        )
        inputs = self._inputs(layout, host, step)
        if chain is not None:
            d = layout.dev
            inputs.metadata.chained_rows = ChainedRows(
                chain.num_positions, d["chain_position"], d["chain_src"], d["chain_dst"]
            )
            inputs.row_chain = chain
        return inputs

    def _inputs(self, layout: _Layout, host: HostBatch, step: StepPacket) -> BatchInputs:
        """The step's :class:`BatchInputs` over the device views of ``layout``."""
        d = layout.dev
        total_pages, num_sample = step.total_pages, step.num_sample
        if len(layout.views) > 4096:
            layout.views.clear()
        page_indices_dev = layout.views.get(total_pages)
        if page_indices_dev is None:
            pi_start = layout.page_indices_start
            page_indices_dev = self._dev_typed[np.int32][pi_start : pi_start + total_pages]
            layout.views[total_pages] = page_indices_dev
        logits_dev = layout.views.get(-1 - num_sample)
        if logits_dev is None:
            logits_dev = d["logits_indices"][:num_sample]
            layout.views[-1 - num_sample] = logits_dev
        num_decode = step.num_seqs - step.num_prefill_seqs
        metadata = BatchMetadata(
            num_prefill_seqs=step.num_prefill_seqs,
            num_prefill_tokens=step.num_prefill_tokens,
            num_decode_seqs=num_decode,
            num_decode_tokens=num_decode,
            padded_num_tokens=step.padded_num_tokens,
            page_size=self.page_size,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            host=host,
            page_indices=page_indices_dev,
            mode=step.mode,
            **{f: d[f] for f in _SECTION_FIELDS},
        )
        inputs = BatchInputs(
            metadata=metadata,
            input_ids=d["input_ids"],
            positions=d["positions"],
            logits_indices=logits_dev,
            sample_seqs=step.sample_seqs,
            order=step.order,
        )
        self.last_step = step
        return inputs

    # -- the same step on another rank --------------------------------------------

    def step_bytes(self, step: StepPacket, *, device: bool) -> torch.Tensor:
        """The packed bytes of the step just prepared (or being adopted), as a uint8 tensor.

        Another rank of a tensor-parallel group receives these bytes into its
        own buffers (:meth:`adopt`), so its graphs read the step from their own
        fixed addresses.

        :param step: the step's packet (:attr:`last_step`, or the packet being adopted).
        :param device: the device buffer (with the in-flight tokens already
            resolved into ``input_ids``) instead of the host buffer.
        :return: a view of the first ``step.nbytes`` bytes of that buffer.
        """
        buf = self._dev if device else self._host_t
        return buf[: step.nbytes]

    def adopt(self, step: StepPacket, host_bytes: np.ndarray) -> BatchInputs:
        """Take over a step another rank prepared: its host bytes, its shape and mode.

        The device side is either the host bytes themselves (CPU: one buffer)
        or, when the device has its own buffer, whatever the caller writes into
        :meth:`step_bytes` (``device=True``) before the step runs, e.g. a
        broadcast from the rank that prepared it.

        :param step: the packet of the step (its shape, counts, mode, sample order).
        :param host_bytes: the first ``step.nbytes`` bytes of the preparing rank's host buffer.
        :return: the step's inputs over this batch's own buffers.
        :raises ValueError: the packet does not fit this batch's buffers.
        """
        if step.nbytes > self.nbytes or len(host_bytes) != step.nbytes:
            raise ValueError(
                f"a step of {step.nbytes} bytes ({len(host_bytes)} given) does not fit this "
                f"batch's {self.nbytes}-byte buffers; every rank must use the same limits"
            )
        self._turn = (self._turn + 1) % len(self._host_ts)
        self._host_t = self._host_ts[self._turn]
        self._host_typed = self._host_typeds[self._turn]
        event = self._copy_events[self._turn]
        if event is not None:
            event.synchronize()  # that buffer's last copy must have read it
        layout = self._layout(step.num_seqs, step.padded_num_tokens, step.block_table_width)
        self._host_t[: step.nbytes].numpy()[:] = host_bytes
        pi_start = layout.page_indices_start
        page_indices = self._host_typed[np.int32][pi_start : pi_start + step.total_pages]
        host = HostBatch(page_indices=page_indices, **{f: layout.host[f] for f in _SECTION_FIELDS})
        return self._inputs(layout, host, step)

    def _fill_pending(
        self, d: dict[str, torch.Tensor], first_decode_row: int, n: int, every: bool
    ) -> None:
        """Overwrite placeholder decode tokens with the previous step's samples, on the device.

        Runs on the compute stream after the step's input copy and before its
        forward, and after the previous step's sampling: stream order makes the
        read safe without a host synchronisation.

        :param every: every decode row is a placeholder (the steady state of
            asynchronous decoding): one gather straight into the rows, instead of
            five launches that keep the rows whose tokens the host already had.
            At batch 1 each launch is host time the device waits for.
        """
        assert self.pending_source is not None
        ids = d["input_ids"][first_decode_row : first_decode_row + n]
        src = d["pending_src"][:n]
        if every and self.pending_source.dtype == ids.dtype:
            torch.index_select(self.pending_source, 0, src, out=ids)
            return
        picked = self.pending_source.index_select(0, src.clamp(min=0))
        ids.copy_(torch.where(src >= 0, picked, ids))


@dataclass(frozen=True)
class StepPacket:
    """The shape of a prepared step: what rebuilds its inputs from its packed bytes.

    A tensor-parallel driver sends it (with the step's bytes) to the other
    ranks, which rebuild the same :class:`BatchInputs` over their own buffers
    (:meth:`InputBatch.adopt`) instead of preparing the step again.

    :param num_seqs: sequences of the step (padding sequences included).
    :param num_prefill_seqs: prefill/extend sequences (they come first).
    :param num_prefill_tokens: tokens of those sequences.
    :param padded_num_tokens: the model's input length.
    :param block_table_width: columns of the dense block table.
    :param total_pages: entries of ``page_indices``.
    :param num_sample: sequences that sample this step.
    :param max_query_len: most new tokens of one sequence.
    :param max_seq_len: longest sequence (cached + new).
    :param mode: how the step runs.
    :param sample_seqs: see :class:`BatchInputs`.
    :param order: see :class:`BatchInputs`.
    :param nbytes: bytes of the packed prefix of the buffers.
    """

    num_seqs: int
    num_prefill_seqs: int
    num_prefill_tokens: int
    padded_num_tokens: int
    block_table_width: int
    total_pages: int
    num_sample: int
    max_query_len: int
    max_seq_len: int
    mode: StepMode
    sample_seqs: np.ndarray
    order: np.ndarray | None
    nbytes: int


@dataclass
class _Layout:
    """Views of one packed layout; ``page_indices`` follows at ``page_indices_start``."""

    host: dict[str, np.ndarray]
    dev: dict[str, torch.Tensor]
    page_indices_start: int  # in int32 elements
    page_indices_offset: int  # in bytes
    #: device views of variable length, by page count (>= 0) or -1 - sampled rows
    views: dict[int, torch.Tensor] = field(default_factory=dict)


#: The packed sections (name, dtype, length class), page_indices excluded (it goes last).
_SECTIONS: tuple[tuple[str, type, str], ...] = (
    ("positions", np.int64, "tok"),
    ("slot_mapping", np.int64, "tok"),
    ("input_ids", np.int64, "tok"),
    ("last_token_indices", np.int64, "seq"),
    ("logits_indices", np.int64, "seq"),  # room for all; the step uses a prefix
    ("pending_src", np.int64, "seq"),  # decode rows: source row of a pending token, or -1
    ("chain_position", np.int64, "seq"),  # chained rows (verify graphs of recurrent models)
    ("chain_src", np.int64, "seq"),
    ("chain_dst", np.int64, "seq"),
    ("query_start_loc", np.int32, "seq1"),
    ("query_lens", np.int32, "seq"),
    ("cached_lens", np.int32, "seq"),
    ("seq_lens", np.int32, "seq"),
    ("page_indptr", np.int32, "seq1"),
    ("last_page_lens", np.int32, "seq"),
    ("state_slots", np.int32, "seq"),
    ("token_seq_ids", np.int32, "tok"),
    ("has_initial_state", np.bool_, "seq"),
    ("block_table", np.int32, "table"),
)

_ITEMSIZE = {np.int32: 4, np.int64: 8, np.bool_: 1}

_zeros_cache = np.zeros(256, dtype=np.int64)
_zeros_cache.flags.writeable = False


def _zeros(n: int) -> np.ndarray:
    """A read-only int64 view of ``n`` zeros, made once and grown on demand (no per-step array).

    :param n: how many.
    :return: the zeros.
    """
    global _zeros_cache
    if n > len(_zeros_cache):
        grown = np.zeros(max(n, 2 * len(_zeros_cache)), dtype=np.int64)
        grown.flags.writeable = False
        _zeros_cache = grown
    return _zeros_cache[:n]


@dataclass
class ScratchRequest:
    """The request of a padding or profiling sequence: only its tokens are read."""

    token_buffer: np.ndarray
    pending_source_row: int = -1  # its token is never an unresolved placeholder


@dataclass
class ScratchSeq:
    """A sequence on the scratch page and state slot: graph padding, captures, profiling.

    Its tokens are zeros and every page is ``NULL_PAGE``, so running it touches
    no live cache data.
    """

    request: ScratchRequest
    num_new_tokens: int
    num_cached_tokens: int
    page_ids: np.ndarray
    state_slot: int = NULL_SLOT
    is_prefill_chunk_final: bool = False


@dataclass
class PositionRow:
    """One position of a scheduled sequence's chunk, run as a one-token decode row.

    See :func:`position_rows`. Its fields are those of :class:`ScheduledSeqLike`.
    """

    request: Any
    num_new_tokens: int
    num_cached_tokens: int
    page_ids: np.ndarray
    state_slot: int
    is_prefill_chunk_final: bool


def position_rows(scheduled: Sequence[ScheduledSeqLike]) -> tuple[list[PositionRow], np.ndarray]:
    """Spread each sequence's chunk into one decode row per position.

    Row ``i`` of a sequence with ``c`` cached tokens adds its token ``c + i``
    to a context of ``c + i`` tokens, on the sequence's pages, so attending
    each row to its own context gives the chunk's causal attention once every
    row's key is in the cache. Only the chunk's last row samples (when the
    chunk ends its prompt or is a decode). For models without recurrent state
    only: a recurrent layer needs the chunk as one sequence.

    :param scheduled: the step's sequences, each with cached context.
    :return: the rows (sequence by sequence, in order) and ``[len(scheduled)]``
        the first row of each sequence.
    """
    rows: list[PositionRow] = []
    starts = np.empty(len(scheduled), dtype=np.int64)
    for j, s in enumerate(scheduled):
        starts[j] = len(rows)
        c, last = s.num_cached_tokens, s.num_new_tokens - 1
        req, pages, slot = s.request, s.page_ids, s.state_slot
        rows.extend(
            PositionRow(req, 1, c + i, pages, slot, i == last and s.is_prefill_chunk_final)
            for i in range(s.num_new_tokens)
        )
    return rows, starts


@dataclass(frozen=True)
class RowChain:
    """The host side of a verify graph's chained rows (:class:`~backplane.core.metadata.ChainedRows`).

    See :func:`chain_rows`. Arrays cover the step's real rows; padding rows follow.

    :param num_positions: the most chunk positions of the bucket (the recurrent ops'
        loop count, fixed per captured graph).
    :param position: ``int64 [rows]`` each row's position in its chunk.
    :param src_slots: ``int64 [rows]`` the state slot each row reads.
    :param dst_slots: ``int64 [rows]`` the state slot each row writes.
    """

    num_positions: int
    position: np.ndarray
    src_slots: np.ndarray
    dst_slots: np.ndarray

    @classmethod
    def padding(cls, num_positions: int) -> RowChain:
        """A chain of padding rows only (every row on slot 0): the batch a graph is captured with.

        :param num_positions: the bucket's loop count.
        """
        empty = np.zeros(0, dtype=np.int64)
        return cls(int(num_positions), empty, empty, empty)


def chain_rows(
    scheduled: Sequence[ScheduledSeqLike], first_scratch_slot: int, stride: int, num_positions: int
) -> RowChain:
    """The state slots the recurrent layers chain the rows of :func:`position_rows` through.

    Row ``i`` of sequence ``j`` (own slot ``o``, chunk of ``L`` tokens) reads
    slot ``o`` when ``i == 0``, else what row ``i - 1`` wrote; it writes slot
    ``o`` when it is the chunk's last row, else scratch slot
    ``first_scratch_slot + j * stride + i``. So the sequence's slot ends
    holding the state after its whole chunk, as in any step, and the state
    after every earlier position stays in a scratch slot of its own, where
    the verification finds it (:meth:`~backplane.core.metadata.VerifyStates.chained`).

    :param scheduled: the step's sequences, in the order :func:`position_rows` spreads them.
    :param first_scratch_slot: the first slot of the verification scratch region
        (the worker allocates ``max_num_seqs * num_speculative_tokens`` slots there).
    :param stride: scratch slots per sequence (``num_speculative_tokens``).
    :param num_positions: the bucket's loop count (at least the longest chunk).
    :return: the chain.
    :raises ValueError: a chunk is longer than ``stride + 1`` or ``num_positions``.
    """
    n = len(scheduled)
    lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
    own = np.fromiter((s.state_slot for s in scheduled), np.int64, n)
    longest = int(lens.max()) if n else 0
    if longest > min(stride + 1, num_positions):
        raise ValueError(
            f"a chunk of {longest} tokens does not fit a chain of {num_positions} positions "
            f"with {stride} scratch slots per sequence; run it as one sequence instead"
        )
    seq = np.repeat(np.arange(n, dtype=np.int64), lens)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    pos = np.arange(len(seq), dtype=np.int64) - starts[seq]
    dst = np.where(pos == lens[seq] - 1, own[seq], first_scratch_slot + seq * stride + pos)
    src = np.where(pos == 0, own[seq], np.roll(dst, 1))
    return RowChain(int(num_positions), pos, src, dst)


def _pack_chain(h: dict[str, np.ndarray], chain: RowChain, n: int) -> None:
    """Write a chain into the host sections of a layout of ``n`` rows, padding rows on slot 0.

    :raises ValueError: the chain has more rows than the batch.
    """
    rows = len(chain.position)
    if rows > n:
        raise ValueError(f"a chain of {rows} rows does not fit a batch of {n} rows")
    for name, values in (
        ("chain_position", chain.position),
        ("chain_src", chain.src_slots),
        ("chain_dst", chain.dst_slots),
    ):
        section = h[name][:n]
        section[:rows] = values
        section[rows:] = 0 if name == "chain_position" else NULL_SLOT


def scratch_seq(new: int, cached: int, page_size: int) -> ScratchSeq:
    """A scratch sequence adding ``new`` tokens to ``cached`` ones (one new token = a decode).

    :param new: tokens this step.
    :param cached: tokens already in the (scratch) cache.
    :param page_size: tokens per page.
    """
    total = cached + new
    pages = np.full(cdiv(total, page_size), NULL_PAGE, dtype=np.int32)
    return ScratchSeq(ScratchRequest(np.zeros(total, dtype=np.int32)), new, cached, pages)


def scratch_prefill(num_tokens: int, max_model_len: int, page_size: int) -> list[ScratchSeq]:
    """Scratch prefill sequences of ``num_tokens`` tokens in all, none longer than the model.

    A step of more tokens than one sequence may hold is built from several
    sequences, as a real step of that size is.

    :param num_tokens: tokens in all.
    :param max_model_len: the longest a sequence may be.
    :param page_size: tokens per KV page.
    :return: the sequences (each on ``NULL_PAGE`` pages, slot ``NULL_SLOT``).
    """
    seqs = []
    left = num_tokens
    while left > 0:
        n = min(left, max_model_len)
        seqs.append(scratch_seq(n, 0, page_size))
        left -= n
    return seqs
