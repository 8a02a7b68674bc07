"""The engine loop: schedule -> prepare inputs -> run the model -> sample -> commit.

:class:`Engine` wires the parts together at startup (config -> backends ->
model -> caches -> KV manager + scheduler -> input buffers) and runs one step
at a time. The model forward goes through a
:class:`~backplane.engine.runner.ModelRunner`: it decides how each step runs
(eager, a decode graph, piecewise graphs), prepares the step's
:class:`BatchInputs` for that and returns the hidden states of every (padded)
token.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from backplane.core.errors import (
    BackendUnavailableError,
    ConfigError,
    EngineClosedError,
    InvalidFieldError,
    OutOfKVMemoryError,
)
from backplane.core.forward_context import forward_context, plan_step
from backplane.core.hookspecs import FAMILIES
from backplane.core.layouts import CacheFootprint, TensorSpec, cache_footprint
from backplane.engine.graph.buckets import decode_buckets
from backplane.engine.inputs import BatchInputs, InputBatch
from backplane.engine.memory import (
    DeviceMemory,
    KVBudget,
    decode_graph_bytes,
    kv_budget,
    profile_step_peak,
)
from backplane.engine.runner import EagerModelRunner, ModelRunner
from backplane.engine.sampling import (
    LogitsProcessing,
    PromptLogprobRows,
    Sampler,
    SamplingParams,
    SamplingRows,
    TokenPairs,
    logprob_dicts,
    seed_as_int64,
)
from backplane.engine.selection import select_fused_ops
from backplane.engine.sizes import cpu_kv_budget, format_size
from backplane.engine.warmup import warmup_steps

if TYPE_CHECKING:
    from backplane.core.registry import BackendRegistry

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineStepOutput", "check_request_id"]


@dataclass
class EngineStepOutput:
    """What one step produced for one request.

    :param request_id: the request.
    :param new_token_ids: tokens committed this step (zero or one; two after a failed
        asynchronous step, whose committed token comes with the next one).
    :param finished: whether the request is done.
    :param finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` (its steps
        kept failing, see :meth:`Engine.step`) once finished.
    :param new_logprobs: one ``{token_id: Logprob}`` per new token when the request
        asks for logprobs (``SamplingParams.logprobs``), else ``None``.
    :param prompt_logprobs: with the request's first token, when it asks for
        ``SamplingParams.prompt_logprobs``: ``None`` for the first prompt token, then per
        prompt token ``{token_id: Logprob}`` of that token and the top ones (once;
        ``None`` in every other output).
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    new_logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None


def _check_paged_flags(
    sized: dict[str, dict[str, TensorSpec]], specs: dict[str, dict[str, TensorSpec]]
) -> None:
    """Refuse caches whose size follows the page count without their spec saying so.

    The pool is sized from the specs' ``paged`` flags; a tensor that grows with
    ``num_pages`` but is not marked paged would make it overflow the budget.

    :param sized: the specs the pool was sized from.
    :param specs: the specs for the chosen page count.
    :raises ValueError: naming the first such tensor.
    """
    for layer, layer_specs in specs.items():
        for name, spec in layer_specs.items():
            if not spec.paged and spec != sized[layer][name]:
                raise ValueError(
                    f"cache {name!r} of layer {layer} changes shape with num_pages "
                    f"({sized[layer][name].shape} -> {spec.shape}) but its TensorSpec is not "
                    "paged; the backend's cache_spec must set paged=True on tensors whose "
                    "first dimension counts KV pages"
                )


def check_request_id(request_id: Any) -> str:
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


class Engine:
    """The inference engine: owns the model, the caches, the scheduler and the loop.

    :param config: an ``EngineConfig`` (or ``None`` for defaults); keyword
        arguments override its fields.
    :param registry: the plugin registry backends are chosen from (the
        process-wide one if ``None``).
    :raises ConfigError: on an invalid configuration.
    """

    def __init__(
        self, config: Any = None, *, registry: BackendRegistry | None = None, **overrides: Any
    ) -> None:
        from backplane.engine.config import EngineConfig

        if config is None:
            config = EngineConfig.from_dict(overrides)
        elif overrides:
            config = config.merge(**overrides)
        self.config = config
        self.registry = registry
        self.device = config.torch_device
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"device={config.device!r} but CUDA is not available here; use device='cpu'"
            )
        self.dtype = config.torch_dtype
        torch.manual_seed(int(config.seed))
        self._closed = False
        cuda = self.device.type == "cuda"
        mem_start = DeviceMemory.read(self.device) if cuda else None

        loaded, all_backends = self._load_model()
        mem_loaded = DeviceMemory.read(self.device) if cuda else None
        self.model = loaded.model
        self.model.set_fused_ops(select_fused_ops(config.fused_ops, self.device))
        if self.device.type == "cpu":
            # decode-sized products read oneDNN's blocked layout about twice as fast
            self.model.pack_weights_for_cpu(rows=int(config.max_num_seqs))
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.backends = {f: b for f, b in all_backends.items() if f in self.model.families}
        self.max_model_len = int(
            min(config.max_model_len or self.model.max_model_len, self.model.max_model_len)
        )
        self.vocab_size = int(self.model.vocab_size)
        self.eos_token_ids = tuple(int(t) for t in (self.model.eos_token_ids or ()))
        self.page_size = int(config.page_size)
        self.max_num_seqs = int(config.max_num_seqs)
        self.max_num_tokens = int(config.max_num_tokens)
        self.max_pages_per_seq = -(-self.max_model_len // self.page_size)

        self.num_slots = self.max_num_seqs + 1 if self.model.has_recurrent_state else 0
        cache_kw = {
            "page_size": self.page_size,
            "num_slots": max(self.num_slots, 1),
            "dtype": self.dtype,
        }
        self.input_batch = InputBatch(
            max_num_tokens=self.max_num_tokens,
            max_num_seqs=self.max_num_seqs,
            max_pages_per_seq=self.max_pages_per_seq,
            page_size=self.page_size,
            device=self.device,
        )
        self.sampler = Sampler()
        # one description sizes the pool (its specs say what is paged), one allocates it
        sized = self.model.cache_specs(num_pages=2, **cache_kw)
        footprint = cache_footprint(sized)
        self.kv_budget: KVBudget | None = None
        if cuda and config.kv_memory is None and config.num_kv_pages is None:
            self.kv_budget = self._profile_kv_budget(cache_kw, mem_start, mem_loaded)
        self.num_pages = self._size_kv_pages(footprint)
        specs = self.model.cache_specs(num_pages=self.num_pages, **cache_kw)
        _check_paged_flags(sized, specs)
        self.caches = {
            layer: {name: spec.allocate(self.device) for name, spec in layer_specs.items()}
            for layer, layer_specs in specs.items()
        }
        self.model.bind_caches(self.caches)
        paged = [self.caches[layer][name] for layer, name in footprint.paged]
        self.kv_bytes = self.num_pages * footprint.page_bytes
        self.state_bytes = footprint.state_bytes
        self.scheduler = self._build_scheduler(paged)
        self.runner: ModelRunner = self._build_runner()
        # an engine dropped without shutdown() still releases what torch.compile's
        # process-wide caches would otherwise keep of its graphs (weights, caches)
        self._release_runner = weakref.finalize(self, self.runner.release)
        if cuda:
            self._warm_up()
        self.async_scheduling = bool(config.async_scheduling)
        # per-request sampling seeds: the request's own, or one drawn here (reproducible per run)
        self._seed_rng = np.random.default_rng(int(config.seed))
        self._inflight: _Launched | None = None
        # tokens committed by an asynchronous step that raised before returning them
        self._undelivered: dict[str, int] | None = None
        # two pinned buffers for the sampled tokens: step N+1's copy is issued before N's is read
        self._token_host = [
            torch.empty(self.max_num_seqs, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            for _ in range(2)
        ]
        self._token_flip = 0
        self._token_events = (
            [torch.cuda.Event(), torch.cuda.Event()] if self.device.type == "cuda" else []
        )
        self._requests: dict[str, Any] = {}
        # live requests whose prompt logprobs are not all computed yet
        self._prompt_lp_reqs: set[Any] = set()
        self._ids = itertools.count()
        logger.info(
            "engine ready: model=%s device=%s dtype=%s pages=%d x %d tokens (%.1f MiB KV), "
            "state slots=%d, backends=%s",
            config.model,
            self.device,
            self.dtype,
            self.num_pages,
            self.page_size,
            self.kv_bytes / 2**20,
            self.num_slots,
            {f: getattr(b, "name", type(b).__name__) for f, b in self.backends.items()},
        )

    # -- startup -----------------------------------------------------------------

    def _load_model(self) -> tuple[Any, dict[str, Any]]:
        """Select backends for every family, then build the model with them.

        Backends are selected first (from the engine's registry), so a
        misspelled or unavailable backend is reported before any weight is
        read. A backend chosen by ``auto`` that turns out unable to run one of
        the model's layers (it raises
        :class:`~backplane.core.errors.UnsupportedLayerError` while the model is
        built or its caches are described) is replaced by the next one ``auto``
        would choose, with a warning; a backend named explicitly is never
        replaced (see :class:`~backplane.engine.selection.BackendSelection`).
        """
        from backplane.engine.selection import BackendSelection
        from backplane.models import load_model

        cfg = self.config
        selection = BackendSelection(cfg, FAMILIES, registry=self.registry)
        while True:
            try:
                loaded = load_model(
                    cfg.model,
                    dtype=self.dtype,
                    device=self.device,
                    backends=dict(selection.backends),
                )
                # backends check the layers they are given when describing their caches
                loaded.model.cache_specs(
                    num_pages=2, page_size=int(cfg.page_size), num_slots=2, dtype=self.dtype
                )
                return loaded, dict(selection.backends)
            except BackendUnavailableError as exc:
                if not selection.replace(exc):
                    raise

    def _size_kv_pages(self, footprint: CacheFootprint) -> int:
        """Pages (including the scratch page 0) that fit the configured KV memory.

        :param footprint: per-page and recurrent-state bytes of the model's caches.
        :return: the page count.
        :raises OutOfKVMemoryError: fewer than two pages fit.
        """
        cfg = self.config
        per_page, state_bytes = footprint.page_bytes, footprint.state_bytes
        if cfg.num_kv_pages is not None:
            n = int(cfg.num_kv_pages)
        elif per_page == 0:  # no paged layers: pages are bookkeeping only
            n = self.max_num_seqs * self.max_pages_per_seq + 1
        else:
            budget = (
                cfg.kv_memory if cfg.kv_memory is not None else self._default_kv_budget(footprint)
            )
            n = int((budget - state_bytes) // per_page)
        if n < 2:
            how = (
                f" (KV budget {format_size(self.kv_budget.kv)} = {self.kv_budget.explain()})"
                if self.kv_budget is not None
                else ""
            )
            raise OutOfKVMemoryError(
                f"the KV memory holds {max(n, 0)} page(s) of {self.page_size} tokens after "
                f"{state_bytes} bytes of recurrent state; at least 2 are needed (page 0 is "
                f"scratch), one page takes {per_page} bytes{how}. Raise "
                f"gpu_memory_utilization, lower max_num_tokens / max_num_seqs, or set "
                f"kv_memory or num_kv_pages"
            )
        return n

    def _profile_kv_budget(
        self, cache_kw: dict[str, Any], start: DeviceMemory, loaded: DeviceMemory
    ) -> KVBudget:
        """Measure a full step's activation peak and give the KV cache what is left."""
        activations = profile_step_peak(
            self.model,
            self.backends,
            self.input_batch,
            self.sampler,
            max_num_tokens=self.max_num_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            page_size=self.page_size,
            cache_kw=cache_kw,
            device=self.device,
        )
        graphs = 0
        mode = self.config.cuda_graphs_resolved
        if mode in ("piecewise", "full_and_piecewise"):
            graphs += activations
        if mode in ("decode", "full_and_piecewise"):
            buckets = decode_buckets(self.max_num_seqs)
            graphs += decode_graph_bytes(buckets, self.vocab_size)
        budget = kv_budget(
            utilization=self.config.gpu_memory_utilization,
            start=start,
            loaded=loaded,
            now=DeviceMemory.read(self.device),
            activations=activations,
            graphs=graphs,
        )
        logger.info("KV memory %s = %s", format_size(budget.kv), budget.explain())
        return budget

    def _default_kv_budget(self, footprint: CacheFootprint) -> int:
        if self.kv_budget is not None:
            return self.kv_budget.kv
        budget, why = cpu_kv_budget(
            page_bytes=footprint.page_bytes,
            state_bytes=footprint.state_bytes,
            max_num_seqs=self.max_num_seqs,
            max_pages_per_seq=self.max_pages_per_seq,
        )
        logger.info("KV memory on cpu: %s (%s)", format_size(budget), why)
        return budget

    def _build_scheduler(self, paged_caches: list[torch.Tensor]) -> Any:
        from backplane.engine.kv_cache.host_tier import HostTier
        from backplane.engine.kv_cache.manager import KVCacheManager
        from backplane.engine.sched import Scheduler

        cfg = self.config
        host = None
        if cfg.host_kv_memory and paged_caches and not self.model.has_recurrent_state:
            try:
                host = HostTier.from_bytes(paged_caches, cfg.host_kv_memory)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        self.kv_manager = KVCacheManager(
            self.num_pages,
            self.page_size,
            num_state_slots=self.num_slots,
            enable_prefix_caching=cfg.enable_prefix_caching,
            host_tier=host,
            debug=cfg.debug,
        )
        return Scheduler(
            self.kv_manager,
            max_num_seqs=self.max_num_seqs,
            max_num_tokens=self.max_num_tokens,
        )

    def _build_runner(self) -> ModelRunner:
        """The eager runner, or the CUDA-graph runner (graphs captured now) when enabled."""
        mode = self.config.cuda_graphs_resolved
        if mode == "off" or self.device.type != "cuda":
            return EagerModelRunner(self.model, self.input_batch, self.sampler)
        from backplane.engine.graph.runner import GraphModelRunner

        runner = GraphModelRunner(
            self.model,
            self.backends,
            self.input_batch,
            mode=mode,
            max_num_tokens=self.max_num_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            page_size=self.page_size,
            token_bucket_sizes=self.config.cuda_graph_buckets,
            sampler=self.sampler,
        )
        runner.capture()
        return runner

    def _warm_up(self) -> None:
        """Run the scratch steps of :func:`~backplane.engine.warmup.warmup_steps` once.

        Kernels compiled on first use (Triton's) are compiled here rather than
        inside the first requests' steps. A step that fails is logged and
        skipped: the shape it stands for then compiles on first use, or fails
        there with the same error.
        """
        steps = warmup_steps(
            max_num_tokens=self.max_num_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            page_size=self.page_size,
        )
        start = time.perf_counter()
        for seqs in steps:
            try:
                self.execute(self.runner.prepare_inputs(seqs))
            except Exception as exc:  # noqa: BLE001 - logged; serving can still go on
                logger.warning(
                    "warm-up step of %d sequence(s), %d token(s) failed (%s: %s); "
                    "its kernels compile on first use",
                    len(seqs),
                    sum(s.num_new_tokens for s in seqs),
                    type(exc).__name__,
                    exc,
                )
        torch.cuda.synchronize(self.device)
        logger.info(
            "warm-up: %d scratch steps (every kernel shape class) in %.2f s",
            len(steps),
            time.perf_counter() - start,
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
        if hasattr(self, "_release_runner"):
            self._release_runner()
        for name in (
            "_inflight",
            "runner",
            "scheduler",
            "caches",
            "model",
            "backends",
            "input_batch",
            "sampler",
            "_token_host",
            "_token_events",
            "_undelivered",
        ):
            if hasattr(self, name):
                setattr(self, name, None)
        self._requests = {}
        self._prompt_lp_reqs = set()
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

    # -- requests ----------------------------------------------------------------

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
        from backplane.engine.request import Request

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
        self._check_params(rid, params)
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
        if req.prompt_logprobs is not None and not req.prompt_logprobs.complete:
            self._prompt_lp_reqs.add(req)
        return rid

    def _new_request_id(self) -> str:
        """The next generated id that no caller's request holds."""
        while True:
            rid = str(next(self._ids))
            if rid not in self._requests:
                return rid

    def _check_params(self, rid: str, params: SamplingParams) -> None:
        """Check the sampling parameters' limits that depend on the model (the vocabulary)."""
        vocab = self.vocab_size
        if params.top_k > vocab:
            raise InvalidFieldError(
                f"request {rid!r}: SamplingParams.top_k={params.top_k} is larger than the "
                f"vocabulary ({vocab} tokens); use at most {vocab}, or 0 / -1 to turn it off",
                field="top_k",
            )
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidFieldError(
                f"request {rid!r}: SamplingParams.stop_token_ids holds {bad[0]}, outside the "
                f"vocabulary [0, {vocab}); use this model's tokenizer's ids",
                field="stop_token_ids",
            )

    def get_request(self, request_id: str) -> Any:
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
        the step's own outputs are returned.

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
        sched = self.scheduler.schedule()  # leaves nothing half-done if it raises
        flip = self._token_flip
        prev = self._inflight
        try:
            return self._run_step(sched)
        except BaseException:
            self._recover(sched, prev, flip)
            raise

    def _run_step(self, sched: Any) -> list[EngineStepOutput]:
        """Launch, wait for and commit one scheduled step (see :meth:`step`)."""
        launched = self._launch(sched) if sched.scheduled else None
        if not self.async_scheduling:
            if launched is not None:
                self.scheduler.advance(sched)
                sampled = self._wait(launched)
                self.scheduler.commit(sched, sampled)
                self._keep(launched, sampled)
            else:
                sampled = {}
            return self._collect(sched, sampled)
        prev, self._inflight = self._inflight, None
        sampled = {}
        if prev is not None:
            sampled = self._wait(prev)
            # requests aborted since the launch drop their token (commit skips them too)
            gone = {r.request_id for r in prev.reqs if r.is_finished}
            self.scheduler.commit(prev.sched, sampled)
            self._keep(prev, sampled, gone)
            if gone:
                sampled = {rid: t for rid, t in sampled.items() if rid not in gone}
            # committed: delivered by this call, or by the next one if something below raises
            self._undelivered = sampled
        if launched is not None:
            # after the previous commit: pages that just became full hash real tokens
            self.scheduler.advance(sched)
            self._inflight = launched
        return self._collect(sched, sampled)

    def _recover(self, sched: Any, prev: _Launched | None, flip: int) -> None:
        """Undo a step that raised: restart its requests from their committed tokens.

        :param sched: the failed step's scheduler output.
        :param prev: the asynchronous step that was in flight when it began.
        :param flip: the token buffer the step began with.
        """
        self._token_flip = flip  # the failed launch's buffer is free again
        failed = [s.request for s in sched.scheduled]
        if prev is not None and self._inflight is prev:
            # The launch failed; the step before it is intact. Commit it now: a restarted
            # request must not be readmitted while its last token is still on the device.
            self._inflight = None
            try:
                sampled = self._wait(prev)
                gone = {r.request_id for r in prev.reqs if r.is_finished}
                self.scheduler.commit(prev.sched, sampled)
                self._keep(prev, sampled, gone)
                self._undelivered = {r: t for r, t in sampled.items() if r not in gone}
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
        self.scheduler.restart(failed)

    def _launch(self, sched: Any) -> _Launched:
        """Prepare, run and sample one step on the device; start the tokens' copy to the host."""
        scheduled = sched.scheduled
        ib = self.input_batch
        prev = self._inflight
        ib.pending_source = prev.tokens if prev is not None else None
        try:
            inputs = self.runner.prepare_inputs(scheduled)
        finally:
            ib.pending_source = None
        prompt = self._prompt_rows(scheduled, inputs)
        hidden = self.execute(inputs)
        reqs = [scheduled[i].request for i in inputs.sample_seqs]
        out = self.sample(hidden, inputs, reqs, prompt.rows if prompt is not None else None)
        tokens = out.tokens
        n = len(reqs)
        turn = self._token_flip
        self._token_flip ^= 1
        host = self._token_host[turn][:n]
        event = None
        lp_host = None
        if n:
            host.copy_(tokens, non_blocking=True)
            if out.logprobs is not None:
                # copied with the tokens, before the event: read when they are
                lp_host = _to_host(out.logprobs)
        if prompt is not None and out.prompt_logprobs is not None:
            prompt.host = _to_host(out.prompt_logprobs)
        if self.device.type == "cuda" and (n or prompt is not None):
            # reused every other step: the step that last recorded it has been committed
            event = self._token_events[turn]
            event.record()
        for row, r in enumerate(reqs):
            r.pending_row = row
        return _Launched(sched, reqs, tokens, host, event, lp_host, prompt)

    def _keep(
        self, launched: _Launched, sampled: dict[str, int], gone: set[str] = frozenset()
    ) -> None:
        """After a commit: keep the step's logprobs and prompt logprobs in their requests."""
        _keep_logprobs(launched, sampled, gone)
        if launched.prompt is not None:
            _keep_prompt_logprobs(launched, gone)
            for req, _, _ in launched.prompt.entries:
                if req.prompt_logprobs.complete:
                    self._prompt_lp_reqs.discard(req)

    def _prompt_rows(self, scheduled: Sequence[Any], inputs: BatchInputs) -> _PromptLaunch | None:
        """The step's prompt positions whose logprobs are still wanted, or ``None``.

        A sequence of a request asking for ``prompt_logprobs`` contributes every
        prompt position of its chunk that predicts a prompt token (the last
        prompt token predicts the first output, which is sampled as usual) and
        is not known yet; Python work is per such sequence, rows are numpy ranges.
        """
        if not self._prompt_lp_reqs:
            return None
        wanted = self._prompt_lp_reqs
        picked = [i for i, s in enumerate(scheduled) if s.request in wanted]
        if not picked:
            return None
        starts = inputs.first_token_rows(np.asarray(picked, dtype=np.int64))
        entries: list[tuple[Any, int, int]] = []
        rows: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        k = 0
        offset = 0
        for i, start in zip(picked, starts.tolist(), strict=True):
            s = scheduled[i]
            req = s.request
            state = req.prompt_logprobs
            c = s.num_cached_tokens
            lo = max(c, state.done)
            hi = min(c + s.num_new_tokens, state.num_positions)
            if hi <= lo:
                continue
            rows.append(np.arange(start + lo - c, start + hi - c, dtype=np.int64))
            targets.append(req.token_buffer[lo + 1 : hi + 1])
            entries.append((req, lo, offset))
            offset += hi - lo
            k = max(k, state.k)
        if not entries:
            return None
        device = inputs.logits_indices.device
        index = torch.from_numpy(np.concatenate(rows))
        target = torch.from_numpy(np.concatenate(targets).astype(np.int64))
        if device.type != "cpu":
            index = index.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
        return _PromptLaunch(PromptLogprobRows(index, target, k), entries)

    @staticmethod
    def _wait(launched: _Launched) -> dict[str, int]:
        """The launched step's sampled tokens, once they reached the host."""
        if launched.event is not None:
            launched.event.synchronize()
        tokens = launched.host.tolist()
        return {r.request_id: t for r, t in zip(launched.reqs, tokens, strict=True)}

    @torch.inference_mode()
    def execute(self, inputs: BatchInputs) -> torch.Tensor:
        """Plan every backend once, then run the model under the forward context.

        Planning runs under inference mode too, like graph capture, so buffers a
        backend makes while planning are the same kind of tensor in every step.
        """
        plans = plan_step(self.backends, inputs.metadata)
        with forward_context(inputs.metadata, plans):
            return self.runner.run(inputs)

    @torch.inference_mode()
    def sample(
        self,
        hidden: torch.Tensor,
        inputs: BatchInputs,
        reqs: Sequence[Any],
        prompt: PromptLogprobRows | None = None,
    ) -> Any:
        """Gather the last token of each sampling sequence, compute logits, sample on the device.

        :param hidden: the step's hidden states.
        :param inputs: the step's inputs.
        :param reqs: the requests of ``inputs.sample_seqs``, in that order.
        :param prompt: prompt positions whose logprobs the step computes too.
        :return: a :class:`~backplane.engine.sampling.SamplerOutput`: ``[len(reqs)]`` int64
            tokens on the device (no host synchronisation), logprobs where asked, and the
            prompt positions' logprobs.
        """
        n = len(reqs)
        params = [r.sampling_params for r in reqs]
        seeds = np.fromiter((r.sampling_seed for r in reqs), np.int64, n)
        # the index of the token being sampled: placeholders count, so it is exact in async runs
        offsets = np.fromiter((r.num_output_tokens for r in reqs), np.int64, n)
        lp = np.fromiter((-1 if p.logprobs is None else p.logprobs for p in params), np.int64, n)
        rows = SamplingRows(
            params,
            seeds,
            offsets,
            processing=self._processing(reqs, params, offsets),
            num_logprobs=int(lp.max()) if n else -1,
            prompt=prompt,
        )
        return self.runner.sample(hidden, inputs, rows)

    def _processing(
        self, reqs: Sequence[Any], params: Sequence[SamplingParams], offsets: np.ndarray
    ) -> LogitsProcessing | None:
        """The step's penalty and ``min_tokens`` inputs, or ``None`` when no row asks.

        Host work is a few array concatenations over the rows that ask; the
        counting happens on the device (:func:`~backplane.engine.sampling.apply_processing`).
        """
        n = len(reqs)
        min_tokens = np.fromiter((p.min_tokens for p in params), np.int64, n)
        suppress_rows = np.flatnonzero(offsets < min_tokens)
        penalty_rows = np.flatnonzero(np.fromiter((p.has_penalties for p in params), np.bool_, n))
        if not len(suppress_rows) and not len(penalty_rows):
            return None
        suppress = None
        if len(suppress_rows):
            stops = [np.fromiter(reqs[i].stop_token_ids, np.int64) for i in suppress_rows]
            suppress = _pairs(suppress_rows, stops)
        output = prompt = pending = None
        if len(penalty_rows):
            prs = [reqs[i] for i in penalty_rows]
            # an asynchronous step's token is a placeholder here; its value is on the device
            has_pending = np.fromiter((r.has_pending_token for r in prs), np.bool_, len(prs))
            outs = [
                r.output_token_ids[: r.num_output_tokens - int(p)]
                for r, p in zip(prs, has_pending, strict=True)
            ]
            output = _pairs(np.arange(len(prs)), outs)
            if has_pending.any():
                assert self._inflight is not None
                which = np.flatnonzero(has_pending)
                src = np.fromiter((prs[i].pending_row for i in which), np.int64, len(which))
                dev = self._inflight.tokens.device
                pending = (
                    torch.from_numpy(which).to(dev),
                    self._inflight.tokens.index_select(0, torch.from_numpy(src).to(dev)),
                )
            rep_on = [i for i, r in enumerate(prs) if r.sampling_params.repetition_penalty != 1.0]
            if rep_on:
                prompt = _pairs(np.array(rep_on), [prs[i].prompt_token_ids for i in rep_on])
        return LogitsProcessing(
            penalty_rows=penalty_rows if len(penalty_rows) else None,
            output=output,
            pending=pending,
            prompt=prompt,
            suppress=suppress,
        )

    def _collect(self, sched: Any, sampled: dict[str, int]) -> list[EngineStepOutput]:
        outs: dict[str, EngineStepOutput] = {}
        undelivered, self._undelivered = self._undelivered, None
        if undelivered is not None and undelivered is not sampled:
            # committed by a step that raised afterwards: delivered now, first
            for rid, tok in undelivered.items():
                outs[rid] = EngineStepOutput(rid, [tok])
        for rid, tok in sampled.items():
            o = outs.get(rid)
            if o is None:
                outs[rid] = EngineStepOutput(rid, [tok])
            else:
                o.new_token_ids.append(tok)
        for rid, o in outs.items():
            req = self._requests.get(rid)
            kept = None if req is None else req.logprobs
            if kept is not None and o.new_token_ids:
                # the request keeps one entry per committed token, in order
                o.new_logprobs = kept[len(kept) - len(o.new_token_ids) :]
            plp = None if req is None else req.prompt_logprobs
            if plp is not None and o.new_token_ids and plp.complete and not plp.delivered:
                plp.delivered = True
                o.prompt_logprobs = _prompt_logprob_list(plp)
        # every request the scheduler finished (stopped, length, aborted) this step
        for req in _finished_requests(self.scheduler, sched):
            rid = req.request_id
            o = outs.get(rid)
            if o is None:
                o = outs[rid] = EngineStepOutput(rid)
            o.finished = True
            o.finish_reason = req.finish_reason.value if req.finish_reason is not None else None
            self._requests.pop(rid, None)
            self._prompt_lp_reqs.discard(req)
        return list(outs.values())


@dataclass
class _Launched:
    """A step on the device: what was scheduled, which requests sample, and their tokens.

    :param sched: the scheduler's output.
    :param reqs: the requests that sample, in row order of ``tokens``.
    :param tokens: ``[len(reqs)]`` int64 sampled tokens on the device.
    :param host: pinned host copy of ``tokens`` (valid once ``event`` completed).
    :param event: recorded after the copy (``None`` on CPU).
    :param logprobs: host copies of the rows' logprobs (token ids, logprobs, ranks; valid
        once ``event`` completed), or ``None`` when no row asked.
    :param prompt: the step's prompt-logprob rows, or ``None``.
    """

    sched: Any
    reqs: list[Any]
    tokens: torch.Tensor
    host: torch.Tensor
    event: torch.cuda.Event | None
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    prompt: _PromptLaunch | None = None


@dataclass
class _PromptLaunch:
    """A step's prompt-logprob rows: what the device computes and where it goes.

    :param rows: the device rows (indices into the hidden states, target tokens).
    :param entries: ``(request, first prompt position, first row)`` per request, in row
        order; each request's rows run to the next entry's first row.
    :param host: host copies of the rows' logprobs (token ids, logprobs, ranks; valid
        once the step's event completed).
    """

    rows: PromptLogprobRows
    entries: list[tuple[Any, int, int]]
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _pairs(rows: np.ndarray, token_lists: Sequence[np.ndarray]) -> TokenPairs:
    """Flat ``(row, token)`` pairs: ``rows[i]`` once per token of ``token_lists[i]``."""
    lens = np.fromiter((len(t) for t in token_lists), np.int64, len(token_lists))
    tokens = (
        np.concatenate(token_lists).astype(np.int64, copy=False)
        if len(token_lists)
        else np.zeros(0, np.int64)
    )
    return TokenPairs(np.repeat(np.asarray(rows, dtype=np.int64), lens), tokens)


def _to_host(lp: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Start copying :class:`~backplane.engine.sampling.LogprobsTensors` to (pinned) host
    tensors; they are read once the step's event completed."""
    pin = lp.token_ids.is_cuda
    return tuple(
        torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=True)
        for t in (lp.token_ids, lp.logprobs, lp.ranks)
    )


def _keep_prompt_logprobs(launched: _Launched, gone: set[str] = frozenset()) -> None:
    """Store a committed step's prompt logprobs in their requests (by prompt position).

    :param launched: the step just committed (its copies have reached the host).
    :param gone: requests aborted since the launch.
    """
    prompt = launched.prompt
    if prompt is None or prompt.host is None:
        return
    ids, vals, ranks = (t.numpy() for t in prompt.host)
    ends = [e[2] for e in prompt.entries[1:]] + [len(ranks)]
    for (req, lo, a), b in zip(prompt.entries, ends, strict=True):
        if req.request_id in gone:
            continue
        req.prompt_logprobs.store(lo, ids[a:b], vals[a:b], ranks[a:b])


def _prompt_logprob_list(state: Any) -> list[Any]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token, then one dict per token."""
    ks = [state.k] * state.num_positions
    return [None, *logprob_dicts(state.token_ids, state.logprobs, state.ranks, ks)]


def _keep_logprobs(
    launched: _Launched, sampled: dict[str, int], gone: set[str] = frozenset()
) -> None:
    """Append each committed token's logprobs to its request (after the tokens reached the host).

    :param launched: the step whose tokens were just committed.
    :param sampled: the tokens committed, by request id.
    :param gone: requests aborted since the launch (their token was dropped).
    """
    if launched.logprobs is None:
        return
    ids, vals, ranks = (t.numpy() for t in launched.logprobs)
    ks = [r.sampling_params.logprobs for r in launched.reqs]
    for r, d in zip(launched.reqs, logprob_dicts(ids, vals, ranks, ks), strict=True):
        rid = r.request_id
        if d is not None and r.logprobs is not None and rid in sampled and rid not in gone:
            r.logprobs.append(d)


def _finished_requests(scheduler: Any, sched: Any) -> list[Any]:
    """Requests finished before this step (aborts, in ``sched.finished``) or by it."""
    return [*sched.finished, *scheduler.pop_finished()]
