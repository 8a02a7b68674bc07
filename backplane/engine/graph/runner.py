"""The CUDA-graph model runner: dispatches each step to a decode graph, piecewise graphs, or eager.

* decode-only step, batch within a decode bucket -> the monolithic graph of
  that bucket, the batch padded with scratch sequences;
* prefill or mixed step within the token buckets -> piecewise graphs, the
  tokens padded to the bucket;
* anything larger -> eager.

Decode graphs are captured with every sequence at the model's full length
(``max_model_len``) and a block table of full width, so work a backend sizes
from host lengths is sized for the worst case, and each replay masks by the
real lengths it reads from the device metadata.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from backplane.core.forward_context import forward_context, plan_step
from backplane.core.metadata import NULL_PAGE, NULL_SLOT
from backplane.engine.graph.buckets import decode_buckets, pick_bucket, token_buckets
from backplane.engine.graph.capture import new_pool, pool_bytes
from backplane.engine.graph.decode import DecodeGraphs
from backplane.engine.graph.piecewise import PiecewiseGraphs

logger = logging.getLogger(__name__)

MODES = ("off", "decode", "piecewise", "full_and_piecewise")


@dataclass
class _ScratchRequest:
    token_buffer: np.ndarray


@dataclass
class _ScratchSeq:
    """A padding sequence: one token on top of cached scratch context, on page 0 / slot 0."""

    request: _ScratchRequest
    num_new_tokens: int
    num_cached_tokens: int
    page_ids: np.ndarray
    state_slot: int = NULL_SLOT
    is_prefill_chunk_final: bool = False


class GraphModelRunner:
    """Model runner with CUDA graphs (drop-in for the executor's eager runner).

    :param model: the loaded ``CausalLM``.
    :param backends: ``{family: backend}`` selected for the model.
    :param input_batch: the engine's persistent :class:`~backplane.engine.inputs.InputBatch`.
    :param mode: one of :data:`MODES`.
    :param max_num_tokens: token budget per step (the largest piecewise bucket).
    :param max_num_seqs: most sequences per step (the largest decode bucket).
    :param max_model_len: longest sequence.
    :param page_size: tokens per KV page.
    :param token_bucket_sizes: configured piecewise buckets (default powers of two).
    :param decode_bucket_sizes: configured decode buckets (default powers of two).
    :param allow_cpu: keep the graph machinery on a CPU device, where "graphs"
        are eager stand-ins; lets the dispatch, padding and capture logic be
        tested without CUDA.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backends: dict[str, Any],
        input_batch: Any,
        *,
        mode: str,
        max_num_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        page_size: int,
        token_bucket_sizes: Sequence[int] | None = None,
        decode_bucket_sizes: Sequence[int] | None = None,
        allow_cpu: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"cuda_graphs={mode!r}; expected one of {', '.join(MODES)}")
        self.model = model
        self.backends = backends
        self.input_batch = input_batch
        self.mode = mode
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.max_pages = -(-max_model_len // page_size)
        self.cuda = torch.cuda.is_available() and input_batch.device.type == "cuda"
        if mode != "off" and not self.cuda and not allow_cpu:
            logger.info("CUDA graphs need a CUDA device; running eagerly")
            self.mode = mode = "off"
        self.pool = new_pool() if mode != "off" and self.cuda else None
        self.token_buckets = token_buckets(max_num_tokens, token_bucket_sizes)
        self.decode_buckets = decode_buckets(max_num_seqs, decode_bucket_sizes)
        self.decode: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        # read-only padding sequences for decode replays, made once
        self._decode_padding = self._scratch(self.decode_buckets[-1], 1, 1)
        if mode in ("decode", "full_and_piecewise"):
            self.decode = DecodeGraphs(
                self._forward, self.decode_buckets, self.pool, cuda=self.cuda
            )
        if mode in ("piecewise", "full_and_piecewise"):
            ops = [op for b in backends.values() for op in b.dynamic_ops()]
            self.piecewise = PiecewiseGraphs(
                self._forward, ops, self.token_buckets, self.pool, cuda=self.cuda
            )

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    # -- capture ------------------------------------------------------------------
    def _scratch(self, n: int, cached: int, num_pages: int) -> list[_ScratchSeq]:
        req = _ScratchRequest(np.zeros(cached + 1, dtype=np.int32))
        pages = np.full(num_pages, NULL_PAGE, dtype=np.int32)
        return [_ScratchSeq(req, 1, cached, pages) for _ in range(n)]

    @contextlib.contextmanager
    def _decode_inputs(self, bucket: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        seqs = self._scratch(bucket, self.max_model_len - 1, self.max_pages)
        inputs = self.input_batch.prepare(seqs, block_table_width=self.max_pages)
        with forward_context(inputs.metadata, plan_step(self.backends, inputs.metadata)):
            yield (inputs.input_ids, inputs.positions)

    @contextlib.contextmanager
    def _piecewise_inputs(self, bucket: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # one scratch prefill sequence of `bucket` tokens on scratch pages
        pages = -(-bucket // self.page_size)
        req = _ScratchRequest(np.zeros(bucket, dtype=np.int32))
        seq = _ScratchSeq(req, bucket, 0, np.full(pages, NULL_PAGE, dtype=np.int32))
        inputs = self.input_batch.prepare([seq], padded_num_tokens=bucket)
        with forward_context(inputs.metadata, plan_step(self.backends, inputs.metadata)):
            yield (inputs.input_ids, inputs.positions)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every configured graph, with a progress bar (bucket and pool memory)."""
        if self.mode == "off":
            return
        total = (len(self.decode_buckets) if self.decode else 0) + (
            len(self.token_buckets) if self.piecewise else 0
        )
        with tqdm(total=total, desc="capturing CUDA graphs", unit="bucket") as bar:
            if self.piecewise is not None:
                self.piecewise.capture(self._piecewise_inputs, progress=bar)
            if self.decode is not None:
                self.decode.capture(self._decode_inputs, progress=bar)
        if self.cuda:
            torch.cuda.synchronize()
        logger.info("CUDA graph pool: %.1f MiB", pool_bytes(self.pool) / 2**20)

    def memory_report(self) -> dict[str, Any]:
        """Pool growth per bucket and in total, in bytes."""
        return {
            "piecewise": dict(self.piecewise.ctx.pool_bytes) if self.piecewise else {},
            "decode": dict(self.decode.pool_bytes) if self.decode else {},
            "total": pool_bytes(self.pool),
        }

    # -- per step -----------------------------------------------------------------
    def prepare_inputs(self, scheduled: Sequence[Any]) -> Any:
        """Pad the step to the bucket it will run at and prepare its inputs.

        :param scheduled: the scheduler's sequences (prefill first, decode last).
        :return: the :class:`~backplane.engine.inputs.BatchInputs` of the padded step.
        """
        n = len(scheduled)
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        decode_only = num_tokens == n and all(s.num_cached_tokens > 0 for s in scheduled)
        if self.decode is not None and decode_only:
            bucket = pick_bucket(n, self.decode_buckets)
            if bucket is not None and self.decode.has(bucket):
                seqs = list(scheduled) + self._decode_padding[: bucket - n]
                return self.input_batch.prepare(seqs, block_table_width=self.max_pages)
        if self.piecewise is not None:
            bucket = pick_bucket(num_tokens, self.token_buckets)
            if bucket is not None and bucket in self.piecewise.captured:
                return self.input_batch.prepare(scheduled, padded_num_tokens=bucket)
        return self.input_batch.prepare(scheduled)

    @torch.inference_mode()
    def run(self, inputs: Any) -> torch.Tensor:
        """Return hidden states ``[padded_num_tokens, hidden]`` (valid until the next step)."""
        meta = inputs.metadata
        if self.decode is not None and meta.is_decode_only and self.decode.has(meta.num_seqs):
            if meta.padded_num_tokens == meta.num_seqs:
                return self.decode.replay(meta.num_seqs)
        if self.piecewise is not None and meta.padded_num_tokens in self.piecewise.captured:
            return self.piecewise.run(meta.padded_num_tokens, inputs.input_ids, inputs.positions)
        return self.model(inputs.input_ids, inputs.positions)
