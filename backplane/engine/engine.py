"""The engine loop: add / abort / step -- schedule, launch on the worker, sample, commit.

:class:`Engine` keeps the requests, the scheduler and the KV-cache manager,
and runs one step at a time: the scheduler picks the step, the executor's
worker prepares its inputs, runs the model and samples on the device, and the
loop commits the tokens the step returned. With ``async_scheduling`` step
N+1 is launched while step N's tokens are still on their way to the host.
Everything on the device (model, caches, runner, graphs) sits behind the
:class:`~backplane.engine.executor.Executor`; the loop never holds it.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Sequence, Set
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from backplane.core.errors import ConfigError, EngineClosedError, InvalidFieldError
from backplane.engine.config import EngineConfig
from backplane.engine.executor import Executor, create_executor
from backplane.engine.inspection import WorkerView
from backplane.engine.outputs import (
    EngineStepOutput,
    LaunchedStep,
    PromptLaunch,
    TokenCopies,
    collect_outputs,
    keep_logprobs,
    keep_prompt_logprobs,
    to_host,
)
from backplane.engine.request import FinishReason, Request
from backplane.engine.sampling import (
    PromptLogprobRows,
    SamplerOutput,
    SamplingParams,
    check_for_model,
    seed_as_int64,
)
from backplane.engine.sched import ScheduledSeq, Scheduler, SchedulerOutput
from backplane.engine.spec_decode.factory import check_parallel
from backplane.engine.spec_decode.verify import SpecDecoder
from backplane.engine.step_rows import prompt_rows, sampling_rows
from backplane.engine.structured_output import StructuredOutputManager
from backplane.engine.worker.inputs import BatchInputs
from backplane.engine.worker.startup_timings import StartupTimings

if TYPE_CHECKING:
    from backplane.core.registry import BackendRegistry
    from backplane.engine.kv_cache.manager import KVCacheManager

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineStepOutput", "check_request_id"]


def check_request_id(request_id: object) -> str:
    """Return a caller's request id, refusing anything but a non-empty string.

    Ids are compared as given: ``123`` and ``"123"`` would be different
    requests to a caller but the same to a server, so only strings are taken.

    :raises InvalidFieldError: naming ``request_id``.
    """
    if not isinstance(request_id, str) or not request_id:
        hint = f"; pass str({request_id!r})" if isinstance(request_id, int) else ""
        raise InvalidFieldError(
            f"request_id must be a non-empty string, got {type(request_id).__name__} "
            f"{request_id!r}{hint}",
            field="request_id",
        )
    return request_id


class Engine(WorkerView):
    """The inference engine loop: requests, scheduler and KV-cache manager over an executor.

    :param config: an :class:`~backplane.engine.config.EngineConfig` (or ``None`` for
        defaults); keyword arguments override its fields.
    :param registry: the plugin registry backends are chosen from (the
        process-wide one if ``None``).
    :param overrides: configuration fields (``EngineConfig`` keys) that replace the
        config's own; their values are checked by the configuration.
    :raises ConfigError: on an invalid configuration.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        registry: BackendRegistry | None = None,
        # Any: each key is one EngineConfig field with its own type, checked there
        **overrides: Any,
    ) -> None:
        started = time.perf_counter()
        if config is None:
            config = EngineConfig.from_dict(overrides)
        elif overrides:
            config = config.merge(**overrides)
        self.config = config
        self.registry = registry
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self._closed = False
        if config.speculative_config is not None:
            # refused before any worker process starts
            check_parallel(config.speculative_config, config.tensor_parallel_size)
        self.executor: Executor = create_executor(config, registry)
        setup_started = time.perf_counter()
        worker = self.executor.driver
        self.max_model_len = worker.max_model_len
        self.vocab_size = worker.vocab_size
        self.eos_token_ids = worker.eos_token_ids
        self.page_size = worker.page_size
        self.max_num_seqs = worker.max_num_seqs
        self.max_num_tokens = worker.max_num_tokens
        self.max_pages_per_seq = worker.max_pages_per_seq
        self.num_slots = worker.num_slots
        self.num_pages = self.executor.num_pages
        self.kv_bytes = worker.kv_bytes
        self.state_bytes = worker.state_bytes
        self.scheduler = self._build_scheduler(
            worker.paged_cache_tensors(), worker.has_recurrent_state
        )
        self.async_scheduling = bool(config.async_scheduling)
        #: speculative decoding (``None`` when off): proposes drafts, verifies them
        self.spec: SpecDecoder | None = None
        if config.speculative_config is not None:
            try:
                self.spec = SpecDecoder(
                    config.speculative_config,
                    model=config.model,
                    recurrent=worker.has_recurrent_state,
                    tensor_parallel_size=config.tensor_parallel_size,
                    max_model_len=self.max_model_len,
                    vocab_size=self.vocab_size,
                    target=worker.model,
                    backends=worker.backends,
                    max_num_seqs=self.max_num_seqs,
                    cuda_graphs=worker.graph_mode.has_decode,
                )
            except BaseException:
                self.executor.shutdown()
                raise
            # A step with drafts runs synchronously (its token count is known only on the
            # host, after it ran); with a proposer that tells from the committed tokens when
            # a draft is worth waiting for (prompt lookup) the steps between overlap.
            if self.async_scheduling and not self.spec.shares_async_steps:
                logger.info("speculative decoding: steps run without asynchronous scheduling")
                self.async_scheduling = False
        # per-request sampling seeds: the request's own, or one drawn here (reproducible per run)
        self._seed_rng = np.random.default_rng(int(config.seed))
        self._inflight: LaunchedStep | None = None
        # tokens committed by an asynchronous step that raised before returning them
        self._undelivered: dict[str, int] | None = None
        self._copies: TokenCopies | None = TokenCopies(self.max_num_seqs, self.device)
        self._requests: dict[str, Request] = {}
        # live requests whose prompt logprobs are not all computed yet
        self._prompt_lp_reqs: set[Request] = set()
        self._ids = itertools.count()
        #: the grammars of requests with structured output (xgrammar loads on first use)
        self.structured_output = StructuredOutputManager(
            worker.tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            pin_memory=self.device.type == "cuda",
        )
        #: seconds per start-up phase: the driver worker's, then the engine's own
        self.startup_timings: StartupTimings = getattr(
            worker, "startup_timings", None
        ) or StartupTimings(self.device)
        done = time.perf_counter()
        self.startup_timings.add("engine setup", done - setup_started)
        # what no phase covers (configuration, executor and worker construction)
        self.startup_timings.add("other", done - started - self.startup_timings.total)
        logger.info("engine ready: model=%s %s", config.model, worker.describe())
        logger.info("%s", self.startup_timings.summary())

    def _build_scheduler(self, paged_caches: list[torch.Tensor], recurrent: bool) -> Scheduler:
        from backplane.engine.kv_cache.host_tier import HostTier
        from backplane.engine.kv_cache.manager import KVCacheManager

        cfg = self.config
        host = None
        # the host tier copies device pages in this process: it needs the driver's tensors
        # (the executor repeats its copies on any other rank)
        if cfg.host_kv_memory and paged_caches and not recurrent:
            try:
                host = HostTier.from_bytes(paged_caches, cfg.host_kv_memory)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            self.executor.mirror_host_tier(host)
        self.kv_manager: KVCacheManager = KVCacheManager(
            self.num_pages,
            self.page_size,
            num_state_slots=self.num_slots,
            enable_prefix_caching=cfg.enable_prefix_caching,
            state_snapshots=self.executor.driver.num_snapshot_slots > 0,
            host_tier=host,
            debug=cfg.debug,
        )
        return Scheduler(
            self.kv_manager,
            max_num_seqs=self.max_num_seqs,
            max_num_tokens=self.max_num_tokens,
        )

    # -- lifetime ----------------------------------------------------------------

    def shutdown(self) -> None:
        """Release what the engine holds: model, caches, graphs, buffers; idempotent.

        Unfinished requests are dropped without outputs. Afterwards the device
        memory the engine allocated is back with the driver (torch's cached
        blocks are emptied), so another engine can be created in the same
        process with the same memory; calling :meth:`add_request` or
        :meth:`step` raises :class:`EngineClosedError`.
        """
        if self._closed:
            return
        self._closed = True
        self._inflight = None
        self._copies = None
        self._undelivered = None
        self.scheduler = None
        self.executor.shutdown()
        self._requests = {}
        self._prompt_lp_reqs = set()
        self.structured_output.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        logger.info("engine shut down")

    @property
    def closed(self) -> bool:
        """True after :meth:`shutdown`."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(
                "this engine was shut down and takes no more requests; create a new one"
            )

    def add_request(
        self,
        prompt_token_ids: np.ndarray | Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request.

        Everything is checked before anything changes, so a refused request
        leaves no trace.

        :param prompt_token_ids: the prompt: a list of ints or an integer ndarray
            (an int32 one is taken with one memcpy), ids within the vocabulary.
        :param sampling_params: defaults to ``SamplingParams()``; ``top_k`` and
            ``stop_token_ids`` must be within the vocabulary.
        :param request_id: a unique string (default: generated). An id is in use
            from here until :meth:`step` returned the request's final output
            (``finished=True``), aborted requests included.
        :return: the request id.
        :raises RequestError: the request is invalid (it is not queued; others are
            unaffected); :class:`~backplane.core.errors.InvalidFieldError` names the field.
        """
        self._check_open()
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidFieldError(
                f"sampling_params must be SamplingParams, got {type(params).__name__}",
                field="sampling_params",
            )
        if request_id is None:
            rid = self._new_request_id()
        else:
            rid = check_request_id(request_id)
            if rid in self._requests:
                raise InvalidFieldError(
                    f"request id {rid!r} is already in use (a request keeps its id until step() "
                    "returned its final output, aborted ones too); pass a unique request_id",
                    field="request_id",
                )
        check_for_model(params, self.vocab_size, rid)
        spec = params.structured_outputs
        if spec is not None:
            # a cache hit when the caller compiled it ahead (AsyncLLM, the server)
            self.structured_output.compile(spec)
        req = Request(
            rid,
            prompt_token_ids,
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
        )
        req.sampling_seed = (
            seed_as_int64(params.seed)
            if params.seed is not None
            else int(self._seed_rng.integers(-(2**63), 2**63 - 1, dtype=np.int64))
        )
        self.scheduler.add_request(req)  # the last check (does it fit the KV cache?)
        self._requests[rid] = req
        if spec is not None:
            self.structured_output.add(rid, spec)
        if req.prompt_logprobs is not None and not req.prompt_logprobs.complete:
            self._prompt_lp_reqs.add(req)
        return rid

    def _new_request_id(self) -> str:
        """The next generated id that no caller's request holds."""
        while True:
            rid = str(next(self._ids))
            if rid not in self._requests:
                return rid

    def get_request(self, request_id: str) -> Request | None:
        """Return the request object (``None`` once its final output was returned by :meth:`step`)."""
        return self._requests.get(request_id)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request, freeing its pages and state slot at once.

        The next :meth:`step` reports it as finished with reason ``"abort"``;
        its id stays in use until then.

        :param request_id: the id :meth:`add_request` returned (a string).
        :return: ``True`` if the request was queued or running, ``False`` if no
            such request is (finished, aborted already, or unknown).
        :raises InvalidFieldError: ``request_id`` is not a string.
        """
        req = self._requests.get(check_request_id(request_id))
        if req is None or req.is_finished or self._closed:
            return False
        self.structured_output.discard(request_id)
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while :meth:`step` has something to do: a request queued or running, a final
        output not yet returned, or a step's tokens still on the device."""
        return bool(self._requests) or self._inflight is not None

    @property
    def num_unfinished_requests(self) -> int:
        """Requests queued or running (0 after :meth:`shutdown`)."""
        return 0 if self._closed else self.scheduler.num_unfinished

    # -- the step -----------------------------------------------------------------

    def step(self) -> list[EngineStepOutput]:
        """Run one engine step.

        With ``async_scheduling`` the step launched here runs on the device
        while the previous step's tokens are committed: the outputs returned are
        those of the previous step (and of requests finished meanwhile), so a
        request's last token arrives one call after it was sampled. Without it,
        the step's own outputs are returned. A step with a grammar row whose
        previous token is still in flight launches its forward first, then
        commits the step in flight (the grammar's mask needs that token on the
        host) and samples: the device runs the forward while the host fills the
        masks, so steps overlap with structured output too.

        A step happens whole or not at all. If anything in it raises (input
        preparation, the forward, sampling, a host-tier copy), every request
        it touched is restarted from its last committed token (its pages and
        state slot given up, so no half-advanced recurrent state is used),
        reports of requests finished earlier are kept for the next call, and
        the exception propagates. The engine is then consistent: calling
        :meth:`step` again goes on with the outputs an undisturbed run gives.
        A restarted request runs alone until it commits a token; one in
        ``scheduler.max_step_failures`` failed steps in a row is finished with
        reason ``"error"`` instead (reported by the next call).

        :return: one entry per request that got a token or finished.
        """
        self._check_open()
        if self.spec is not None:
            self._settle_for_lookup()
            self.spec.propose(self.scheduler.running, self.structured_output)
        sched = self.scheduler.schedule()  # leaves nothing half-done if it raises
        flip = self._copies.turn
        prev = self._inflight
        try:
            return self._run_step(sched)
        except BaseException:
            self._recover(sched, prev, flip)
            raise

    def _settle_for_lookup(self) -> None:
        """Commit the step in flight when a request looks for a draft at this step.

        A draft continues the request's latest token, which must be on the host;
        the committed tokens are delivered by this call (as :attr:`_undelivered`).
        If the commit raises, its requests restart from their committed tokens.
        """
        prev = self._inflight
        if prev is None or not self.spec.lookup_due(self.scheduler.running):
            return
        self._inflight = None
        flip = self._copies.turn
        try:
            self._commit_launched(prev)
        except BaseException:
            self._recover(SchedulerOutput(), prev, flip)
            raise

    def _commit_launched(self, launched: LaunchedStep) -> dict[str, int]:
        """Wait for a launched step's tokens, commit them and keep their logprobs.

        :param launched: the step that was in flight (no longer :attr:`_inflight`).
        :return: the committed tokens of the requests still live; they are also kept as
            undelivered, so a failure before this call returns still delivers them.
        """
        sampled = self._wait(launched)
        # requests aborted since the launch drop their token (commit skips them too)
        gone = {r.request_id for r in launched.reqs if r.is_finished}
        self._commit(launched.sched, sampled)
        self._keep(launched, sampled, gone)
        if gone:
            sampled = {rid: t for rid, t in sampled.items() if rid not in gone}
        # committed: delivered by this call, or by the next one if something below raises
        self._undelivered = sampled
        return sampled

    def _commit(self, sched: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Commit a step's sampled tokens: the scheduler's requests, then their grammars."""
        accepted = self.spec.accepted if self.spec is not None else None
        self.scheduler.commit(sched, sampled, accepted)
        grammars = self.structured_output
        if len(grammars):
            committed: dict[str, int | list[int]] = dict(sampled)
            if self.spec is not None:
                # a verified sequence committed its accepted drafts ahead of its token
                committed.update(self.spec.committed())
            for rid in grammars.accept(committed):
                # complete, yet its last token was no stop (ignore_eos): it ends here
                req = self._requests.get(rid)
                if req is not None and not req.is_finished and not req.has_pending_token:
                    self.scheduler.finish_now(rid, FinishReason.STOP)
            grammars.sweep(self._requests)

    def _run_step(self, sched: SchedulerOutput) -> list[EngineStepOutput]:
        """Launch, wait for and commit one scheduled step (see :meth:`step`)."""
        if sched.state_saves or sched.state_restores:
            # recurrent states of cached prefixes, queued before the step's forward
            self.executor.driver.copy_state_slots(sched.state_saves, sched.state_restores)
        verifying = self.spec is not None and any(s.num_draft_tokens for s in sched.scheduled)
        if verifying and self._inflight is not None:
            # drafts are proposed only with nothing in flight (see _settle_for_lookup)
            raise RuntimeError("a step with drafts was scheduled while another was in flight")
        launched, committed = self._launch(sched) if sched.scheduled else (None, None)
        if not self.async_scheduling or verifying:
            if launched is not None:
                self.scheduler.advance(sched)
                sampled = self._wait(launched)
                self._commit(sched, sampled)
                self._keep(launched, sampled)
            else:
                sampled = {}
            return self._collect(sched, sampled)
        prev, self._inflight = self._inflight, None
        sampled = {}
        if committed is not None:
            # the launch committed the step before it (a grammar row had to wait for it)
            sampled = committed
        elif prev is not None:
            sampled = self._commit_launched(prev)
        if launched is not None:
            # after the previous commit: pages that just became full hash real tokens
            self.scheduler.advance(sched)
            self._inflight = launched
        return self._collect(sched, sampled)

    def _recover(self, sched: SchedulerOutput, prev: LaunchedStep | None, flip: int) -> None:
        """Undo a step that raised: restart its requests from their committed tokens.

        :param sched: the failed step's scheduler output.
        :param prev: the asynchronous step that was in flight when it began.
        :param flip: the token buffer the step began with.
        """
        self._copies.turn = flip  # the failed launch's buffer is free again
        failed = [s.request for s in sched.scheduled]
        if prev is not None and self._inflight is prev:
            # The launch failed; the step before it is intact. Commit it now: a restarted
            # request must not be readmitted while its last token is still on the device.
            self._inflight = None
            try:
                self._commit_launched(prev)
            except BaseException:
                logger.exception("the step in flight failed too; restarting its requests")
                failed = [s.request for s in prev.sched.scheduled] + failed
        elif prev is not None:
            # the step in flight was taken for commit and failed (or what ran after it):
            # its tokens, and the launched step that read them on the device, are lost
            failed = [s.request for s in prev.sched.scheduled] + failed
            self._inflight = None
        # no step is in flight any more: a pending token left on these requests is lost
        for req in failed:
            if req.has_pending_token and not req.is_finished:
                req.drop_placeholder()
        self.scheduler.keep_reports(sched.finished)
        # the step's state saves may not have run: those snapshots are not trusted
        self.kv_manager.discard_state_saves(sched.state_saves)
        self.scheduler.restart(failed)

    def _launch(self, sched: SchedulerOutput) -> tuple[LaunchedStep | None, dict[str, int] | None]:
        """Prepare, run and sample one step on the device; start the tokens' copy to the host.

        :param sched: the step, scheduled while the step in flight (if any) was on the device.
        :return: the launched step (``None`` when committing the step before it finished
            every request of this one, which then is not sampled), and the committed tokens
            of the step that was in flight when a grammar row made the launch commit it
            before sampling (else ``None``).
        """
        scheduled = sched.scheduled
        prev = self._inflight
        pending = prev.tokens if prev is not None else None
        inputs = self.executor.prepare_inputs(scheduled, pending)
        if self.spec is not None:
            # verifying chunks of a recurrent target: scratch slots follow the pool's
            self.spec.mark_verification(inputs, scheduled, self.num_slots)
        prompt = self._prompt_rows(scheduled, inputs)
        hidden = self.execute(inputs)
        reqs = [scheduled[i].request for i in inputs.sample_seqs]
        committed = None
        if prev is not None and self.structured_output.waits_for_tokens(reqs):
            # The forward is queued and reads the previous tokens on the device; only the
            # grammar masks need them on the host. Committing the step in flight now lets the
            # device run the forward while the host waits, advances the matchers and fills
            # the masks; sampling is launched after that.
            self._inflight = None
            committed = self._commit_launched(prev)
            if all(s.request.is_finished for s in scheduled):
                # nothing of this step is wanted any more: left unsampled, it is not in
                # flight when the last request's final output goes out
                return None, committed
        out = self.sample(
            hidden, inputs, reqs, prompt.rows if prompt is not None else None, pending=pending
        )
        tokens = out.tokens
        if self.spec is not None:
            # the verified sequences' own tokens replace what the plain sampler drew for them
            self.spec.verify(
                self.executor, hidden, inputs, scheduled, reqs, tokens, self.structured_output
            )
        host, event = self._copies.start(tokens, wait_too=prompt is not None)
        lp_host = to_host(out.logprobs) if len(reqs) and out.logprobs is not None else None
        if prompt is not None and out.prompt_logprobs is not None:
            prompt.host = to_host(out.prompt_logprobs)
        if event is not None:
            # recorded after every copy of the step was issued: reading them waits for it
            event.record()
        for row, r in enumerate(reqs):
            r.pending_row = row
        return LaunchedStep(sched, reqs, tokens, host, event, lp_host, prompt), committed

    def _keep(
        self, launched: LaunchedStep, sampled: dict[str, int], gone: Set[str] = frozenset()
    ) -> None:
        """After a commit: keep the step's logprobs and prompt logprobs in their requests."""
        keep_logprobs(launched, sampled, gone)
        if launched.prompt is not None:
            keep_prompt_logprobs(launched, gone)
            for req, _, _ in launched.prompt.entries:
                if req.prompt_logprobs.complete:
                    self._prompt_lp_reqs.discard(req)

    def _prompt_rows(
        self, scheduled: Sequence[ScheduledSeq], inputs: BatchInputs
    ) -> PromptLaunch | None:
        """The step's prompt positions whose logprobs are still wanted (see
        :func:`~backplane.engine.step_rows.prompt_rows`), or ``None``."""
        return prompt_rows(self._prompt_lp_reqs, scheduled, inputs)

    def _wait(self, launched: LaunchedStep) -> dict[str, int]:
        """The launched step's sampled tokens, once they reached the host (and the executor
        vouched for them)."""
        sampled = launched.wait()
        self.executor.check_results()
        return sampled

    def execute(self, inputs: BatchInputs) -> torch.Tensor:
        """Run the model for a prepared step on the executor's worker(s).

        :param inputs: the step's inputs.
        :return: the hidden states of every (padded) token.
        """
        return self.executor.execute_model(inputs)

    def sample(
        self,
        hidden: torch.Tensor,
        inputs: BatchInputs,
        reqs: Sequence[Request],
        prompt: PromptLogprobRows | None = None,
        pending: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample one token per sampling sequence on the device.

        :param hidden: the step's hidden states.
        :param inputs: the step's inputs.
        :param reqs: the requests of ``inputs.sample_seqs``, in that order.
        :param prompt: prompt positions whose logprobs the step computes too.
        :param pending: the tokens of the step that was in flight when this one was
            prepared, on the device (default: those of the step in flight now).
        :return: ``[len(reqs)]`` int64 tokens on the device (no host synchronisation),
            logprobs where asked, and the prompt positions' logprobs.
        """
        if pending is None and self._inflight is not None:
            pending = self._inflight.tokens
        grammar = self.structured_output.bitmask(reqs)
        rows = sampling_rows(reqs, pending, prompt, grammar)
        return self.executor.sample_tokens(hidden, inputs, rows)

    def _collect(self, sched: SchedulerOutput, sampled: dict[str, int]) -> list[EngineStepOutput]:
        """The outputs of a call to :meth:`step` (see :func:`collect_outputs`)."""
        undelivered, self._undelivered = self._undelivered, None
        outs = collect_outputs(
            self._requests, self._prompt_lp_reqs, self.scheduler, sched, sampled, undelivered
        )
        if self.spec is not None:
            self.spec.deliver(outs)
        return outs
