"""The description of one ragged batch, shared by every layer of every family.

Layout rules (all backends rely on them):

* One flat token dimension. Prefill sequences (including chunked-prefill
  "extend" chunks that continue from cached context) come first, decode
  sequences (exactly one new token on top of cached context) last. Tokens
  ``[num_tokens, padded_num_tokens)`` are padding.
* Sequence ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]``; its
  cached context is ``cached_lens[i]`` tokens and its total length after this
  step is ``seq_lens[i] = cached_lens[i] + query_lens[i]``.
* Paged KV: the pages of sequence ``i`` are
  ``page_indices[page_indptr[i]:page_indptr[i+1]]`` (also as a dense
  ``block_table[i, :]``, padded with page 0); the last page holds
  ``last_page_lens[i]`` tokens. Token ``t`` is written to cache slot
  ``slot_mapping[t] = page * page_size + offset``; padding tokens have ``-1``
  and must not be written.
* Recurrent state: sequence ``i`` reads and writes state slot ``state_slots[i]``;
  ``has_initial_state[i]`` says whether that slot holds the state after
  ``cached_lens[i]`` tokens (otherwise the recurrence starts from zeros).
* Page 0 and state slot 0 are reserved scratch entries: the cache managers never
  hand them to a request, so padded sequences (CUDA-graph buckets) may point at
  them without touching live data.

Host values (counts, lengths) are read from :attr:`BatchMetadata.host`, never
from the device tensors, so no op needs to synchronise with the device.

Every batch also says how the engine runs its step (:attr:`BatchMetadata.mode`,
a :class:`StepMode`): eagerly, as the captured decode graph of a batch-size
bucket, or through the piecewise graphs of a token-count bucket. The model
runner decides it once, when it prepares the step; backends read it in ``plan``
instead of guessing from the batch's shape.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

import numpy as np
import torch

NULL_PAGE = 0
NULL_SLOT = 0


class StepKind(enum.Enum):
    """How a step runs; see :class:`StepMode`."""

    EAGER = "eager"
    DECODE_GRAPH = "decode_graph"
    PIECEWISE = "piecewise"


@dataclass(frozen=True)
class StepMode:
    """How the engine runs one step, decided once when the step is prepared.

    * eager (:data:`EAGER`): the model runs op by op, no padding required;
    * decode graph of bucket ``b``: a decode-only batch padded to ``b`` tokens
      (the graph runner pads it with scratch sequences to exactly ``b``
      sequences) replays the monolithic graph captured for ``b``; every cached
      op runs inside it;
    * piecewise bucket ``t``: the tokens are padded to ``t`` and the captured
      static segments of bucket ``t`` replay, the cached ops running eagerly
      between them.

    A decode graph may also run a step of short chunks on cached context (the
    ``d + 1`` positions a speculative step verifies) as one decode row per
    position, each row attending up to its own position (``rows_share_pages``).
    Rows of one sequence then read each other's keys from the pages, so a
    backend that appends a row's key inside its attention kernel must append
    every row's keys before any row attends.

    :param kind: one of :class:`StepKind`.
    :param bucket: the decode batch size or the piecewise token count (0 when eager).
    :param rows_share_pages: the decode rows are positions of chunks (see above).
    """

    kind: StepKind = StepKind.EAGER
    bucket: int = 0
    rows_share_pages: bool = False

    @classmethod
    def decode_graph(cls, bucket: int, *, rows_share_pages: bool = False) -> StepMode:
        """The mode of a decode step replayed as the graph of ``bucket`` sequences.

        :param bucket: the captured batch size (rows).
        :param rows_share_pages: the rows are positions of chunks, several per
            sequence (a verification step; see the class docstring).
        :return: the mode.
        """
        return cls(StepKind.DECODE_GRAPH, int(bucket), bool(rows_share_pages))

    @classmethod
    def piecewise(cls, bucket: int) -> StepMode:
        """The mode of a step run through the piecewise graphs of ``bucket`` tokens."""
        return cls(StepKind.PIECEWISE, int(bucket))

    @property
    def is_eager(self) -> bool:
        """True when no captured graph runs the step."""
        return self.kind is StepKind.EAGER

    @property
    def is_decode_graph(self) -> bool:
        """True when the whole forward, cached ops included, is a replayed decode graph."""
        return self.kind is StepKind.DECODE_GRAPH

    @property
    def is_piecewise(self) -> bool:
        """True when captured segments replay and cached ops run eagerly between them."""
        return self.kind is StepKind.PIECEWISE

    def check(self, num_seqs: int, num_decode_seqs: int, padded_num_tokens: int) -> StepMode:
        """Check that a batch of these counts can run in this mode.

        :param num_seqs: sequences of the batch, padding sequences included.
        :param num_decode_seqs: how many of them decode.
        :param padded_num_tokens: tokens including padding.
        :return: this mode.
        :raises ValueError: a decode graph of a batch that is not decode-only or
            not padded to ``bucket`` tokens, or a piecewise bucket other than the
            padded token count.
        """
        if self.kind is StepKind.DECODE_GRAPH and not (
            0 < num_seqs == num_decode_seqs <= padded_num_tokens == self.bucket
        ):
            raise ValueError(
                f"the decode graph of bucket {self.bucket} runs decode sequences padded to "
                f"{self.bucket} tokens; this batch has {num_decode_seqs} decode of {num_seqs} "
                f"sequences and {padded_num_tokens} padded tokens"
            )
        if self.kind is StepKind.PIECEWISE and padded_num_tokens != self.bucket:
            raise ValueError(
                f"piecewise bucket {self.bucket} runs {self.bucket} padded tokens; this batch "
                f"has {padded_num_tokens} (pad it to the bucket)"
            )
        return self


#: The mode of a step that runs without captured graphs.
EAGER = StepMode()


@dataclass(frozen=True)
class ChainedRows:
    """How the recurrent layers chain the decode rows of a step whose rows are chunk positions.

    In a verify graph (:attr:`StepMode.rows_share_pages`) row ``r`` is position
    ``position[r]`` of its sequence's chunk, run as one recurrent decode step:
    it reads the state in slot ``src_slots[r]`` (the sequence's own slot at
    position 0, the previous row's output slot after that) and writes its
    output state to slot ``dst_slots[r]``, never to its source. The last row
    of a chunk writes the sequence's own slot; the others write scratch slots,
    which also keep the state after every position for the verification (see
    :meth:`VerifyStates.chained`). Padding rows read and write the reserved
    slot 0 at position 0.

    Rows of one position never depend on each other, so a recurrent op runs
    its decode update once per position ``j < num_positions``, each time over
    the rows whose position is ``j``. The tensors are views of persistent
    buffers at addresses that depend only on the row count, so a captured
    graph reads each step's values.

    :param num_positions: the most positions of a chunk the step may hold
        (host; fixed per captured bucket).
    :param position: ``int64 [rows]`` the chunk position of each row.
    :param src_slots: ``int64 [rows]`` the slot each row reads its state from.
    :param dst_slots: ``int64 [rows]`` the slot each row writes its state to.
    """

    num_positions: int
    position: torch.Tensor
    src_slots: torch.Tensor
    dst_slots: torch.Tensor


@dataclass(frozen=True)
class VerifyStates:
    """Where a speculative verification step keeps the recurrent state after each chunk position.

    A sequence verifying ``d`` proposed tokens runs a chunk of ``d + 1`` tokens
    (the last committed token, then the proposals) as an extend sequence.
    Only the first ``j + 1`` of them (``j`` accepted proposals) may advance
    its conv and SSM / delta states, and ``j`` is known only after sampling.
    So the recurrent ops of such a step also write the state after position
    ``t`` of each verifying chunk into a scratch slot, and
    :meth:`keep_slots` then names the copies (scratch slot -> the sequence's
    own slot) that leave each sequence's state after its last accepted token.
    The sequence's own slot is still left holding the state after the whole
    chunk, as in any step, so keeping the last position needs no scratch slot.

    Build one with :meth:`build`; a step carries it as
    :attr:`BatchMetadata.verify_states` (``None``: no verification chunk).

    :param seqs_host: ``int64 [V]``, the batch index of each verifying sequence.
    :param slots_host: ``int64 [V, W]``, the scratch slot receiving the state
        after position ``t`` of verifying sequence ``v`` (``-1``: not kept).
    :param max_len: the longest verifying chunk (host), the recurrence's step count.
    :param seqs: ``seqs_host`` on the device.
    :param slots: ``slots_host`` on the device, ``-1`` replaced by the reserved
        scratch slot 0 so that the ops write unkept positions there, unread.
    :param sources: ``[V, W]`` on the device: the slot that holds the state
        after position ``t`` once the step ran (the scratch slot, the
        sequence's own slot for its last position, else slot 0).
    :param own_slots: ``[V]`` on the device, each verifying sequence's own slot.
    """

    seqs_host: np.ndarray
    slots_host: np.ndarray
    max_len: int
    seqs: torch.Tensor
    slots: torch.Tensor
    sources: torch.Tensor
    own_slots: torch.Tensor

    @classmethod
    def build(
        cls, host: HostBatch, seqs: np.ndarray, slots: np.ndarray, device: torch.device | str
    ) -> VerifyStates:
        """Describe the verifying sequences of a batch and their scratch slots.

        :param host: the batch's host arrays (query lengths, state slots).
        :param seqs: the batch index of each verifying sequence.
        :param slots: ``[len(seqs), W]``, the scratch slot for the state after
            each chunk position (``-1``: not kept), ``W`` at least the longest chunk.
        :param device: where the batch's tensors live.
        :return: the description.
        :raises ValueError: a scratch slot is the reserved slot 0, appears
            twice, or is a slot of a sequence of the batch (the ops would
            overwrite a state they still read), or a chunk is longer than ``W``.
        """
        seqs = np.asarray(seqs, dtype=np.int64).reshape(-1)
        slots = np.asarray(slots, dtype=np.int64).reshape(len(seqs), -1)
        lens = host.query_lens[seqs].astype(np.int64)
        own = host.state_slots[seqs].astype(np.int64)
        if len(lens) and lens.max() > slots.shape[1]:
            raise ValueError(
                f"a verifying chunk has {int(lens.max())} tokens but the scratch slot table only "
                f"{slots.shape[1]} columns; give one column per chunk position"
            )
        # columns past a shorter chunk's end hold no position
        slots = np.where(np.arange(slots.shape[1])[None, :] < lens[:, None], slots, -1)
        kept = slots[slots >= 0]
        if (kept == NULL_SLOT).any() or len(np.unique(kept)) != len(kept):
            raise ValueError(
                "verification scratch slots must be distinct and never the reserved slot 0; "
                "give each kept chunk position its own slot, or -1 not to keep it"
            )
        if np.isin(kept, host.state_slots).any():
            raise ValueError(
                "a verification scratch slot is also a sequence's own state slot in this batch; "
                "allocate scratch slots apart from the sequences' slots"
            )
        sources = np.where(slots >= 0, slots, NULL_SLOT)
        return cls._of(seqs, slots, sources, own, lens, device)

    @classmethod
    def chained(
        cls,
        first_rows: np.ndarray,
        lens: np.ndarray,
        own_slots: np.ndarray,
        dst_slots: np.ndarray,
        device: torch.device | str,
    ) -> VerifyStates:
        """Describe the verifying sequences of a step whose chunks ran as chained decode rows.

        The rows already wrote the state after every position to their output
        slots (:class:`ChainedRows`): position ``t < len - 1`` to a scratch slot,
        the last position to the sequence's own slot. So only :meth:`keep_slots`
        is meaningful; ``seqs_host`` holds each sequence's first row, and the
        recurrent ops record nothing more for such a step.

        :param first_rows: ``[V]`` the first row of each verifying sequence.
        :param lens: ``[V]`` its chunk length.
        :param own_slots: ``[V]`` its own state slot.
        :param dst_slots: ``[V, W]`` the output slot of each of its rows (``W`` at least
            the longest chunk; columns past a chunk's end are ignored).
        :param device: where the step's tensors live.
        :return: the description.
        """
        first_rows = np.asarray(first_rows, dtype=np.int64).reshape(-1)
        lens = np.asarray(lens, dtype=np.int64).reshape(-1)
        own = np.asarray(own_slots, dtype=np.int64).reshape(-1)
        dst = np.asarray(dst_slots, dtype=np.int64).reshape(len(lens), -1)
        cols = np.arange(dst.shape[1])[None, :]
        slots = np.where(cols < lens[:, None] - 1, dst, -1)
        sources = np.where(cols < lens[:, None], dst, NULL_SLOT)
        return cls._of(first_rows, slots, sources, own, lens, device)

    @classmethod
    def _of(
        cls,
        seqs: np.ndarray,
        slots: np.ndarray,
        sources: np.ndarray,
        own: np.ndarray,
        lens: np.ndarray,
        device: torch.device | str,
    ) -> VerifyStates:
        """The description from its host arrays: each chunk's last position reads the
        sequence's own slot; the device copies are made here."""
        sources[np.arange(len(lens)), lens - 1] = own
        dev = torch.device(device)

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

        return cls(
            seqs_host=seqs,
            slots_host=slots,
            max_len=int(lens.max()) if len(lens) else 0,
            seqs=put(seqs),
            slots=put(np.where(slots >= 0, slots, NULL_SLOT)),
            sources=put(sources),
            own_slots=put(own),
        )

    @classmethod
    def in_scratch_region(
        cls, host: HostBatch, seqs: np.ndarray, first_slot: int, device: torch.device | str
    ) -> VerifyStates:
        """Describe the verifying sequences with their scratch slots taken from one region.

        Verifying sequence ``v`` keeps chunk position ``t`` (every position but
        its last, which stays in its own slot) in slot
        ``first_slot + v * (W - 1) + t``, ``W`` the longest chunk. An engine
        that copies the kept states back before its next step runs can so
        reuse one region of ``max_num_seqs * num_speculative_tokens`` slots,
        past those its slot pool hands out, for every step.

        :param host: the batch's host arrays.
        :param seqs: the batch index of each verifying sequence.
        :param first_slot: the region's first slot.
        :param device: where the batch's tensors live.
        :return: the description (see :meth:`build`).
        """
        seqs = np.asarray(seqs, dtype=np.int64).reshape(-1)
        lens = host.query_lens[seqs].astype(np.int64)
        width = int(lens.max()) if len(seqs) else 1
        cols = np.arange(width)[None, :]
        region = first_slot + (np.arange(len(seqs))[:, None] * (width - 1) + cols)
        slots = np.where(cols < lens[:, None] - 1, region, -1)
        return cls.build(host, seqs, slots, device)

    def keep_slots(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Name the copies that leave each verifying sequence's state after chunk position ``j``.

        Computed on the device, so ``positions`` may come straight from the
        rejection sampler without a synchronisation.

        :param positions: ``[V]``, the position ``j`` to keep per verifying
            sequence (its accepted proposals): ``0`` keeps only the first
            chunk token, ``len - 1`` the whole chunk.
        :return: ``(src, dst)`` slot indices ``[V]`` for
            :meth:`~backplane.core.families.RecurrentBackend.copy_state_slots`
            on every recurrent state tensor of the model; a sequence keeping its
            last position copies its own slot onto itself.
        """
        j = positions.to(device=self.sources.device, dtype=torch.long)
        return self.sources.gather(1, j[:, None])[:, 0], self.own_slots


@dataclass
class HostBatch:
    """Host (numpy) arrays of a batch; see the module docstring for meanings.

    Per-sequence arrays have ``num_seqs`` rows, ``*_start_loc``/``*_indptr``
    arrays ``num_seqs + 1``, per-token arrays ``padded_num_tokens``.
    """

    query_start_loc: np.ndarray  # int32 [num_seqs + 1]
    query_lens: np.ndarray  # int32 [num_seqs]
    cached_lens: np.ndarray  # int32 [num_seqs]
    seq_lens: np.ndarray  # int32 [num_seqs]
    page_indptr: np.ndarray  # int32 [num_seqs + 1]
    page_indices: np.ndarray  # int32 [total pages]
    last_page_lens: np.ndarray  # int32 [num_seqs]
    block_table: np.ndarray  # int32 [num_seqs, max_pages_per_seq]
    state_slots: np.ndarray  # int32 [num_seqs]
    has_initial_state: np.ndarray  # bool [num_seqs]
    positions: np.ndarray  # int64 [padded_num_tokens]
    slot_mapping: np.ndarray  # int64 [padded_num_tokens], -1 for padding
    token_seq_ids: np.ndarray  # int32 [padded_num_tokens], -1 for padding
    last_token_indices: np.ndarray  # int64 [num_seqs]


@dataclass
class BatchMetadata:
    """A ragged batch: host counts and arrays plus their device copies.

    Build one with :func:`backplane.core.packing.build_batch_metadata` (tests,
    tools); the engine packs its own with the same packer
    (:mod:`backplane.core.packing`) into its persistent input buffers. Device
    tensors share names with the :class:`HostBatch` fields.
    """

    num_prefill_seqs: int
    num_prefill_tokens: int
    num_decode_seqs: int
    num_decode_tokens: int
    padded_num_tokens: int
    page_size: int
    max_query_len: int
    max_seq_len: int
    host: HostBatch
    query_start_loc: torch.Tensor
    query_lens: torch.Tensor
    cached_lens: torch.Tensor
    seq_lens: torch.Tensor
    page_indptr: torch.Tensor
    page_indices: torch.Tensor
    last_page_lens: torch.Tensor
    block_table: torch.Tensor
    state_slots: torch.Tensor
    has_initial_state: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    token_seq_ids: torch.Tensor
    last_token_indices: torch.Tensor
    #: how the engine runs this step (backends' ``plan`` reads it)
    mode: StepMode = EAGER
    #: the verifying sequences of a speculative step and where the recurrent ops
    #: keep their per-position states (``None``: no verification chunk)
    verify_states: VerifyStates | None = None
    #: the state slots recurrent ops chain a verify graph's rows through
    #: (``None``: every sequence reads and writes its own slot)
    chained_rows: ChainedRows | None = None

    @property
    def num_seqs(self) -> int:
        """Number of real sequences (prefill + decode)."""
        return self.num_prefill_seqs + self.num_decode_seqs

    @property
    def num_tokens(self) -> int:
        """Number of real tokens; rows past this are padding."""
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def device(self) -> torch.device:
        """The device the tensors live on."""
        return self.positions.device

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence adds exactly one token to cached context."""
        return self.num_prefill_seqs == 0 and self.num_decode_seqs > 0

    @classmethod
    def from_host(
        cls,
        host: HostBatch,
        *,
        num_prefill_seqs: int,
        page_size: int,
        padded_num_tokens: int,
        device: torch.device | str = "cpu",
        mode: StepMode = EAGER,
    ) -> BatchMetadata:
        """Copy a :class:`HostBatch` to ``device`` and derive the counts.

        :param host: the host arrays.
        :param num_prefill_seqs: how many leading sequences are prefill/extend.
        :param page_size: tokens per KV page.
        :param padded_num_tokens: the flat token count including padding.
        :param device: where the device tensors go.
        :param mode: how the step runs.
        :return: the metadata.
        """
        device = torch.device(device)
        num_seqs = len(host.query_lens)
        num_tokens = int(host.query_start_loc[-1]) if num_seqs else 0
        num_prefill_tokens = int(host.query_start_loc[num_prefill_seqs]) if num_seqs else 0
        tensors = {}
        for f in fields(HostBatch):
            arr = getattr(host, f.name)
            t = torch.from_numpy(np.ascontiguousarray(arr))
            tensors[f.name] = t.to(device, non_blocking=True) if device.type != "cpu" else t
        return cls(
            num_prefill_seqs=num_prefill_seqs,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_seqs=num_seqs - num_prefill_seqs,
            num_decode_tokens=num_tokens - num_prefill_tokens,
            padded_num_tokens=padded_num_tokens,
            page_size=page_size,
            max_query_len=int(host.query_lens.max()) if num_seqs else 0,
            max_seq_len=int(host.seq_lens.max()) if num_seqs else 0,
            host=host,
            mode=mode,
            **tensors,
        )
