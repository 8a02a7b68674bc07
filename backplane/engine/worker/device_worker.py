"""The worker of one device: model, caches, input buffers, runner and sampler.

:class:`DeviceWorker` implements :class:`~backplane.engine.worker.base.Worker`
for the device named in the engine configuration. It holds everything that
lives on that device; the engine loop reaches it only through an executor.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from backplane.core import compile_ahead
from backplane.core.backend_spec import BackendSpec
from backplane.core.errors import BackendUnavailableError, ConfigError
from backplane.core.families import Backend, RecurrentBackend
from backplane.core.forward_context import forward_context, plan_step
from backplane.core.hookspecs import FAMILIES
from backplane.core.layouts import TensorSpec, cache_footprint
from backplane.core.parallel import tensor_parallel
from backplane.engine.config import RECURRENT_MAX_NUM_SEQS
from backplane.engine.kv_cache.state_cache import snapshot_slot_count
from backplane.engine.sampling import Sampler, SamplerOutput, SamplingRows
from backplane.engine.selection import BackendSelection, select_fused_ops
from backplane.engine.sizes import format_size, pages_per_seq
from backplane.engine.threads import apply_threads
from backplane.engine.worker.graph.buckets import decode_buckets, verify_rows
from backplane.engine.worker.graph.mode import GraphMode, decide_graph_mode
from backplane.engine.worker.inputs import BatchInputs, InputBatch, ScheduledSeqLike
from backplane.engine.worker.memory import (
    DeviceMemory,
    KVBudget,
    graph_bytes,
    kv_budget,
    num_kv_pages,
)
from backplane.engine.worker.runner import EagerModelRunner, ModelRunner
from backplane.engine.worker.startup_timings import (
    StartupTimings,
    startup_detail,
    startup_phase,
    timed_startup_method,
)
from backplane.engine.worker.warmup import (
    profile_step_peak,
    warm_up_forwards,
    warm_up_kernels,
)

if TYPE_CHECKING:
    from backplane.core.registry import BackendRegistry
    from backplane.engine.config import EngineConfig
    from backplane.models.base import CausalLM, ModelConfig
    from backplane.models.loaded import LoadedModel

logger = logging.getLogger(__name__)

__all__ = ["DeviceWorker"]

#: the start-up detail of an eager runner's compile-only pass over the warm-up steps
WARM_UP_AHEAD_DETAIL = f"{compile_ahead.AHEAD_DETAIL}: warm-up"

#: One layer's caches: ``{cache name: tensor}``.
LayerCaches = dict[str, torch.Tensor]


class DeviceWorker:
    """One device's half of the engine (a :class:`~backplane.engine.worker.base.Worker`).

    Construction checks the device and seeds torch; the start-up methods build
    the rest, in the order the :mod:`~backplane.engine.worker.base` docstring gives.

    :param config: the engine configuration.
    :param registry: the plugin registry backends are chosen from (the process-wide
        one if ``None``).
    :raises ConfigError: the device is CUDA but none is available.
    """

    def __init__(self, config: EngineConfig, registry: BackendRegistry | None = None) -> None:
        self.config = config
        self.registry = registry
        self.device = config.torch_device
        #: seconds per start-up phase, filled by the start-up methods
        self.startup_timings = StartupTimings(self.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"device={config.device!r} but CUDA is not available here; use device='cpu'"
            )
        self.dtype = config.torch_dtype
        torch.manual_seed(int(config.seed))
        apply_threads(config.threads)
        self.page_size = int(config.page_size)
        self.max_num_seqs = config.max_num_seqs_resolved
        self.max_num_tokens = config.max_num_tokens_resolved
        self.sampler = Sampler()
        self.graph_mode = GraphMode.OFF
        self.kv_budget: KVBudget | None = None
        self.num_pages = 0
        self.kv_bytes = 0
        self.state_bytes = 0
        self.caches: dict[str, LayerCaches] = {}
        self.runner: ModelRunner | None = None
        self._closed = False
        self._mem_start: DeviceMemory | None = None
        self._mem_loaded: DeviceMemory | None = None
        self._paged: list[tuple[str, str]] = []
        self._sized: dict[str, dict[str, TensorSpec]] | None = None

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    # -- start-up -------------------------------------------------------------------

    @timed_startup_method("weight load")
    def load_model(self) -> None:
        """Select backends for every family, build the model with them, decide the graph mode.

        Backends are selected first (from the worker's registry), so a
        misspelled or unavailable backend is reported before any weight is
        read. A backend chosen by ``auto`` that turns out unable to run one of
        the model's layers (it raises
        :class:`~backplane.core.errors.UnsupportedLayerError` while the model is
        built or its caches are described) is replaced by the next one ``auto``
        would choose, with a warning; a backend named explicitly is never
        replaced (see :class:`~backplane.engine.selection.BackendSelection`).
        """
        cfg = self.config
        self._mem_start = DeviceMemory.read(self.device) if self._cuda else None
        # a backend may start building what it will need while the weights load
        with self._compiling_ahead():
            loaded, backends, specs = self._select_and_load()
        self._mem_loaded = DeviceMemory.read(self.device) if self._cuda else None
        self.model: CausalLM | None = loaded.model
        self.model.set_fused_ops(select_fused_ops(cfg.fused_ops, self.device))
        if self.device.type == "cpu":
            # decode-sized products read oneDNN's blocked layout about twice as fast
            self.model.pack_weights_for_cpu(rows=self.max_num_seqs)
        # Any: the tokenizer is whatever the checkpoint's loader made (HF or GGUF)
        self.tokenizer = loaded.tokenizer
        self.model_config: ModelConfig = loaded.config
        families = self.model.families
        self.backends: dict[str, Backend] = {f: b for f, b in backends.items() if f in families}
        self.max_model_len = int(
            min(cfg.max_model_len or self.model.max_model_len, self.model.max_model_len)
        )
        self.vocab_size = int(self.model.vocab_size)
        self.eos_token_ids = tuple(int(t) for t in (self.model.eos_token_ids or ()))
        self.has_recurrent_state = bool(self.model.has_recurrent_state)
        if self.has_recurrent_state and cfg.max_num_seqs is None:
            # a recurrent model holds a whole state per running sequence (megabytes a layer):
            # the large-GPU default of attention models would spend the memory on states
            self.max_num_seqs = min(self.max_num_seqs, RECURRENT_MAX_NUM_SEQS)
        self.max_pages_per_seq = pages_per_seq(self.max_model_len, self.page_size)
        # Prefix reuse of a recurrent model keeps the states of cached prefixes in spare
        # slots (snapshot_slot_count); the engine issues their copies on this worker only, so
        # several ranks go without.
        self.num_snapshot_slots = (
            snapshot_slot_count(self.max_num_seqs)
            if self.has_recurrent_state
            and cfg.enable_prefix_caching
            and int(cfg.tensor_parallel_size) == 1
            else 0
        )
        self.num_slots = (
            self.max_num_seqs + 1 + self.num_snapshot_slots if self.has_recurrent_state else 0
        )
        # speculative verification keeps the per-position recurrent states of its chunks in
        # scratch slots past the pool's (VerifyStates.in_scratch_region)
        spec = cfg.speculative_config
        self.num_scratch_slots = (
            self.max_num_seqs * spec.num_speculative_tokens
            if spec is not None and self.has_recurrent_state
            else 0
        )
        # a verify graph runs one row per chunk position: the batch holds that many rows
        self.verify_len = self._verify_len()
        self.input_batch = InputBatch(
            max_num_tokens=self.max_num_tokens,
            max_num_seqs=max(
                self.max_num_seqs,
                verify_rows(self.max_num_seqs, self.max_num_tokens, self.verify_len),
            ),
            max_pages_per_seq=self.max_pages_per_seq,
            page_size=self.page_size,
            device=self.device,
        )
        used = {f: s for f, s in specs.items() if f in families}
        self.graph_mode = decide_graph_mode(cfg.cuda_graphs, self.device, used)

    def _select_and_load(
        self,
    ) -> tuple[LoadedModel, dict[str, Backend], dict[str, BackendSpec]]:
        from backplane.models import load_model
        from backplane.models.quant.kv_cache import use_fp8_kv_cache

        cfg = self.config
        with startup_phase("backend selection"):
            selection = BackendSelection(cfg, FAMILIES, registry=self.registry)
        while True:
            try:
                loaded = load_model(
                    cfg.model,
                    dtype=self.dtype,
                    device=self.device,
                    backends=dict(selection.backends),
                    mtp=_wants_mtp(cfg),
                    quantization=cfg.quantization,
                    # every rank reads alike: the first one's bar says it all
                    progress=tensor_parallel().rank == 0,
                )
                if cfg.kv_cache_dtype != "auto":
                    use_fp8_kv_cache(loaded.model)
                # backends check the layers they are given when describing their caches
                loaded.model.cache_specs(
                    num_pages=2, page_size=self.page_size, num_slots=2, dtype=self.dtype
                )
                return loaded, dict(selection.backends), dict(selection.specs)
            except BackendUnavailableError as exc:
                if not selection.replace(exc):
                    raise

    def _cache_specs(self, num_pages: int) -> dict[str, dict[str, TensorSpec]]:
        return self.model.cache_specs(
            num_pages=num_pages,
            page_size=self.page_size,
            num_slots=max(self.num_slots + self.num_scratch_slots, 1),
            dtype=self.dtype,
        )

    @timed_startup_method("memory profiling")
    def determine_num_kv_pages(self) -> int:
        """Pages (including the scratch page 0) that fit the configured KV memory.

        On CUDA without ``kv_memory`` or ``num_kv_pages`` the largest step is
        profiled first (:func:`~backplane.engine.worker.warmup.profile_step_peak`)
        and the KV cache gets what is left (:func:`~backplane.engine.worker.memory.kv_budget`).

        :return: the page count.
        :raises OutOfKVMemoryError: fewer than two pages fit.
        """
        cfg = self.config
        # one description sizes the pool (its specs say what is paged), one allocates it
        self._sized = self._cache_specs(2)
        footprint = cache_footprint(self._sized)
        if self._cuda and cfg.kv_memory is None and cfg.num_kv_pages is None:
            with self._compiling_ahead():
                self.kv_budget = self._profile_kv_budget()
        return num_kv_pages(
            footprint,
            num_kv_pages=cfg.num_kv_pages,
            kv_memory=cfg.kv_memory,
            budget=self.kv_budget,
            page_size=self.page_size,
            max_num_seqs=self.max_num_seqs,
            max_pages_per_seq=self.max_pages_per_seq,
        )

    def _profile_kv_budget(self) -> KVBudget:
        """Measure a full step's activation peak and give the KV cache what is left."""
        assert self._mem_start is not None and self._mem_loaded is not None
        activations = profile_step_peak(
            self.model,
            self.backends,
            self.input_batch,
            self.sampler,
            max_num_tokens=self.max_num_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            page_size=self.page_size,
            num_slots=max(self.num_slots, 1),
            dtype=self.dtype,
            device=self.device,
            ahead=self._compiles_ahead,
        )
        budget = kv_budget(
            utilization=self.config.gpu_memory_utilization,
            start=self._mem_start,
            loaded=self._mem_loaded,
            now=DeviceMemory.read(self.device),
            activations=activations,
            graphs=graph_bytes(
                self.graph_mode,
                activations=activations,
                # verify graphs keep logits of their own
                decode_bucket_sizes=decode_buckets(self.max_num_seqs) + self._verify_buckets(),
                vocab_size=self.vocab_size,
            ),
        )
        logger.info("KV memory %s = %s", format_size(budget.kv), budget.explain())
        return budget

    @timed_startup_method("cache allocation")
    def initialize_cache(self, num_pages: int) -> None:
        """Allocate the caches for ``num_pages`` pages and bind them to the model.

        :param num_pages: the page count (at least 2).
        :raises ValueError: a cache grows with the page count without its spec saying so.
        """
        sized = self._sized if self._sized is not None else self._cache_specs(2)
        footprint = cache_footprint(sized)
        specs = self._cache_specs(num_pages)
        _check_paged_flags(sized, specs)
        self.caches = {
            layer: {name: spec.allocate(self.device) for name, spec in layer_specs.items()}
            for layer, layer_specs in specs.items()
        }
        self.model.bind_caches(self.caches)
        self._paged = list(footprint.paged)
        self.num_pages = num_pages
        self.kv_bytes = num_pages * footprint.page_bytes
        self.state_bytes = footprint.state_bytes

    def paged_cache_tensors(self) -> list[torch.Tensor]:
        """The paged cache tensors, in the footprint's order (for a host tier)."""
        return [self.caches[layer][name] for layer, name in self._paged]

    @contextlib.contextmanager
    def _compiling_ahead(self) -> Iterator[None]:
        """Let the kernels of the wrapped start-up step compile ahead, side by side
        (:mod:`~backplane.core.compile_ahead`), and add the seconds that took to the
        start-up details (and, at INFO, how many kernels that compiled)."""
        asked, compiled = compile_ahead.compiles()
        with compile_ahead.startup_window() as details:
            try:
                yield
            finally:
                for name, seconds in details.items():
                    self.startup_timings.add_detail(name, seconds)
                now_asked, now_compiled = compile_ahead.compiles()
                if now_asked > asked:
                    logger.info(
                        "compile-only passes: %d kernels asked for, %d compiled, %d loaded "
                        "from the disk cache",
                        now_asked - asked,
                        now_compiled - compiled,
                        (now_asked - asked) - (now_compiled - compiled),
                    )

    @property
    def _compiles_ahead(self) -> bool:
        """Whether the start-up steps may compile their kernels in compile-only passes.

        Not for float32 activations: the library kernels of the recurrent
        backends get exact float32 products from an environment variable set
        around their launches (``exact_fp32_dots``), which a compile finishing
        after its pass would miss. Not for a split model either: a pass runs
        the forwards' all-reduces on the outputs of kernels it skipped, and a
        part that raised on one rank but not on another would leave the
        ranks' collectives out of step, a hang rather than an error; its
        kernels compile on first launch, as each rank's own.
        """
        return self.dtype != torch.float32 and int(self.config.tensor_parallel_size) == 1

    def _later_passes(self) -> bool:
        """Whether the captures and warm-up steps compile ahead (``_compiles_ahead``), unless
        the profiling step's pass found its every kernel in Triton's disk cache
        (:func:`~backplane.core.compile_ahead.disk_cache_warm`): then this start-up ran
        before, its launches load their kernels in milliseconds, and a pass would only
        cost a forward per bucket and step."""
        if not self._compiles_ahead:
            return False
        if compile_ahead.disk_cache_warm():
            logger.info(
                "no compile-only pass for the graph captures and warm-up steps: the "
                "profiling step found its kernels in Triton's disk cache"
            )
            return False
        return True

    @timed_startup_method("kernel warm-up")
    def compile_or_warm_up_model(self) -> None:
        """Build the runner (capturing its graphs) and, on CUDA, run the warm-up steps.

        On CUDA the warm-up steps' kernels compile ahead in the graph runner's
        compile-only pass, beside those of the captures (with the eager runner, in
        a pass of their own).
        """
        with self._compiling_ahead():
            self._build_and_warm_up()

    def _build_and_warm_up(self) -> None:
        self.runner = self._build_runner()
        # a worker dropped without shutdown() still releases its graphs and the
        # memory their pool holds
        self._release_runner = weakref.finalize(self, self.runner.release)
        self._capture_graphs()
        if self._cuda:
            if (
                not self.graph_mode.captures
                and compile_ahead.can_compile_ahead()
                and self._later_passes()
            ):
                compile_ahead.run_ahead(
                    "the warm-up steps", self._warm_up_forwards, detail=WARM_UP_AHEAD_DETAIL
                )
            warm_up_kernels(
                self.prepare_inputs,
                self.execute_model,
                **self._warm_up_limits(),
                device=self.device,
            )

    def _warm_up_limits(self) -> dict[str, int]:
        """The engine limits :func:`~backplane.engine.worker.warmup.warmup_steps` fits its steps to."""
        return {
            "max_num_tokens": self.max_num_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "page_size": self.page_size,
        }

    def _warm_up_forwards(self) -> None:
        """The warm-up steps' forwards through the runner, for a compile-only pass."""
        warm_up_forwards(self.prepare_inputs, self.execute_model, **self._warm_up_limits())

    @timed_startup_method("graph capture")
    def _capture_graphs(self) -> None:
        """Capture the graph runner's graphs (nothing for the eager runner).

        On CUDA the warm-up steps' forwards join the runner's compile-only pass.
        """
        if not self.graph_mode.captures:
            return
        from backplane.engine.worker.graph.runner import GraphModelRunner

        if isinstance(self.runner, GraphModelRunner):
            ahead = compile_ahead.can_compile_ahead() and self._later_passes()
            self.runner.capture(self._warm_up_forwards if self._cuda else None, ahead=ahead)

    @timed_startup_method("graph capture")
    def _build_runner(self) -> ModelRunner:
        """The eager runner, or the CUDA-graph runner (its graphs not captured yet) for the
        graph mode."""
        if not self.graph_mode.captures:
            return EagerModelRunner(self.model, self.input_batch, self.sampler)
        from backplane.engine.worker.graph.runner import GraphModelRunner

        with startup_detail("graph runner set-up"):
            runner = GraphModelRunner(
                self.model,
                self.backends,
                self.input_batch,
                mode=self.graph_mode,
                max_num_tokens=self.max_num_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=self.max_model_len,
                page_size=self.page_size,
                token_bucket_sizes=self.config.cuda_graph_buckets,
                sampler=self.sampler,
                verify_len=self.verify_len,
                first_scratch_slot=self.num_slots if self.has_recurrent_state else None,
            )
        return runner

    def _verify_len(self) -> int:
        """Longest chunk a verify graph runs: ``k + 1`` under speculation, else 0 (none).

        A recurrent model's verify graphs chain each chunk's rows through
        state slots; it gets them only when every recurrent backend in use
        does that (``chains_rows``), else it verifies through piecewise graphs.
        A target split over ranks verifies through piecewise graphs too: the
        other ranks adopt the driver's prepared step (``InputBatch.adopt``),
        which does not carry a verify graph's row chain or its rows' owners.
        """
        spec = self.config.speculative_config
        if spec is None:
            return 0
        if self.config.tensor_parallel_size > 1:
            return 0
        unchained = [
            f"{family}={b.name}"
            for family, b in self.backends.items()
            if isinstance(b, RecurrentBackend) and not b.chains_rows
        ]
        if self.has_recurrent_state and unchained:
            logger.info(
                "speculative verification runs through piecewise graphs: the recurrent "
                "backends %s do not run verify graphs",
                ", ".join(unchained),
            )
            return 0
        return spec.num_speculative_tokens + 1

    def _verify_buckets(self) -> list[int]:
        """The verify graphs' buckets the runner will capture (none without speculation)."""
        rows = verify_rows(self.max_num_seqs, self.max_num_tokens, self.verify_len)
        return decode_buckets(rows) if rows and self.graph_mode.has_decode else []

    # -- per step -------------------------------------------------------------------

    def prepare_inputs(
        self, scheduled: Sequence[ScheduledSeqLike], pending_tokens: torch.Tensor | None = None
    ) -> BatchInputs:
        """Let the runner decide the step's mode and prepare its inputs (see the protocol).

        :param scheduled: the scheduler's sequences.
        :param pending_tokens: the in-flight step's tokens on the device, or ``None``.
        :return: the step's inputs.
        """
        ib = self.input_batch
        ib.pending_source = pending_tokens
        try:
            return self.runner.prepare_inputs(scheduled)
        finally:
            ib.pending_source = None

    @torch.inference_mode()
    def execute_model(self, inputs: BatchInputs) -> torch.Tensor:
        """Plan every backend once, then run the model under the forward context.

        Planning runs under inference mode too, like graph capture, so buffers a
        backend makes while planning are the same kind of tensor in every step.

        :param inputs: the step's inputs.
        :return: the hidden states of every (padded) token.
        """
        plans = plan_step(self.backends, inputs.metadata)
        with forward_context(inputs.metadata, plans):
            return self.runner.run(inputs)

    @torch.inference_mode()
    def sample_tokens(
        self, hidden: torch.Tensor, inputs: BatchInputs, rows: SamplingRows
    ) -> SamplerOutput:
        """Sample through the runner (a decode-graph step may replay its sampling graph).

        :param hidden: the step's hidden states.
        :param inputs: the step's inputs.
        :param rows: what each sampling sequence samples.
        :return: tokens (and logprobs where asked) on the device.
        """
        return self.runner.sample(hidden, inputs, rows)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Project some rows of a step's hidden states through the LM head.

        :param hidden: the step's hidden states (:meth:`execute_model`).
        :param rows: ``[R]`` int64 row indices into ``hidden``, on its device.
        :return: ``[R, vocab]`` logits (a vocabulary-parallel head gathers them on every rank).
        """
        return self.model.compute_logits(hidden.index_select(0, rows))

    @torch.inference_mode()
    def keep_verified_states(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """After a speculative verification: keep each sequence's recurrent state at its last
        accepted token (see :meth:`~backplane.models.base.CausalLM.keep_verified_states`).

        :param src_slots: ``[V]`` the slots holding the states to keep.
        :param dst_slots: ``[V]`` the verifying sequences' own slots.
        """
        self.model.keep_verified_states(src_slots, dst_slots)

    @torch.inference_mode()
    def copy_state_slots(
        self, saves: Sequence[tuple[int, int]], restores: Sequence[tuple[int, int]]
    ) -> None:
        """Copy recurrent states between slots of every recurrent layer, on the device.

        The saves run first, so a restore may read a snapshot saved in the same
        call; nothing is read on the host, so the copies queue after the step in
        flight and before the next one.

        :param saves: ``(source slot, destination slot)`` pairs, distinct destinations.
        :param restores: the same, copied after every save.
        """
        for pairs in (saves, restores):
            if not pairs:
                continue
            idx = torch.tensor(pairs, dtype=torch.int64).T.contiguous()
            if self._cuda:
                # from pinned memory the copy queues without waiting for the step in flight
                idx = idx.pin_memory().to(self.device, non_blocking=True)
            self.model.keep_verified_states(idx[0], idx[1])

    # -- lifetime -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Release the runner, model, caches and buffers (device memory back to the driver)."""
        if self._closed:
            return
        self._closed = True
        release = getattr(self, "_release_runner", None)
        if release is not None:
            release()
        for name in ("runner", "caches", "model", "backends", "input_batch", "sampler"):
            if hasattr(self, name):
                setattr(self, name, None)

    def describe(self) -> str:
        """One line for the start-up log: pages, KV bytes, state slots, backends."""
        return (
            f"device={self.device} dtype={self.dtype} pages={self.num_pages} x "
            f"{self.page_size} tokens ({self.kv_bytes / 2**20:.1f} MiB KV), state "
            f"slots={self.num_slots}, backends="
            f"{ {f: getattr(b, 'name', type(b).__name__) for f, b in self.backends.items()} }"
        )


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


def _wants_mtp(config: EngineConfig) -> bool:
    """Whether speculation drafts with the model's MTP layers (they are loaded only then)."""
    spec = config.speculative_config
    return spec is not None and spec.method == "mtp"
