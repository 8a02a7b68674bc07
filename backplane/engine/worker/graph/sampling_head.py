"""Sampling inside captured graphs: the decode step's last part, replayed like its forward.

A decode graph ends with the LM head (its outputs are the hidden states and
the ``[bucket, vocab]`` logits). :class:`SamplingHead` captures, per bucket,
small graphs that turn those logits into one token per row, so a decode step
is two replays and one device-to-host copy of the tokens; no logits leave the
device and no sampling kernel is launched from Python.

Three variants per bucket, chosen per step from the rows' parameters, so a
step pays only for what its rows use:

* ``greedy`` -- every row greedy: ``argmax`` only, nothing copied to the device;
* ``random`` -- temperature and seeded noise, no top-k / top-p / min-p row;
* ``filtered`` -- every filter, rows that do not use one given its neutral value
  (top-k 0, top-p 1, min-p 0).

The variants run :meth:`Sampler.sample_tensors` on views of persistent
parameter buffers, so they draw exactly the tokens the eager sampler draws for
the same rows. The rows' parameters reach the device in one copy from one of
two pinned staging buffers used in turn: with asynchronous steps the host
fills step N+1's while step N's copy may still be queued.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from backplane.engine.sampling import Sampler, SamplingRows, SamplingTensors, param_arrays
from backplane.engine.worker.graph.capture import CapturedGraph, GraphPool, capture

KINDS = ("greedy", "random", "filtered")

# rows of the parameter buffer; float32 fields travel as their int32 bit patterns
_TEMP, _TOP_K, _TOP_P, _MIN_P, _SEED, _OFFSET = range(6)


def _bits(values: np.ndarray) -> np.ndarray:
    """float32 values as int64 holding their (sign-extended) int32 bit patterns."""
    return values.astype(np.float32).view(np.int32).astype(np.int64)


def _floats(row: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_bits` on the device."""
    return row.to(torch.int32).view(torch.float32)


class SamplingHead:
    """Captured sampling graphs per decode bucket, and the parameter buffers they read.

    :param sampler: the engine's sampler (its :meth:`Sampler.sample_tensors` is captured).
    :param max_rows: the largest decode bucket.
    :param device: where the logits are.
    :param pool: the graph memory pool shared with the decode graphs.
    :param cuda: record real CUDA graphs (otherwise eager stand-ins, as the decode graphs).
    """

    def __init__(
        self,
        sampler: Sampler,
        max_rows: int,
        device: torch.device,
        pool: GraphPool = None,
        cuda: bool = True,
    ) -> None:
        self.sampler = sampler
        self.device = device
        self.pool = pool
        self.cuda = cuda
        self.params = torch.zeros((6, max_rows), dtype=torch.int64, device=device)
        pin = cuda and device.type == "cuda"
        self._staging = [
            torch.zeros((6, max_rows), dtype=torch.int64, pin_memory=pin) for _ in range(2)
        ]
        self._turn = 0
        self.graphs: dict[tuple[int, str], CapturedGraph] = {}

    def _sample_fn(self, kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        sampler = self.sampler

        def run(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
            if kind == "greedy":
                t = SamplingTensors(None, None, None, None, None, None, None, True)
            else:
                temperature = _floats(params[_TEMP])
                filtered = kind == "filtered"
                t = SamplingTensors(
                    temperature=temperature,
                    top_k=params[_TOP_K] if filtered else None,
                    top_p=_floats(params[_TOP_P]) if filtered else None,
                    min_p=_floats(params[_MIN_P]) if filtered else None,
                    seeds=params[_SEED],
                    offsets=params[_OFFSET],
                    greedy=temperature == 0.0,
                    all_greedy=False,
                )
            return sampler.sample_tensors(logits, t)

        return run

    def capture(self, bucket: int, logits: torch.Tensor) -> None:
        """Capture every variant for ``bucket``, reading the decode graph's ``logits``.

        :param bucket: the decode bucket (rows of ``logits``).
        :param logits: ``[bucket, vocab]``, the decode graph's stable logits output.
        """
        view = self.params[:, :bucket]
        for kind in KINDS:
            self.graphs[bucket, kind] = capture(
                self._sample_fn(kind), None, (logits, view), pool=self.pool, cuda=self.cuda
            )

    def has(self, bucket: int) -> bool:
        """True when every variant of ``bucket`` was captured."""
        return all((bucket, k) in self.graphs for k in KINDS)

    def kind(self, rows: SamplingRows) -> tuple[str, tuple[np.ndarray, ...]]:
        """The variant the rows need, and their filter arrays (host work only)."""
        arrays = param_arrays(rows.params)
        temps, top_k, top_p, min_p = arrays
        if not (temps != 0.0).any():
            return "greedy", arrays
        if (top_k > 0).any() or (top_p < 1.0).any() or (min_p > 0.0).any():
            return "filtered", arrays
        return "random", arrays

    def sample(self, bucket: int, rows: SamplingRows) -> torch.Tensor:
        """Sample the decode graph's logits of ``bucket`` for ``rows`` (its first rows).

        Padding rows beyond ``len(rows)`` decode greedily; their tokens are dropped.

        :param bucket: the decode bucket the forward replayed.
        :param rows: the step's sampling rows (at most ``bucket``).
        :return: ``[len(rows)]`` int64 tokens on the device (a view, valid until the next step).
        """
        kind, (temps, top_k, top_p, min_p) = self.kind(rows)
        n = len(rows)
        if kind != "greedy":
            host = self._staging[self._turn]
            self._turn ^= 1
            h = host[:, :bucket].numpy()
            h[:, n:] = 0  # padding rows: temperature 0 (greedy), every filter off
            h[_TOP_P, n:] = _bits(np.ones(1, dtype=np.float32))
            h[_TEMP, :n] = _bits(temps)
            h[_TOP_K, :n] = top_k
            h[_TOP_P, :n] = _bits(top_p)
            h[_MIN_P, :n] = _bits(min_p)
            h[_SEED, :n] = rows.seeds
            h[_OFFSET, :n] = rows.offsets
            # the whole buffer (a few KiB): a strided slice would be staged through pageable memory
            self.params.copy_(host, non_blocking=True)
        return self.graphs[bucket, kind].replay()[:n]
