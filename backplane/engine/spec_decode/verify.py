"""The engine's side of speculative decoding: drafts before a step, verification after it.

Before each step :meth:`SpecDecoder.propose` asks the proposer for drafts of
every decoding request that may speculate and writes them after the
request's last token (``Request.spec_token_ids``); the scheduler then runs
the token and its drafts as one extend chunk. After the forward,
:meth:`SpecDecoder.verify` projects the hidden states of all ``d + 1``
positions of each such sequence to logits and rejection-samples them
(:mod:`backplane.engine.sampling.rejection`): the accepted drafts are
committed ahead of the step's sampled token, which is replaced by the
verified one.

A request speculates only when its next tokens depend on nothing but the
logits and its grammar: no penalties, ``min_tokens`` reached, no logprobs and
no prompt logprobs still owed (its other steps decode one token as usual).
A request with a grammar (structured output) has its draft cut at the first
token the grammar refuses, and each of its ``d + 1`` positions is verified
under the grammar's mask after the drafts before it; the engine then advances
its matcher by exactly the tokens committed (:meth:`SpecDecoder.committed`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from backplane.core.metadata import VerifyStates
from backplane.engine.request import Request, RequestStatus
from backplane.engine.sampling.rejection import rejection_sample
from backplane.engine.sampling.rows import GrammarBitmask
from backplane.engine.spec_decode.config import SpeculativeConfig
from backplane.engine.spec_decode.factory import check_target, create_proposer
from backplane.engine.spec_decode.proposer import ProposalContext, ProposalRequest

if TYPE_CHECKING:
    from backplane.engine.executor import Executor
    from backplane.engine.outputs import EngineStepOutput
    from backplane.engine.sched.output import ScheduledSeq
    from backplane.engine.structured_output.manager import StructuredOutputManager
    from backplane.engine.worker.inputs import BatchInputs

__all__ = ["SpecDecoder", "SpecStats", "may_speculate"]

logger = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Speculative-decoding counters of an engine (monotonic).

    :param verified_seqs: sequences verified (one per sequence and step with drafts).
    :param draft_tokens: draft tokens verified.
    :param accepted_tokens: draft tokens accepted.
    """

    verified_seqs: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over verified draft tokens (0 before any)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verified sequence step: accepted drafts + the verified token."""
        return 1.0 + self.accepted_tokens / self.verified_seqs if self.verified_seqs else 0.0


def may_speculate(req: Request, *, pending: bool = False) -> bool:
    """Whether a running request's next step may verify drafts.

    :param req: a request.
    :param pending: answer as if its token still on the device were committed
        (whether committing the step in flight would let it speculate).
    :return: True when it decodes one token on cached context and its sampling
        reads nothing but the logits and its grammar (see the module docstring).
    """
    if req.status is not RequestStatus.RUNNING or req.final_pending:
        return False
    if req.has_pending_token and not pending:
        return False
    c = req.num_computed_tokens
    if c == 0 or req.num_tokens - c != 1:
        return False
    p = req.sampling_params
    if getattr(p, "has_penalties", False):
        return False
    if req.num_output_tokens < getattr(p, "min_tokens", 0) or req.logprobs is not None:
        return False
    return req.prompt_logprobs is None or req.prompt_logprobs.complete


class SpecDecoder:
    """Drafts for the engine's decoding requests and verifies them after the forward.

    :param config: the speculative configuration.
    :param model: the target model's name (for messages).
    :param recurrent: the target has recurrent state.
    :param tensor_parallel_size: ranks the target is split over.
    :param max_model_len: the engine's longest prompt + output.
    :param vocab_size: the target's vocabulary (drafts outside it are dropped).
    :param target: the target model (``draft_model`` and ``mtp`` proposers read it).
    :param backends: the target's ``{family: backend object}`` (for those proposers).
    :param max_num_seqs: the most sequences the engine runs at once.
    :param cuda_graphs: the worker replays decode graphs: a model-running proposer
        captures its drafting steps too.
    :raises ConfigError: for a target or method that cannot speculate.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        *,
        model: str,
        recurrent: bool,
        tensor_parallel_size: int,
        max_model_len: int,
        vocab_size: int,
        target: Any = None,
        backends: dict[str, Any] | None = None,
        max_num_seqs: int = 1,
        cuda_graphs: bool = False,
    ) -> None:
        check_target(
            config, model=model, recurrent=recurrent, tensor_parallel_size=tensor_parallel_size
        )
        self.config = config
        #: the target has recurrent state: its verification steps keep per-position states
        self.recurrent = bool(recurrent)
        self.proposer = create_proposer(
            config,
            target=target,
            backends=backends,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            cuda_graphs=cuda_graphs,
        )
        #: the MTP proposer reads the hidden state each request's last token was sampled from
        self._keeps_hidden = config.method == "mtp"
        #: request id -> that hidden state (``[hidden]`` on the device)
        self._hidden: dict[str, torch.Tensor] = {}
        #: request id -> the hidden states of the prefill positions whose next token is
        #: known, not yet handed to the proposer: ``(positions, [n, hidden])`` per chunk
        self._prefill: dict[str, list[tuple[np.ndarray, torch.Tensor]]] = {}
        # requests the proposer may hold state for (released once they stop running)
        self._known: set[str] = set()
        self.max_model_len = int(max_model_len)
        self.vocab_size = int(vocab_size)
        self.stats = SpecStats()
        #: accepted drafts of the step just verified, by request id (read by commit)
        self.accepted: dict[str, list[int]] = {}
        # request id -> (request, index of its first token of the verified step)
        self._starts: dict[str, tuple[Request, int]] = {}

    def propose(
        self, running: Sequence[Request], grammars: StructuredOutputManager | None = None
    ) -> None:
        """Draft for every running request that may speculate (see :func:`may_speculate`).

        Each draft is written after the request's last token (the scheduler
        reads it from there) and kept in ``Request.spec_token_ids``; others get none.
        A request with a grammar keeps its draft only up to the first token the
        grammar refuses, so no refused token is ever verified.

        :param running: the scheduler's running requests.
        :param grammars: the engine's grammars, their matchers at the committed tokens
            (``None``: no request has one).
        """
        reqs: list[Request] = []
        asks: list[ProposalRequest] = []
        live = {req.request_id for req in running}
        # preempted (or finished and not yet forgotten): their proposer state goes
        self._forget(self._known - live)
        self._known = live
        for req in running:
            req.spec_token_ids.clear()
            room = 0
            if may_speculate(req) and (not self._keeps_hidden or req.request_id in self._hidden):
                # the drafts and the verified token must fit max_tokens and the model length
                room = min(
                    req.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1,
                )
            if room <= 0:
                if not self._hands_prefill(req):
                    continue
                # no draft, but its prefill's hidden states go to the proposer's cache now
                # rather than waiting (and taking memory) until it drafts
                room = 0
            reqs.append(req)
            asks.append(
                ProposalRequest(req.request_id, req.all_token_ids, room, req.num_computed_tokens)
            )
        if not asks:
            return
        context = None
        if self._keeps_hidden:
            context = ProposalContext(
                hidden_states=torch.stack([self._hidden[a.request_id] for a in asks]),
                prefill_states=[self._take_prefill(a.request_id) for a in asks],
            )
        drafts = self.proposer.propose(asks, context)
        for req, ask, draft in zip(reqs, asks, drafts, strict=True):
            draft = [int(t) for t in draft[: ask.max_tokens]]
            if draft and (min(draft) < 0 or max(draft) >= self.vocab_size):
                draft = []
            if draft and grammars is not None and req.request_id in grammars:
                draft = draft[: grammars.valid_draft_length(req.request_id, draft)]
            if not draft:
                continue
            n = req.num_tokens
            req.token_buffer[n : n + len(draft)] = draft
            req.spec_token_ids.extend(draft)

    def _hands_prefill(self, req: Request) -> bool:
        """Whether a request that does not draft now still hands its prefill's hidden states
        to the proposer: it has some, has sampled since (so its next propose may come at
        any step) and its tokens are all on the host."""
        rid = req.request_id
        return (
            rid in self._prefill
            and rid in self._hidden
            and req.status is RequestStatus.RUNNING
            and not req.has_pending_token
        )

    def _take_prefill(self, request_id: str) -> tuple[np.ndarray, torch.Tensor] | None:
        """The request's kept prefill hidden states as one ``(positions, hidden)``, forgotten
        here (the proposer keeps what it makes of them), or ``None``."""
        chunks = self._prefill.pop(request_id, None)
        if not chunks:
            return None
        if len(chunks) == 1:
            return chunks[0]
        return np.concatenate([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])

    @property
    def shares_async_steps(self) -> bool:
        """Whether the engine may schedule asynchronously between steps with drafts: the
        proposer can tell from the committed tokens alone when a draft is worth waiting
        for (:meth:`lookup_due`)."""
        return callable(getattr(self.proposer, "may_draft", None))

    def lookup_due(self, running: Sequence[Request]) -> bool:
        """Whether the step in flight should be committed before the coming step's drafts.

        A draft continues a request's latest token, which, with a step in
        flight, is still on the device. A request whose committed tokens (all
        but that one) already continue an earlier match (the proposer's
        ``may_draft``) is likely to get a draft once it is committed: then it is
        worth waiting for. One whose committed tokens match nothing is left in
        flight, and looks again at the next step with one more token committed,
        so a repeat is found at most a step late. A request with no token in
        flight that may speculate makes the step wait too, so that a step with
        drafts never runs beside one in flight. Which steps carry drafts changes
        only the speed: verification keeps what decoding without them gives.

        :param running: the scheduler's running requests.
        :return: ``True`` when the step in flight should be committed first.
        """
        may_draft = getattr(self.proposer, "may_draft", None)
        for req in running:
            if not may_speculate(req, pending=True):
                continue
            if not req.has_pending_token or may_draft is None:
                return True
            committed = req.all_token_ids[: req.num_tokens - 1]
            if may_draft(committed):
                return True
        return False

    def mark_verification(
        self, inputs: BatchInputs, scheduled: Sequence[ScheduledSeq], first_scratch_slot: int
    ) -> None:
        """Before the forward of a recurrent target: mark the step's verifying chunks.

        Sets ``inputs.metadata.verify_states``
        (:meth:`~backplane.core.metadata.VerifyStates.in_scratch_region`), so that the
        recurrent ops keep the state after every position of each sequence's drafts in
        scratch slots from ``first_scratch_slot`` on; :meth:`verify` then copies each
        sequence's state after its last accepted token back into its own slot. Does
        nothing for a target without recurrent state.

        :param inputs: the step's prepared inputs.
        :param scheduled: the scheduler's sequences, as given to input preparation.
        :param first_scratch_slot: the first state slot past those the slot pool hands out
            (the worker allocates ``max_num_seqs * num_speculative_tokens`` more).

        A step replayed as a verify graph (``inputs.row_chain`` set) already
        chains its rows' states through scratch slots of that region
        (:func:`~backplane.engine.worker.inputs.chain_rows`, from the same
        ``first_scratch_slot``); its description names those slots instead
        (:meth:`~backplane.core.metadata.VerifyStates.chained`).
        """
        if not self.recurrent:
            return
        meta = inputs.metadata
        idx = np.fromiter((i for i, s in enumerate(scheduled) if s.num_draft_tokens), np.int64)
        if not len(idx):
            meta.verify_states = None
            return
        chain = inputs.row_chain
        if chain is not None:
            first = inputs.first_token_rows(idx)
            lens = np.fromiter((scheduled[i].num_new_tokens for i in idx), np.int64, len(idx))
            own = np.fromiter((scheduled[i].state_slot for i in idx), np.int64, len(idx))
            cols = first[:, None] + np.arange(int(lens.max()))[None, :]
            dst = chain.dst_slots[np.minimum(cols, len(chain.dst_slots) - 1)]
            meta.verify_states = VerifyStates.chained(first, lens, own, dst, meta.device)
            return
        if inputs.order is not None:  # scheduled index -> packed sequence index
            packed = np.empty(len(inputs.order), dtype=np.int64)
            packed[inputs.order] = np.arange(len(inputs.order))
            idx = packed[idx]
        meta.verify_states = VerifyStates.in_scratch_region(
            meta.host, idx, first_scratch_slot, meta.device
        )

    @torch.inference_mode()
    def verify(
        self,
        executor: Executor,
        hidden: torch.Tensor,
        inputs: BatchInputs,
        scheduled: Sequence[ScheduledSeq],
        reqs: Sequence[Request],
        tokens: torch.Tensor,
        grammars: StructuredOutputManager | None = None,
    ) -> None:
        """Rejection-sample the step's drafts; write each verified sequence's token into
        ``tokens`` and keep its accepted drafts in :attr:`accepted`.

        A sequence with a grammar is verified under one mask per position (the
        grammar after the drafts before it); its matcher is left at the committed
        tokens, for the engine to advance by :meth:`committed` after the commit.

        :param executor: the engine's executor: the LM head and the recurrent state copies
            run on its worker(s), every rank of a split target.
        :param hidden: the step's hidden states.
        :param inputs: the step's inputs.
        :param scheduled: the scheduler's sequences, as given to input preparation.
        :param reqs: the requests of ``inputs.sample_seqs``, in that order.
        :param tokens: ``[len(reqs)]`` the step's sampled tokens on the device (updated).
        :param grammars: the engine's grammars (``None``: no request has one).
        """
        self.accepted = {}
        self._starts = {}
        if self._keeps_hidden:
            self._keep_prefill(hidden, inputs, scheduled)
        idx = [i for i, s in enumerate(scheduled) if s.num_draft_tokens]
        if not idx:
            if self._keeps_hidden:
                self._keep_hidden(hidden, inputs.logits_indices, reqs)
            return
        seqs = [scheduled[i] for i in idx]
        d = np.fromiter((s.num_draft_tokens for s in seqs), np.int64, len(seqs))
        k = int(d.max())
        first = inputs.first_token_rows(np.asarray(idx, dtype=np.int64))
        # row j of a sequence is its position j (positions past its drafts repeat its last)
        rows = first[:, None] + np.minimum(np.arange(k + 1)[None, :], d[:, None])
        dev = hidden.device
        if inputs.logits is not None:  # a verify graph projected every row already
            at = torch.from_numpy(rows.reshape(-1)).to(dev)
            logits = inputs.logits.index_select(0, at).view(len(seqs), k + 1, -1)
        else:
            logits = executor.compute_logits(hidden, rows.reshape(-1)).view(len(seqs), k + 1, -1)
        drafts = np.zeros((len(seqs), k), dtype=np.int64)
        for b, s in enumerate(seqs):
            drafts[b, : d[b]] = s.request.spec_token_ids[: d[b]]
        out = rejection_sample(
            logits,
            torch.from_numpy(drafts).to(dev),
            d,
            [s.request.sampling_params for s in seqs],
            np.fromiter((s.request.sampling_seed for s in seqs), np.int64, len(seqs)),
            np.fromiter((s.request.num_output_tokens for s in seqs), np.int64, len(seqs)),
            grammar=self._draft_masks(seqs, drafts, d, grammars),
        )
        vs = inputs.metadata.verify_states
        if vs is not None:
            # recurrent layers: each sequence's state after its last accepted token
            executor.keep_verified_states(*vs.keep_slots(out.num_accepted))
        verified = out.tokens.cpu().numpy()
        accepted = out.num_accepted.cpu().numpy()
        executor.check_results()
        row_of = {id(r): i for i, r in enumerate(reqs)}
        rows_out = []
        finals = []
        for b, s in enumerate(seqs):
            req = s.request
            a = int(accepted[b])
            self.accepted[req.request_id] = verified[b, :a].tolist()
            self._starts[req.request_id] = (req, req.num_output_tokens)
            rows_out.append(row_of[id(req)])
            finals.append(int(verified[b, a]))
        tokens[torch.tensor(rows_out, device=tokens.device)] = torch.tensor(
            finals, dtype=tokens.dtype, device=tokens.device
        )
        if self._keeps_hidden:
            # a verified sequence's token was sampled from the row after its last accepted draft
            sample_rows = inputs.logits_indices.clone()
            sample_rows[torch.tensor(rows_out, device=sample_rows.device)] = torch.as_tensor(
                first + accepted, dtype=sample_rows.dtype
            ).to(sample_rows.device)
            self._keep_hidden(hidden, sample_rows, reqs)
        st = self.stats
        st.verified_seqs += len(seqs)
        st.draft_tokens += int(d.sum())
        st.accepted_tokens += int(accepted.sum())

    @staticmethod
    def _draft_masks(
        seqs: Sequence[ScheduledSeq],
        drafts: np.ndarray,
        num_drafts: np.ndarray,
        grammars: StructuredOutputManager | None,
    ) -> GrammarBitmask | None:
        """The grammar masks of every position of the verifying sequences that have one.

        :param seqs: the verifying sequences.
        :param drafts: ``[len(seqs), K]`` their drafts.
        :param num_drafts: ``[len(seqs)]`` drafts per sequence.
        :param grammars: the engine's grammars, or ``None``.
        :return: masks whose rows index the flattened ``[len(seqs) * (K + 1)]`` positions,
            or ``None`` when no sequence has a grammar.
        """
        if grammars is None or not len(grammars):
            return None
        width = drafts.shape[1] + 1
        rows: list[np.ndarray] = []
        masks: list[torch.Tensor] = []
        for b, s in enumerate(seqs):
            mask = grammars.draft_bitmask(
                s.request.request_id, drafts[b, : num_drafts[b]].tolist(), width
            )
            if mask is not None:
                rows.append(np.arange(b * width, (b + 1) * width, dtype=np.int64))
                masks.append(mask)
        if not masks:
            return None
        return GrammarBitmask(np.concatenate(rows), torch.cat(masks))

    def committed(self) -> dict[str, list[int]]:
        """The tokens each sequence verified in the step committed, after the commit.

        Its accepted drafts and its sampled token, cut at the one that finished it:
        what its grammar must take.

        :return: request id -> the tokens, in order.
        """
        return {
            rid: req.output_token_ids[start:].tolist() for rid, (req, start) in self._starts.items()
        }

    def _keep_hidden(
        self, hidden: torch.Tensor, rows: torch.Tensor, reqs: Sequence[Request]
    ) -> None:
        """Keep, per request, the hidden state its step's token was sampled from.

        :param hidden: the step's hidden states.
        :param rows: ``[len(reqs)]`` the row of each request's sampled token.
        :param reqs: the step's sampling requests.
        """
        kept = hidden.index_select(0, rows[: len(reqs)].to(hidden.device))
        for j, req in enumerate(reqs):
            self._hidden[req.request_id] = kept[j]

    def _keep_prefill(
        self, hidden: torch.Tensor, inputs: BatchInputs, scheduled: Sequence[ScheduledSeq]
    ) -> None:
        """Keep the hidden states of the step's prefill positions whose next token is known.

        A chunk without drafts computes positions ``c .. c + n - 1``; every one
        but the last of a chunk that ends the prompt (its next token is the one
        sampled now, whose state :meth:`_keep_hidden` keeps) has its next token
        in the request already. The MTP layer runs at each of them once the
        proposer gets them, so its attention covers the prompt as in training.
        Positions read from the prefix cache were not computed: they are skipped.

        :param hidden: the step's hidden states.
        :param inputs: the step's inputs.
        :param scheduled: the scheduler's sequences, as given to input preparation.
        """
        idx = [
            i
            for i, s in enumerate(scheduled)
            if not s.num_draft_tokens and s.num_new_tokens > int(s.is_prefill_chunk_final)
        ]
        if not idx:
            return
        first = inputs.first_token_rows(np.asarray(idx, dtype=np.int64))
        for i, row in zip(idx, first.tolist(), strict=True):
            s = scheduled[i]
            n = s.num_new_tokens - int(s.is_prefill_chunk_final)
            c = s.num_cached_tokens
            chunks = self._prefill.setdefault(s.request.request_id, [])
            # a recomputed request (preempted, restarted) replaces what it kept from c on
            chunks[:] = [(p[p < c], h[: int((p < c).sum())]) for p, h in chunks if p[0] < c]
            # a copy: the step's hidden-state buffer is reused by the next step
            chunks.append((np.arange(c, c + n, dtype=np.int64), hidden[row : row + n].clone()))

    def _forget(self, request_ids: set[str]) -> None:
        """Drop what is kept for requests that stopped running (the proposer's state too)."""
        if not request_ids:
            return
        self.proposer.release(request_ids)
        for rid in request_ids:
            self._hidden.pop(rid, None)
            self._prefill.pop(rid, None)
        self._known -= request_ids

    def deliver(self, outs: Sequence[EngineStepOutput]) -> None:
        """Give each verified request's output every token it committed in the step.

        :param outs: the step's outputs (their ``new_token_ids`` are replaced).
        """
        # a finished request's proposer state (a draft cache) goes now, not at the next
        # step's proposal: an engine left idle would hold it
        self._forget({o.request_id for o in outs if o.finished} & self._known)
        starts, self._starts = self._starts, {}
        self.accepted = {}
        if not starts:
            return
        for o in outs:
            hit = starts.get(o.request_id)
            if hit is not None and o.new_token_ids:
                req, start = hit
                # the verified step's token comes last; any before it were committed by the
                # step that was in flight before this one (and are delivered first)
                o.new_token_ids = o.new_token_ids[:-1] + req.output_token_ids[start:].tolist()
