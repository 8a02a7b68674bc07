"""Input preparation: from the scheduler's output to the step's device inputs.

:class:`InputBatch` owns one pinned host buffer and one device buffer, both
sized at startup for the engine's limits (``max_num_tokens``,
``max_num_seqs``, pages per sequence). Each step it

1. reads the few per-sequence facts it needs from the scheduled sequences
   (O(1) Python work per sequence: a handful of attribute reads);
2. computes everything else with vectorised numpy, straight into typed views
   of the host buffer, packed back to back (query offsets and positions once,
   page counts by ceil-division, page tables with one concatenation and one
   scatter, slot mapping, last-token gather indices);
3. issues ONE host-to-device copy of the packed prefix of the buffer;
4. returns :class:`BatchInputs`: the step's
   :class:`~backplane.core.metadata.BatchMetadata` (same meaning as
   :func:`~backplane.core.metadata.build_batch_metadata`), ``input_ids``,
   ``positions`` and the indices of the hidden rows to turn into logits.

The views handed out are valid until the next :meth:`InputBatch.prepare`.
Before overwriting the host buffer, ``prepare`` waits for the previous copy
to finish (an event on CUDA), so callers need not synchronise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from backplane.core.metadata import NULL_PAGE, BatchMetadata, HostBatch

_ALIGN = 8  # every section starts 8-byte aligned so typed device views are legal


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
    """

    metadata: BatchMetadata
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    sample_seqs: np.ndarray

    @property
    def num_tokens(self) -> int:
        """Real tokens in the step."""
        return self.metadata.num_tokens

    @property
    def padded_num_tokens(self) -> int:
        """Tokens including padding (the model's input length)."""
        return self.metadata.padded_num_tokens


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
        ]
        nbytes = -(-sum(x + _ALIGN for x in sizes) // _ALIGN) * _ALIGN
        self._host_t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._host = self._host_t.numpy()
        self._dev = (
            self._host_t
            if self.device.type == "cpu"
            else torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        )
        # typed views of the whole buffers, made once: a section is one slice of these
        self._host_typed = {
            np.int32: self._host.view(np.int32),
            np.int64: self._host.view(np.int64),
            np.bool_: self._host.view(np.bool_),
        }
        self._dev_typed = {
            np.int32: self._dev.view(torch.int32),
            np.int64: self._dev.view(torch.int64),
            np.bool_: self._dev.view(torch.bool),
        }
        self._copy_done: torch.cuda.Event | None = None
        self._on_cuda = on_cuda
        self._arange = np.arange(max(t, s * p, s) + 1, dtype=np.int64)
        self._sections: list[tuple[str, type, int, int, tuple[int, ...]]] = []
        self._offset = 0

    @property
    def nbytes(self) -> int:
        """Size of the host (and device) buffer in bytes."""
        return int(self._host.nbytes)

    # -- packing ---------------------------------------------------------------

    def _take(self, name: str, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
        """Reserve the next section of the host buffer and return a typed view."""
        off = self._offset
        count = shape[0] if len(shape) == 1 else shape[0] * shape[1]
        size = _ITEMSIZE[dtype]
        start = off // size
        self._offset = off + -(-(count * size) // _ALIGN) * _ALIGN
        self._sections.append((name, dtype, start, count, shape))
        view = self._host_typed[dtype][start : start + count]
        return view if len(shape) == 1 else view.reshape(shape)

    def _device_views(self) -> dict[str, torch.Tensor]:
        """Copy the packed prefix once and return typed device views of each section."""
        used = self._offset
        if self._dev is not self._host_t:
            self._dev[:used].copy_(self._host_t[:used], non_blocking=True)
            if self._on_cuda:
                self._copy_done = torch.cuda.Event()
                self._copy_done.record()
        typed = self._dev_typed
        out = {}
        for name, dtype, start, count, shape in self._sections:
            t = typed[dtype][start : start + count]
            out[name] = t if len(shape) == 1 else t.view(shape)
        return out

    # -- the step ---------------------------------------------------------------

    def prepare(
        self,
        scheduled: Sequence[ScheduledSeqLike],
        *,
        padded_num_tokens: int | None = None,
        block_table_width: int | None = None,
    ) -> BatchInputs:
        """Build the step's inputs from the scheduled sequences.

        :param scheduled: prefill/extend sequences first, decode sequences last
            (a sequence adding one token to cached context counts as decode;
            out-of-order ones are moved behind the others, see ``sample_seqs``).
        :param padded_num_tokens: pad the flat token dimension to this count
            (CUDA-graph buckets); default: no padding.
        :param block_table_width: fixed column count of the dense block table
            (default: the most pages any sequence of the step needs, at least 1).
        :return: the step's :class:`BatchInputs`.
        :raises ValueError: when the step exceeds the sizes given at startup or
            a sequence's page table is too short.
        """
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous step's copy still reads the host buffer
            self._copy_done = None
        n = len(scheduled)
        if n > self.max_num_seqs:
            raise ValueError(f"{n} sequences exceed max_num_seqs={self.max_num_seqs}")
        self._sections = []
        self._offset = 0
        take = self._take
        ps = self.page_size

        # -- O(1) Python per sequence: read the scheduler's facts ---------------
        q = take("query_lens", np.int32, (n,))
        c = take("cached_lens", np.int32, (n,))
        slots = take("state_slots", np.int32, (n,))
        q[:] = np.fromiter((s.num_new_tokens for s in scheduled), np.int32, n)
        c[:] = np.fromiter((s.num_cached_tokens for s in scheduled), np.int32, n)
        if n and q.min() < 1:
            raise ValueError("every scheduled sequence needs at least one new token")
        # One new token on top of cached context counts as decode for the kernels,
        # even when it is the last chunk of a prefill: such sequences go last.
        is_decode = (q == 1) & (c > 0)
        num_decode = int(np.count_nonzero(is_decode))
        num_prefill = n - num_decode
        perm = None
        if num_decode and not is_decode[num_prefill:].all():
            perm = np.argsort(is_decode, kind="stable")
            scheduled = [scheduled[i] for i in perm]
            q[:] = q[perm]
            c[:] = c[perm]
            is_decode = is_decode[perm]
        slots[:] = np.fromiter((s.state_slot for s in scheduled), np.int32, n)
        final = np.fromiter((s.is_prefill_chunk_final for s in scheduled), np.bool_, n)
        tables = [s.page_ids for s in scheduled]

        # -- vectorised: offsets, lengths, pages ---------------------------------
        qsl = take("query_start_loc", np.int32, (n + 1,))
        qsl[0] = 0
        np.cumsum(q, out=qsl[1:])
        num_tokens = int(qsl[n])
        padded = num_tokens if padded_num_tokens is None else int(padded_num_tokens)
        if padded < num_tokens:
            raise ValueError(f"padded_num_tokens={padded} < num_tokens={num_tokens}")
        if padded > self.max_num_tokens:
            raise ValueError(f"{padded} tokens exceed max_num_tokens={self.max_num_tokens}")
        seq_lens = take("seq_lens", np.int32, (n,))
        np.add(c, q, out=seq_lens)
        pages_needed = (seq_lens + (ps - 1)) // ps
        max_pages = int(pages_needed.max()) if n else 0
        if max_pages > self.max_pages_per_seq:
            raise ValueError(
                f"a sequence needs {max_pages} pages, more than max_pages_per_seq={self.max_pages_per_seq}"
            )
        page_indptr = take("page_indptr", np.int32, (n + 1,))
        page_indptr[0] = 0
        np.cumsum(pages_needed, out=page_indptr[1:])
        total_pages = int(page_indptr[n])

        # one concatenation of every page table, then one gather of the needed prefixes
        page_indices = take("page_indices", np.int32, (total_pages,))
        if n:
            have = np.fromiter(map(len, tables), np.int64, n)
            if (have < pages_needed).any():
                bad = int(np.argmax(have < pages_needed))
                raise ValueError(
                    f"sequence {bad} needs {pages_needed[bad]} pages for {seq_lens[bad]} tokens, "
                    f"its page table has {have[bad]}"
                )
            flat = np.concatenate(tables)
            if len(flat) == total_pages:
                page_indices[:] = flat
            else:
                src_start = np.cumsum(have) - have
                shift = np.repeat(src_start - page_indptr[:n], pages_needed)
                page_indices[:] = flat[self._arange[:total_pages] + shift]
        width = max(max_pages, 1) if block_table_width is None else int(block_table_width)
        if width < max_pages:
            raise ValueError(f"block_table_width={width} < {max_pages} pages needed")
        block_table = take("block_table", np.int32, (n, width))
        block_table.fill(NULL_PAGE)
        page_seq = np.repeat(self._arange[:n], pages_needed)
        page_col = self._arange[:total_pages] - np.repeat(page_indptr[:n], pages_needed)
        block_table.reshape(-1)[page_seq * width + page_col] = page_indices
        last_page_lens = take("last_page_lens", np.int32, (n,))
        np.subtract(seq_lens, (pages_needed - 1) * ps, out=last_page_lens)
        has_initial = take("has_initial_state", np.bool_, (n,))
        np.greater(c, 0, out=has_initial)

        # -- per-token arrays (positions computed once) ---------------------------
        positions = take("positions", np.int64, (padded,))
        token_seq_ids = take("token_seq_ids", np.int32, (padded,))
        slot_mapping = take("slot_mapping", np.int64, (padded,))
        if num_tokens == n:  # every sequence adds one token (decode or 1-token prefill)
            token_seq = self._arange[:n]
            positions[:n] = c
        else:
            token_seq = np.repeat(self._arange[:n], q)
            np.add(self._arange[:num_tokens], (c - qsl[:n])[token_seq], out=positions[:num_tokens])
        pos = positions[:num_tokens]
        token_seq_ids[:num_tokens] = token_seq
        slot_mapping[:num_tokens] = block_table.reshape(-1)[token_seq * width + pos // ps]
        slot_mapping[:num_tokens] *= ps
        slot_mapping[:num_tokens] += pos % ps
        positions[num_tokens:] = 0
        token_seq_ids[num_tokens:] = -1
        slot_mapping[num_tokens:] = -1
        last_tok = take("last_token_indices", np.int64, (n,))
        np.subtract(qsl[1:], 1, out=last_tok)

        # -- input ids: prompt/extend slices, then the last token of each decode ---
        input_ids = take("input_ids", np.int64, (padded,))
        num_prefill_tokens = int(qsl[num_prefill])
        if num_prefill:
            chunks = [
                s.request.token_buffer[s.num_cached_tokens : s.num_cached_tokens + s.num_new_tokens]
                for s in scheduled[:num_prefill]
            ]
            input_ids[:num_prefill_tokens] = np.concatenate(chunks)
        if num_decode:
            # the one token at position num_cached_tokens (the newest one while decoding)
            input_ids[num_prefill_tokens:num_tokens] = np.fromiter(
                (s.request.token_buffer[s.num_cached_tokens] for s in scheduled[num_prefill:]),
                np.int64,
                num_decode,
            )
        input_ids[num_tokens:] = 0

        sample_rows = np.flatnonzero(final)
        logits_indices = take("logits_indices", np.int64, (len(sample_rows),))
        logits_indices[:] = last_tok[sample_rows]
        sample_seqs = sample_rows if perm is None else perm[sample_rows]

        dev = self._device_views()
        host = HostBatch(
            query_start_loc=qsl,
            query_lens=q,
            cached_lens=c,
            seq_lens=seq_lens,
            page_indptr=page_indptr,
            page_indices=page_indices,
            last_page_lens=last_page_lens,
            block_table=block_table,
            state_slots=slots,
            has_initial_state=has_initial,
            positions=positions,
            slot_mapping=slot_mapping,
            token_seq_ids=token_seq_ids,
            last_token_indices=last_tok,
        )
        metadata = BatchMetadata(
            num_prefill_seqs=num_prefill,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_seqs=num_decode,
            num_decode_tokens=num_tokens - num_prefill_tokens,
            padded_num_tokens=padded,
            page_size=ps,
            max_query_len=int(q.max()) if n else 0,
            max_seq_len=int(seq_lens.max()) if n else 0,
            host=host,
            query_start_loc=dev["query_start_loc"],
            query_lens=dev["query_lens"],
            cached_lens=dev["cached_lens"],
            seq_lens=dev["seq_lens"],
            page_indptr=dev["page_indptr"],
            page_indices=dev["page_indices"],
            last_page_lens=dev["last_page_lens"],
            block_table=dev["block_table"],
            state_slots=dev["state_slots"],
            has_initial_state=dev["has_initial_state"],
            positions=dev["positions"],
            slot_mapping=dev["slot_mapping"],
            token_seq_ids=dev["token_seq_ids"],
            last_token_indices=dev["last_token_indices"],
        )
        return BatchInputs(
            metadata=metadata,
            input_ids=dev["input_ids"],
            positions=dev["positions"],
            logits_indices=dev["logits_indices"],
            sample_seqs=sample_seqs,
        )


_ITEMSIZE = {np.int32: 4, np.int64: 8, np.bool_: 1}
