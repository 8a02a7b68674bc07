"""Continuous batching: which requests run this step, and how many tokens each.

Every step the scheduler fills a token budget (``max_num_tokens``) and a
sequence budget (``max_num_seqs``):

1. **Decodes first.** Running requests with one token left to compute (one
   decode token each) are scheduled before anything else, in arrival order,
   because their latency is what users see between tokens.
2. **Running prefills next.** Requests in the middle of a chunked prefill get
   the next chunk, ``min(tokens left, budget left)``.
3. **Admission.** Waiting requests are admitted first-come-first-served with
   two-phase admission (:mod:`backplane.engine.kv_cache.manager`): each one's
   cached prefix is claimed, its chunk is sized with the *claimed* reuse, its
   pages reserved; then the whole batch is onboarded and allocated at once.
   Admission stops at the first request that does not fit (no overtaking) and
   is skipped in a step that had to preempt.

When a running request needs a page and none is free, the most recently
admitted running request that is not scheduled this step is preempted: its
pages are freed (cached ones stay reusable) and it is requeued at the *front*
of the waiting queue; on readmission it recomputes prompt + generated tokens
("preemption by recompute"). The budget is never exceeded: every token
scheduled is subtracted from it.

A step that failed restarts its requests (:meth:`Scheduler.restart`, the same
give-up-and-recompute as a preemption). Each restarted request then runs in a
step of its own until it commits a token, so a request that breaks every step
it is in ends with :attr:`FinishReason.ERROR` after ``max_step_failures``
attempts while the others go on.

Output order (what input preparation relies on, see
:mod:`backplane.core.metadata`): prefill/extend sequences first, decode
sequences last, where a *decode* sequence is one that adds exactly one token
on top of cached context (``num_new_tokens == 1 and num_cached_tokens > 0``);
a one-token final prefill chunk therefore sits with the decodes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from backplane.core.errors import ConfigError, RequestError
from backplane.engine.kv_cache.manager import Claim, KVCacheManager, RequestKV
from backplane.engine.request import FinishReason, Request, RequestStatus
from backplane.engine.sched.output import ScheduledSeq, SchedulerOutput

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerOutput", "SchedulerStats"]

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    """Scheduler counters (monotonic)."""

    steps: int = 0
    scheduled_tokens: int = 0
    preemptions: int = 0
    admitted: int = 0
    finished: int = 0
    aborted: int = 0
    restarted: int = 0  #: requests restarted after a failed step
    failed: int = 0  #: requests finished with an error after too many failed steps


class Scheduler:
    """Continuous-batching scheduler over a :class:`KVCacheManager`.

    :param kv: the KV-cache manager (pages, prefix cache, state slots).
    :param max_num_seqs: most sequences per step (and running at once).
    :param max_num_tokens: most new tokens per step (the token budget).
    :param max_step_failures: a request that took part in this many failed
        steps in a row (without committing a token) is finished with
        :attr:`FinishReason.ERROR` instead of being restarted again, so a
        request that breaks every step cannot stall the engine.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_tokens: int,
        max_step_failures: int = 3,
    ) -> None:
        if max_num_seqs < 1 or max_num_tokens < 1:
            raise ConfigError(
                f"max_num_seqs={max_num_seqs} and max_num_tokens={max_num_tokens} must be >= 1"
            )
        if max_num_tokens < max_num_seqs:
            raise ConfigError(
                f"max_num_tokens={max_num_tokens} < max_num_seqs={max_num_seqs}: every running "
                "sequence needs one token of budget per decode step; raise max_num_tokens or "
                "lower max_num_seqs"
            )
        self.kv = kv
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_tokens = int(max_num_tokens)
        self.max_step_failures = max(int(max_step_failures), 1)
        self._requests: dict[str, Request] = {}  # live (not finished)
        self._waiting: deque[Request] = deque()
        self._running: dict[str, Request] = {}  # admission order
        self._finished_pending: list[Request] = []
        # live requests restarted after a failed step and not yet past a committed token
        self._suspects: dict[str, Request] = {}
        self._step = 0
        self.stats = SchedulerStats()

    # -- queue ----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request.

        :raises RequestError: if the id is already live or the request is not new.
        :raises OutOfKVMemoryError: if the request could not fit in the whole KV cache;
            nothing else is affected.
        """
        rid = request.request_id
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in use; give each request a new id")
        if request.status is not RequestStatus.WAITING or request.num_output_tokens:
            raise RequestError(f"request {rid!r} was already scheduled; create a new Request")
        self.kv.check_fits(request)
        self._requests[rid] = request
        self._waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Abort a request, freeing its pages and state slot.

        :return: False if no live request has that id.
        """
        if not self._end(request_id, FinishReason.ABORT):
            return False
        self.stats.aborted += 1
        return True

    def abort_request(self, request_id: str) -> bool:
        """Same as :meth:`abort`."""
        return self.abort(request_id)

    def finish_now(self, request_id: str, reason: FinishReason) -> bool:
        """Finish a live request between steps for a reason its last token does not carry
        (its structured-output grammar is complete), freeing its pages and state slot.

        :param request_id: the request; it must have no token being sampled.
        :param reason: the finish reason to report.
        :return: False if no live request has that id.
        """
        if not self._end(request_id, reason):
            return False
        self.stats.finished += 1
        return True

    def _end(self, request_id: str, reason: FinishReason) -> bool:
        """Take a live request out of the running or waiting queue and finish it."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            del self._running[request_id]
        else:
            self._waiting.remove(req)
        self._finish(req, reason)
        return True

    def pop_finished(self) -> list[Request]:
        """Requests finished since the last :meth:`pop_finished` or :meth:`schedule` call.

        Every finished request is reported exactly once: by this method or in
        the ``finished`` field of the next :class:`SchedulerOutput`, whichever
        comes first.
        """
        done, self._finished_pending = self._finished_pending, []
        return done

    def get_request(self, request_id: str) -> Request | None:
        """The live request with that id, if any."""
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self._requests)

    @property
    def num_running(self) -> int:
        """Running requests (counted, not copied)."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Waiting requests (counted, not copied)."""
        return len(self._waiting)

    @property
    def running(self) -> list[Request]:
        """Running requests in admission order (a copy)."""
        return list(self._running.values())

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests, next to admit first (a copy)."""
        return list(self._waiting)

    # -- scheduling -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step (see the module docstring for the policy).

        :return: the step; run it, then call :meth:`update` with the sampled tokens.
        """
        self._step += 1
        step = self._step
        kv = self.kv
        budget = self.max_num_tokens
        prefills: list[ScheduledSeq] = []
        decodes: list[ScheduledSeq] = []
        preempted: list[Request] = []
        running = list(self._running.values())
        only = None
        if self._suspects:
            # A request restarted after a failed step runs alone until it commits a token,
            # so a request that makes every step fail fails only its own steps.
            only = next(iter(self._suspects.values()))
            if only.status is RequestStatus.RUNNING:
                running = [only]
            else:
                if self._waiting[0] is not only:
                    self._waiting.remove(only)
                    self._waiting.appendleft(only)
                budget = self._admit(budget, step, prefills, decodes, limit=1)
                if prefills or decodes:
                    running = []
                # else it does not fit yet: the others run (without it) and make room

        # 1. decodes (and one-token final chunks): one token each. This loop is the
        # per-step cost of a decode batch, so it does O(1) plain-attribute work per
        # request and calls into the KV manager only when a page boundary is crossed.
        ps = kv.page_size
        is_running = RequestStatus.RUNNING
        num_prefilling = 0
        for req in running:
            if budget == 0:
                break
            if req.status is not is_running or req.final_pending:
                continue  # a token being sampled is its last: nothing more to compute
            c = req.num_computed_tokens
            if req.num_tokens - c != 1:
                num_prefilling += 1
                continue
            st: RequestKV = req.kv_state
            drafts = req.spec_token_ids
            if drafts:
                # speculative lookahead: the token and its drafts as one extend chunk,
                # pages and budget reserved for all of them
                del drafts[budget - 1 :]
                if drafts and c + 1 + len(drafts) > st.num_pages * ps:
                    if not self._make_room(req, 1 + len(drafts), preempted):
                        drafts.clear()  # no room to speculate: a plain decode
            n = 1 + len(drafts)
            if c + n > st.num_pages * ps and not self._make_room(req, n, preempted):
                self._preempt(req, preempted)
                continue
            req.scheduled_step = step
            seq = ScheduledSeq(req, n, c, st.table, st.slot, True, n - 1)
            if c and n == 1:
                decodes.append(seq)
            else:
                prefills.append(seq)
            budget -= n

        # 2. chunked prefills in progress.
        if num_prefilling:
            for req in running:
                if budget == 0:
                    break
                if req.status is not is_running or req.scheduled_step == step:
                    continue
                left = req.num_uncomputed_tokens
                n = kv.snapshot_cut(req, min(left, budget))
                if not self._make_room(req, n, preempted):
                    st = req.kv_state
                    n = (st.num_pages + kv.num_available_pages) * ps
                    n = min(n - req.num_computed_tokens, budget)
                    if n < 1 or not kv.allocate_slots(req, n):
                        continue  # all memory is held by sequences running this step
                req.scheduled_step = step
                st = req.kv_state
                c = req.num_computed_tokens
                seq = ScheduledSeq(req, n, c, st.table, st.slot, n == left)
                (decodes if n == 1 and c > 0 else prefills).append(seq)
                budget -= n

        # 3. admission, first come first served, two-phase.
        if only is None and not preempted:
            budget = self._admit(budget, step, prefills, decodes)

        kv.wait_transfers()
        saves, restores = kv.take_state_copies()
        scheduled = prefills + decodes
        num_tokens = self.max_num_tokens - budget
        self.stats.steps += 1
        self.stats.scheduled_tokens += num_tokens
        finished, self._finished_pending = self._finished_pending, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_prefill_seqs=len(prefills),
            num_scheduled_tokens=num_tokens,
            preempted=preempted,
            finished=finished,
            state_saves=saves,
            state_restores=restores,
        )

    def _admit(
        self,
        budget: int,
        step: int,
        prefills: list[ScheduledSeq],
        decodes: list[ScheduledSeq],
        limit: int | None = None,
    ) -> int:
        kv = self.kv
        waiting = self._waiting
        claims: list[Claim] = []
        seats = self.max_num_seqs - len(self._running)
        if limit is not None:
            seats = min(seats, limit)
        while waiting and budget > 0 and len(claims) < seats:
            req = waiting[0]
            claim = kv.claim(req)  # phase 1
            n = min(req.num_tokens - claim.num_cached_tokens, budget)
            if kv.snapshots is not None:
                n = kv.snapshot_cut(req, n, claim.num_cached_tokens)
            if not kv.reserve(claim, n):
                kv.unclaim(claim)
                break
            waiting.popleft()
            claims.append(claim)
            budget -= n
        if not claims:
            return budget
        try:
            kv.allocate_claimed(claims)  # phase 2, for the whole batch
        except BaseException:
            # nothing of the batch was admitted (the manager unwound it): requeue it as it was
            reqs = [c.request for c in claims]
            waiting.extendleft(reversed(reqs))
            self.restart(reqs)  # counts the failure (and ends requests that keep failing)
            raise
        now = time.perf_counter()
        running = self._running
        for claim in claims:
            req = claim.request
            req.status = RequestStatus.RUNNING
            req.scheduled_step = step
            if req.stats.first_scheduled_time is None:
                req.stats.first_scheduled_time = now
            running[req.request_id] = req
            st: RequestKV = req.kv_state
            c = req.num_computed_tokens  # realised reuse (== claimed)
            n = claim.num_new_tokens
            seq = ScheduledSeq(req, n, c, st.table, st.slot, c + n == req.num_tokens)
            (decodes if n == 1 and c > 0 else prefills).append(seq)
        self.stats.admitted += len(claims)
        return budget

    def _make_room(self, req: Request, n: int, preempted: list[Request]) -> bool:
        """Allocate pages for ``n`` more tokens of ``req``, preempting others if needed."""
        kv = self.kv
        while not kv.allocate_slots(req, n):
            victim = None
            for r in reversed(self._running.values()):
                if r is not req and r.scheduled_step != self._step:
                    victim = r
                    break
            if victim is None:
                return False
            self._preempt(victim, preempted)
        return True

    def _preempt(self, req: Request, preempted: list[Request]) -> None:
        del self._running[req.request_id]
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.stats.num_preemptions += 1
        self._waiting.appendleft(req)
        preempted.append(req)
        self.stats.preemptions += 1
        logger.debug("preempted %s (KV cache full)", req.request_id)

    # -- commit ---------------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> list[Request]:
        """Commit a step whose tokens are known: :meth:`advance`, then :meth:`commit`.

        :param output: the step returned by :meth:`schedule`.
        :param sampled: the sampled token of every sequence with
            ``is_prefill_chunk_final`` (request id -> token id).
        :return: requests that finished in this update (also reported in the
            next output's ``finished``).
        """
        self.advance(output)
        return self.commit(output, sampled)

    def advance(self, output: SchedulerOutput) -> None:
        """Account for a launched step before its sampled tokens are known.

        Computed tokens advance (pages that just became full are offered to the
        prefix cache) and every sequence that samples gets a placeholder token,
        so the next :meth:`schedule` can run while the step is still on the
        device. A placeholder that is its request's last token by length keeps
        the request from being scheduled again.

        :param output: the step returned by :meth:`schedule` and launched since.
        """
        kv = self.kv
        running = RequestStatus.RUNNING
        # Only pages that just became full are offered to the prefix cache.
        ps = kv.page_size if kv.prefix_caching else 0
        snapshots = kv.snapshots is not None
        for s in output.scheduled:
            req = s.request
            if req.status is not running:  # aborted or finished since schedule()
                continue
            # draft tokens count as computed only once accepted (in commit)
            computed = s.num_cached_tokens + s.num_new_tokens - s.num_draft_tokens
            req.num_computed_tokens = computed
            if ps and computed // ps > req.kv_state.num_registered:
                kv.on_computed(req)
                # a recurrent model keeps its state where its prompt's last full page ends
                if snapshots and computed == kv.snapshot_position(req) and not s.num_draft_tokens:
                    kv.save_state(req)
            if s.is_prefill_chunk_final:
                req.append_placeholder()

    def commit(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, int],
        accepted: Mapping[str, Sequence[int]] | None = None,
    ) -> list[Request]:
        """Write a step's sampled tokens into its placeholders and finish requests.

        Requests finished or aborted since the step was advanced are skipped
        (their tokens are dropped); a request preempted since then still gets its
        token, which it recomputes from on readmission.

        A sequence that verified draft tokens commits its accepted drafts, then its
        sampled token, stopping at the first that finishes the request (a stop
        token or its length); its computed length then covers the accepted drafts
        and the pages holding only rejected ones go back.

        :param output: the step given to :meth:`advance`.
        :param sampled: the sampled token of every sequence with
            ``is_prefill_chunk_final`` (request id -> token id).
        :param accepted: the accepted draft tokens of sequences with draft tokens
            (request id -> tokens; a missing id accepted none).
        :return: requests that finished (also reported in the next output's ``finished``).
        """
        now = time.perf_counter()
        done: list[Request] = []
        finished = RequestStatus.FINISHED
        for s in output.scheduled:
            req = s.request
            if not s.is_prefill_chunk_final or not req.has_pending_token:
                continue
            if req.status is finished:
                continue
            try:
                token = sampled[req.request_id]
            except KeyError:
                raise KeyError(
                    f"no sampled token for request {req.request_id!r}, whose step ended its "
                    "prefill or decoded; pass one token per is_prefill_chunk_final sequence"
                ) from None
            # the tokens come as Python ints from the host copy; others are converted
            token = token if type(token) is int else int(token)
            if s.num_draft_tokens:
                reason = self._commit_verified(req, s, token, accepted, now)
            else:
                reason = req.resolve_placeholder(token, now)
            if req.num_failed_steps:  # a step of it went through: no longer suspect
                req.num_failed_steps = 0
                self._suspects.pop(req.request_id, None)
            if reason is not None:
                if req.status is RequestStatus.RUNNING:
                    del self._running[req.request_id]
                else:
                    self._waiting.remove(req)
                self._finish(req, reason)
                done.append(req)
        self.stats.finished += len(done)
        return done

    def _commit_verified(
        self,
        req: Request,
        seq: ScheduledSeq,
        token: int,
        accepted: Mapping[str, Sequence[int]] | None,
        now: float,
    ) -> FinishReason | None:
        """Commit a verified sequence's accepted drafts and sampled token (see :meth:`commit`)."""
        drafts = list(accepted.get(req.request_id, ())) if accepted else []
        st = req.stats
        st.num_spec_steps += 1
        st.num_draft_tokens += seq.num_draft_tokens
        st.num_accepted_tokens += len(drafts)
        tokens = [*drafts, token]
        reason = req.resolve_placeholder(tokens[0], now)
        for t in tokens[1:]:
            if reason is not None:
                break
            reason = req.append_token(int(t), now)
        req.spec_token_ids.clear()
        if reason is None and req.status is RequestStatus.RUNNING:
            kv = self.kv
            req.num_computed_tokens = req.num_tokens - 1  # the accepted drafts' KV is written
            kv.release_tail(req, req.num_tokens)
            if kv.prefix_caching and req.num_computed_tokens // kv.page_size > (
                req.kv_state.num_registered
            ):
                kv.on_computed(req)
        return reason

    # -- failed steps ---------------------------------------------------------------------------

    def restart(self, requests: list[Request]) -> list[Request]:
        """Take requests of a failed step back to their last committed token.

        Each request gives up its pages and state slot, as in a preemption,
        and goes back to the front of the waiting queue (in the given order):
        it recomputes its committed tokens on readmission, so a recurrent state
        the failed step advanced halfway is never used. Pages it filled in
        earlier steps stay in the prefix cache. A pending token whose step
        failed must have been dropped first (:meth:`Request.drop_placeholder`).
        A restarted request is then scheduled alone until it commits a token
        (a request that makes every step fail fails only its own steps); one
        that took part in ``max_step_failures`` failed steps in a row is
        finished with :attr:`FinishReason.ERROR` instead.

        :param requests: the failed step's requests (finished ones are skipped).
        :return: the requests finished with an error (reported like any finished one).
        """
        seen: set[str] = set()
        todo = []
        for req in requests:
            if req.is_finished or req.request_id in seen:
                continue
            seen.add(req.request_id)
            todo.append(req)
        self._count_failure(todo)
        failed = []
        requeue = []
        for req in todo:
            if req.status is RequestStatus.RUNNING:
                del self._running[req.request_id]
                self.kv.free(req)
                req.status = RequestStatus.PREEMPTED
            else:
                self._waiting.remove(req)
            if req.num_failed_steps >= self.max_step_failures:
                self._finish(req, FinishReason.ERROR)
                failed.append(req)
            else:
                requeue.append(req)
                self._suspects[req.request_id] = req
        self._waiting.extendleft(reversed(requeue))
        self.stats.restarted += len(requeue)
        self.stats.failed += len(failed)
        return failed

    def _count_failure(self, requests: list[Request]) -> None:
        for req in requests:
            req.num_failed_steps += 1
        if requests:
            logger.warning(
                "a step failed; restarting %d request(s) from their committed tokens: %s",
                len(requests),
                ", ".join(repr(r.request_id) for r in requests[:8]),
            )

    def keep_reports(self, finished: list[Request]) -> None:
        """Put back finished requests a failed step had taken out for reporting.

        :param finished: ``SchedulerOutput.finished`` of the step that failed;
            they are reported by the next :meth:`schedule` or :meth:`pop_finished`.
        """
        if finished:
            self._finished_pending[:0] = finished

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stats.finished_time = time.perf_counter()
        del self._requests[req.request_id]
        self._suspects.pop(req.request_id, None)
        self._finished_pending.append(req)

    def check_invariants(self) -> None:
        """Assert scheduler and KV bookkeeping agree (tests; O(requests + pages))."""
        live = list(self._running.values())
        assert len(live) <= self.max_num_seqs
        for r in live:
            assert r.status is RequestStatus.RUNNING
            assert r.kv_state.num_pages * self.kv.page_size >= r.num_computed_tokens
        for r in self._waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.kv_state is None or r.kv_state.num_pages == 0
        assert set(self._requests) == {r.request_id for r in live} | {
            r.request_id for r in self._waiting
        }
        self.kv.check_invariants(live)
