"""The CUDA-graph model runner: runs each step as a decode graph, through piecewise graphs, or eagerly.

:meth:`GraphModelRunner.prepare_inputs` decides the step's
:class:`~backplane.core.metadata.StepMode` once, and :meth:`GraphModelRunner.run`
dispatches on it:

* decode-only step, batch within a captured decode bucket -> the monolithic
  graph of that bucket (forward and LM head), the batch padded with scratch
  sequences, then the bucket's captured sampling graph
  (:class:`~backplane.engine.worker.graph.sampling_head.SamplingHead`);
* a step of short chunks on cached context (a speculative verification),
  when the runner was given ``verify_len`` -> the verify graph of the bucket
  holding one decode row per position (see
  :func:`~backplane.engine.worker.inputs.position_rows`), padded as a decode
  batch; it projects every row to logits (``BatchInputs.logits``). In a model
  with recurrent state the rows chain their states through scratch slots
  (:func:`~backplane.engine.worker.inputs.chain_rows`), one recurrent decode
  step per row;
* prefill or mixed step within a captured token bucket -> piecewise graphs,
  the tokens padded to the bucket;
* anything else -> eager.

Before capturing a bucket the runner calls every backend's
``prepare_capture(mode, batch)`` with the capture batch, so a backend that keeps
per-bucket buffers sets them up (and knows they may not move afterwards).

Decode graphs are captured with every sequence at the model's full length
(``max_model_len``) and a block table of full width, so work a backend sizes
from host lengths is sized for the worst case, and each replay masks by the
real lengths it reads from the device metadata.

At start-up on CUDA (:func:`~backplane.core.compile_ahead.can_compile_ahead`),
:meth:`GraphModelRunner.capture` first runs one compile-only pass over the
forward of every bucket it will capture and of the warm-up steps the worker
will run: the Triton kernels of them all compile side by side, where each
bucket's first run would otherwise compile its new variants one after the
other.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from backplane.core import compile_ahead
from backplane.core.families import Backend, RecurrentBackend
from backplane.core.forward_context import forward_context, plan_step
from backplane.core.metadata import NULL_PAGE, StepMode
from backplane.core.parallel import tensor_parallel
from backplane.engine.sampling import Sampler, SamplerOutput, SamplingRows
from backplane.engine.sizes import pages_per_seq
from backplane.engine.worker.graph.buckets import (
    decode_buckets,
    pick_bucket,
    token_buckets,
    verify_rows,
)
from backplane.engine.worker.graph.capture import new_pool, pool_bytes
from backplane.engine.worker.graph.decode import DecodeGraphs
from backplane.engine.worker.graph.mode import GraphMode
from backplane.engine.worker.graph.piecewise import PiecewiseGraphs
from backplane.engine.worker.graph.sampling_head import SamplingHead
from backplane.engine.worker.inputs import (
    BatchInputs,
    InputBatch,
    RowChain,
    ScheduledSeqLike,
    ScratchRequest,
    ScratchSeq,
    chain_rows,
    position_rows,
    scratch_prefill,
)
from backplane.engine.worker.runner import sample_eagerly
from backplane.engine.worker.startup_timings import startup_detail

logger = logging.getLogger(__name__)

#: the start-up detail that the compile-only pass before the captures adds its seconds to
CAPTURE_AHEAD_DETAIL = f"{compile_ahead.AHEAD_DETAIL}: graph captures and warm-up"


class GraphModelRunner:
    """Model runner with CUDA graphs (a :class:`~backplane.engine.worker.runner.ModelRunner`).

    :param model: the loaded ``CausalLM``.
    :param backends: ``{family: backend}`` selected for the model.
    :param input_batch: the worker's persistent :class:`~backplane.engine.worker.inputs.InputBatch`.
    :param mode: the graphs to capture, as
        :func:`~backplane.engine.worker.graph.mode.decide_graph_mode` decided them
        (taken as given). On a CPU device the "graphs" are eager stand-ins, which
        lets the dispatch, padding and capture logic be tested without CUDA.
    :param max_num_tokens: token budget per step (the largest piecewise bucket).
    :param max_num_seqs: most sequences per step (the largest decode bucket).
    :param max_model_len: longest sequence.
    :param page_size: tokens per KV page.
    :param token_bucket_sizes: configured piecewise buckets (default powers of two).
    :param decode_bucket_sizes: configured decode buckets (default powers of two).
    :param sampler: the sampler (default: a new, stateless :class:`Sampler`).
    :param verify_len: capture verify graphs for chunks of up to this many
        tokens per sequence (``num_speculative_tokens + 1``), one bucket per
        decode bucket size up to :func:`~.buckets.verify_rows` rows (the input
        batch must hold that many sequences); 0 (the default) captures none.
    :param first_scratch_slot: for a model with recurrent state and ``verify_len``:
        the first of the ``max_num_seqs * (verify_len - 1)`` state slots the
        verify graphs' rows chain their states through (the verification
        scratch region); every recurrent backend must chain rows
        (:attr:`~backplane.core.families.RecurrentBackend.chains_rows`).
    :raises ValueError: verify graphs asked for a model with recurrent state without
        ``first_scratch_slot``, or over a recurrent backend that does not chain rows.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backends: Mapping[str, Backend],
        input_batch: InputBatch,
        *,
        mode: GraphMode,
        max_num_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        page_size: int,
        token_bucket_sizes: Sequence[int] | None = None,
        decode_bucket_sizes: Sequence[int] | None = None,
        sampler: Sampler | None = None,
        verify_len: int = 0,
        first_scratch_slot: int | None = None,
    ) -> None:
        self.model = model
        self.backends = backends
        self.input_batch = input_batch
        self.mode = mode
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.max_pages = pages_per_seq(max_model_len, page_size)
        self.cuda = input_batch.device.type == "cuda"
        self.pool = new_pool() if mode.captures and self.cuda else None
        self.token_buckets = token_buckets(max_num_tokens, token_bucket_sizes)
        self.decode_buckets = decode_buckets(max_num_seqs, decode_bucket_sizes)
        self.sampler = sampler if sampler is not None else Sampler()
        self.decode: DecodeGraphs | None = None
        self.head: SamplingHead | None = None
        self.verify: DecodeGraphs | None = None
        self.verify_len = verify_len
        self.max_num_seqs = max_num_seqs
        #: verify rows chain recurrent states (a model with recurrent state)
        self.chains_states = bool(verify_len) and bool(getattr(model, "has_recurrent_state", False))
        self.first_scratch_slot = first_scratch_slot
        if self.chains_states:
            _check_chaining(backends, first_scratch_slot)
        most_rows = verify_rows(max_num_seqs, max_num_tokens, verify_len)
        self.verify_buckets = (
            decode_buckets(most_rows, decode_bucket_sizes) if most_rows and mode.has_decode else []
        )
        self.piecewise: PiecewiseGraphs | None = None
        # read-only padding sequences for decode replays, made once
        self._decode_padding = self._scratch(
            max([self.decode_buckets[-1], *self.verify_buckets]), 1, 1
        )
        if mode.has_decode:
            self.decode = DecodeGraphs(
                self._forward_logits, self.decode_buckets, self.pool, cuda=self.cuda
            )
            self.head = SamplingHead(
                self.sampler,
                self.decode_buckets[-1],
                input_batch.device,
                self.pool,
                cuda=self.cuda,
            )
            if self.verify_buckets:
                self.verify = DecodeGraphs(
                    self._forward_logits, self.verify_buckets, self.pool, cuda=self.cuda
                )
        if mode.has_piecewise:
            ops = [op for b in backends.values() for op in b.dynamic_ops()]
            self.piecewise = PiecewiseGraphs(
                self._forward, ops, self.token_buckets, self.pool, cuda=self.cuda
            )

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def _forward_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # a decode step samples every row: the LM head runs on all of them, in the graph
        hidden = self.model(input_ids, positions)
        return hidden, self.model.compute_logits(hidden)

    # -- capture ------------------------------------------------------------------
    def _scratch(self, n: int, cached: int, num_pages: int) -> list[ScratchSeq]:
        req = ScratchRequest(np.zeros(cached + 1, dtype=np.int32))
        pages = np.full(num_pages, NULL_PAGE, dtype=np.int32)
        return [ScratchSeq(req, 1, cached, pages) for _ in range(n)]

    @contextlib.contextmanager
    def _decode_inputs(
        self, bucket: int, *, rows_share_pages: bool = False
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        mode = StepMode.decode_graph(bucket, rows_share_pages=rows_share_pages)
        seqs = self._scratch(bucket, self.max_model_len - 1, self.max_pages)
        chain = None
        if rows_share_pages and self.chains_states:
            chain = RowChain.padding(min(self.verify_len, bucket))
        inputs = self.input_batch.prepare(
            seqs, block_table_width=self.max_pages, mode=mode, chain=chain
        )
        with self._capture_context(inputs):
            yield (inputs.input_ids, inputs.positions)

    @contextlib.contextmanager
    def _piecewise_inputs(self, bucket: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # scratch prefill sequences of `bucket` tokens on scratch pages
        mode = StepMode.piecewise(bucket)
        seqs = scratch_prefill(bucket, self.max_model_len, self.page_size)
        inputs = self.input_batch.prepare(seqs, padded_num_tokens=bucket, mode=mode)
        with self._capture_context(inputs):
            yield (inputs.input_ids, inputs.positions)

    @contextlib.contextmanager
    def _capture_context(self, inputs: BatchInputs) -> Iterator[None]:
        """Let every backend prepare the capture, plan the capture batch, make it the context."""
        metadata = inputs.metadata
        for backend in self.backends.values():
            backend.prepare_capture(metadata.mode, metadata)
        with forward_context(metadata, plan_step(self.backends, metadata)):
            yield

    @torch.inference_mode()
    def capture(self, warm_up: Callable[[], None] | None = None, *, ahead: bool = True) -> None:
        """Capture every configured graph, with a progress bar (bucket and pool memory).

        Where :func:`~backplane.core.compile_ahead.can_compile_ahead` allows it
        (inside a start-up window, on CUDA), one compile-only pass over every
        bucket's forward and ``warm_up`` comes first (:meth:`forwards_ahead`).

        :param warm_up: the forwards of the warm-up steps that will run through this
            runner once it is captured (run in the compile-only pass only).
        :param ahead: ``False``: no compile-only pass.
        """
        if not self.mode.captures:
            return
        if ahead and compile_ahead.can_compile_ahead():
            logger.info(
                "compiling the kernels of the graph buckets%s side by side",
                " and warm-up steps" if warm_up is not None else "",
            )
            compile_ahead.run_ahead(
                "the CUDA-graph buckets and warm-up steps",
                self.forwards_ahead,
                warm_up,
                detail=CAPTURE_AHEAD_DETAIL,
            )
            if self.cuda:
                # what the pass's forwards left cached goes back before the graphs' pool grows
                torch.cuda.empty_cache()
        total = (
            (len(self.decode_buckets) if self.decode else 0)
            + (len(self.verify_buckets) if self.verify else 0)
            + (len(self.token_buckets) if self.piecewise else 0)
        )
        # every tensor-parallel rank captures the same buckets: the first one's bar says it all
        quiet = tensor_parallel().rank != 0
        with tqdm(total=total, desc="capturing CUDA graphs", unit="bucket", disable=quiet) as bar:
            if self.piecewise is not None:
                self.piecewise.capture(self._piecewise_inputs, progress=bar)
            if self.decode is not None:
                self.decode.capture(self._decode_inputs, progress=bar)
                with startup_detail("capture sampling heads"):
                    for bucket, graph in self.decode.graphs.items():
                        self.head.capture(bucket, graph.outputs[1])
            if self.verify is not None:
                self.verify.capture(
                    functools.partial(self._decode_inputs, rows_share_pages=True), progress=bar
                )
        if self.cuda:
            with startup_detail("capture: waiting for the device"):
                torch.cuda.synchronize()
        logger.info("CUDA graph pool: %.1f MiB", pool_bytes(self.pool) / 2**20)

    def forwards_ahead(self, warm_up: Callable[[], None] | None = None) -> None:
        """Run the forward of every bucket :meth:`capture` captures, then ``warm_up``.

        For a compile-only pass (:func:`~backplane.core.compile_ahead.compile_only`):
        each bucket runs on the batch it is captured with, in the order it is
        captured, its decode buckets through the LM head as their graphs do, so
        every Triton kernel variant the captures launch is asked for. A failure is
        logged and the pass goes on; that bucket's kernels compile when it is
        captured. Nothing is sampled (the logits are not real).

        :param warm_up: run last, with the steps that the piecewise buckets will
            hold taken through those buckets (eagerly, on the padded batch), as
            they will be once the buckets are captured.
        """
        attempt = compile_ahead.attempt
        if self.piecewise is not None:
            for bucket in sorted(self.token_buckets, reverse=True):
                attempt(f"piecewise bucket {bucket}", self._forward_ahead, bucket)
        if self.decode is not None:
            for bucket in sorted(self.decode_buckets, reverse=True):
                attempt(f"decode batch {bucket}", self._decode_ahead, bucket, False)
        if self.verify is not None:
            for bucket in sorted(self.verify_buckets, reverse=True):
                attempt(f"verify batch {bucket}", self._decode_ahead, bucket, True)
        if warm_up is not None:
            with self._as_if_captured():
                attempt("the warm-up steps", warm_up)

    def _forward_ahead(self, bucket: int) -> None:
        with self._piecewise_inputs(bucket) as args:
            self._forward(*args)

    def _decode_ahead(self, bucket: int, rows_share_pages: bool) -> None:
        with self._decode_inputs(bucket, rows_share_pages=rows_share_pages) as args:
            self._forward_logits(*args)

    @contextlib.contextmanager
    def _as_if_captured(self) -> Iterator[None]:
        """Let :meth:`step_mode` choose piecewise buckets not captured yet (they run eagerly)."""
        if self.piecewise is None:
            yield
            return
        captured = self.piecewise.captured
        self.piecewise.captured = set(self.token_buckets)
        try:
            yield
        finally:
            self.piecewise.captured = captured

    def memory_report(self) -> dict[str, int | dict[int, int]]:
        """Pool growth per bucket and in total, in bytes."""
        return {
            "piecewise": dict(self.piecewise.ctx.pool_bytes) if self.piecewise else {},
            "decode": dict(self.decode.pool_bytes) if self.decode else {},
            "verify": dict(self.verify.pool_bytes) if self.verify else {},
            "total": pool_bytes(self.pool),
        }

    def release(self) -> None:
        """Drop every graph, the sampling graphs and the pool (see :meth:`PiecewiseGraphs.release`)."""
        if self.piecewise is not None:
            self.piecewise.release()
        for graphs in (self.decode, self.verify, self.head):
            if graphs is not None:
                graphs.graphs.clear()
        self.piecewise = self.decode = self.verify = self.head = None
        self.pool = None

    # -- per step -----------------------------------------------------------------
    def step_mode(self, num_seqs: int, num_tokens: int, decode_only: bool) -> StepMode:
        """Decide how a step runs: the smallest captured bucket that holds it, else eagerly.

        :param num_seqs: sequences of the step.
        :param num_tokens: real tokens of the step.
        :param decode_only: whether every sequence adds one token to cached context.
        :return: the step's mode.
        """
        if self.decode is not None and decode_only:
            bucket = pick_bucket(num_seqs, self.decode_buckets)
            if bucket is not None and self.decode.has(bucket):
                return StepMode.decode_graph(bucket)
        if self.piecewise is not None:
            bucket = pick_bucket(num_tokens, self.token_buckets)
            if bucket is not None and bucket in self.piecewise.captured:
                return StepMode.piecewise(bucket)
        return StepMode()

    def prepare_inputs(self, scheduled: Sequence[ScheduledSeqLike]) -> BatchInputs:
        """Decide the step's mode and prepare its inputs padded to the mode's bucket.

        :param scheduled: the scheduler's sequences (prefill first, decode last).
        :return: the step's inputs; ``inputs.mode`` is the decision.
        """
        n = len(scheduled)
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        on_context = all(s.num_cached_tokens > 0 for s in scheduled)
        decode_only = num_tokens == n and on_context
        if self.verify is not None and not decode_only and on_context:
            inputs = self._verify_inputs(scheduled, num_tokens)
            if inputs is not None:
                return inputs
        mode = self.step_mode(n, num_tokens, decode_only)
        if mode.is_decode_graph:
            seqs = list(scheduled) + self._decode_padding[: mode.bucket - n]
            return self.input_batch.prepare(seqs, block_table_width=self.max_pages, mode=mode)
        if mode.is_piecewise:
            return self.input_batch.prepare(scheduled, padded_num_tokens=mode.bucket, mode=mode)
        return self.input_batch.prepare(scheduled)

    def _verify_inputs(
        self, scheduled: Sequence[ScheduledSeqLike], num_tokens: int
    ) -> BatchInputs | None:
        """Inputs of a step of short chunks as one decode row per position, or ``None``.

        ``None`` when a chunk is longer than ``verify_len``, no captured verify
        bucket holds the rows, or (recurrent state) the step has more sequences
        than the scratch region has room for; the step then runs as any other.
        """
        if max(s.num_new_tokens for s in scheduled) > self.verify_len:
            return None
        bucket = pick_bucket(num_tokens, self.verify_buckets)
        if bucket is None or not self.verify.has(bucket):
            return None
        chain = None
        if self.chains_states:
            if len(scheduled) > self.max_num_seqs:
                return None
            chain = chain_rows(
                scheduled,
                self.first_scratch_slot,
                self.verify_len - 1,
                min(self.verify_len, bucket),
            )
        rows, starts = position_rows(scheduled)
        mode = StepMode.decode_graph(bucket, rows_share_pages=True)
        seqs = rows + self._decode_padding[: bucket - len(rows)]
        inputs = self.input_batch.prepare(
            seqs, block_table_width=self.max_pages, mode=mode, chain=chain
        )
        # the rows in order of their sequences: a sampled row names its sequence
        owner = np.repeat(np.arange(len(scheduled)), [s.num_new_tokens for s in scheduled])
        inputs.sample_seqs = owner[inputs.sample_seqs]
        inputs.seq_rows = starts
        return inputs

    @torch.inference_mode()
    def run(self, inputs: BatchInputs) -> torch.Tensor:
        """Run the step as its mode says: replay, piecewise replay, or eagerly.

        :param inputs: from :meth:`prepare_inputs`.
        :return: hidden states ``[padded_num_tokens, hidden]`` (valid until the next step).
        """
        mode = inputs.mode
        if mode.is_decode_graph:
            graphs = self.verify if mode.rows_share_pages else self.decode
            hidden, inputs.logits = graphs.replay(mode.bucket)
            return hidden
        if mode.is_piecewise:
            return self.piecewise.run(mode.bucket, inputs.input_ids, inputs.positions)
        return self.model(inputs.input_ids, inputs.positions)

    @torch.inference_mode()
    def sample(
        self, hidden: torch.Tensor, inputs: BatchInputs, rows: SamplingRows
    ) -> SamplerOutput:
        """Sample the step: a decode-graph step replays its bucket's sampling graph.

        Other steps (a decode-graph step whose sampling graphs failed to
        capture, or whose rows ask for penalties, ``min_tokens`` or logprobs,
        or that holds prompt-logprob rows, which the captured graphs do not do)
        run the LM head and sampler op by op; a decode-graph step then reuses the
        logits its graph already computed (its graph projects every row, so a
        one-token prompt chunk's row is there too). A piecewise step's graphs end
        at the hidden states: its sampling rows and prompt-logprob rows are
        gathered and projected here, eagerly, in one pass.

        :param hidden: what :meth:`run` returned for ``inputs``.
        :param inputs: the step's inputs.
        :param rows: the sampling sequences, in ``inputs.logits_indices`` order.
        :return: ``[len(rows)]`` int64 tokens on the device (and logprobs where asked).
        """
        mode = inputs.mode
        if (
            mode.is_decode_graph
            and not mode.rows_share_pages
            and not rows.needs_eager
            and self.head is not None
            and self.head.has(mode.bucket)
        ):
            # The sampling graph reads logits rows 0..n-1. A decode step keeps its
            # sequences in order, so the rows that sample (increasing) are exactly
            # those when the last one is n-1; a 1-token chunk that ends short of
            # its prompt samples nothing and breaks that.
            ss = inputs.sample_seqs
            if len(ss) and int(ss[-1]) == len(ss) - 1:
                return SamplerOutput(self.head.sample(mode.bucket, rows))
        return sample_eagerly(self.model, self.sampler, hidden, inputs, rows, inputs.logits)


def _check_chaining(backends: Mapping[str, Backend], first_scratch_slot: int | None) -> None:
    """Refuse verify graphs of a recurrent model that its backends cannot run.

    :param backends: ``{family: backend}`` of the model.
    :param first_scratch_slot: the runner's scratch region, or ``None``.
    :raises ValueError: no scratch region, or a recurrent backend without ``chains_rows``.
    """
    if first_scratch_slot is None:
        raise ValueError(
            "verify graphs of a model with recurrent state chain their rows' states through "
            "scratch slots: give first_scratch_slot, or verify_len=0 to verify piecewise"
        )
    refused = [
        f"{family}={backend.name or type(backend).__name__}"
        for family, backend in backends.items()
        if isinstance(backend, RecurrentBackend) and not backend.chains_rows
    ]
    if refused:
        raise ValueError(
            f"the recurrent backends {', '.join(refused)} cannot run verify graphs (their ops "
            "do not chain decode rows through state slots); pass verify_len=0 so that "
            "verification runs piecewise, or select the torch backends of those families"
        )
