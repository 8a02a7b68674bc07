"""Conformance tests shared by the recurrent families (``ssm`` and ``delta``).

Their ops carry a per-sequence state in a slot (``batch.state_slots``)
instead of pages. :class:`RecurrentBackendTests` holds what both families
test the same way: ``opcheck`` of every cached op on a batch that starts
from no state, and a decode step captured in a CUDA graph. A family suite
describes its ops through :meth:`RecurrentBackendTests.op_calls`; the
helpers below build the states and batches of its own tests.

State slots of sequences without initial state hold NaN before each call
(:func:`random_state`), so an op that reads them instead of starting from
zeros fails; slots no sequence uses hold random values that must come back
untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from backplane.core.metadata import BatchMetadata
from backplane.core.packing import build_batch_metadata
from backplane.testing.batches import BatchCase, make_case
from backplane.testing.checks import assert_close_to_reference, check_graph_replay
from backplane.testing.plugin import BackendTestsBase, require_feature

#: Scale of the sequence-length dependent error of a recurrence against float64
#: (applied to the kit's per-dtype tolerances): prompts here are at most ~20
#: tokens, over which float32 accumulation error stays a few ulps per step.
RECURRENCE_TOL_SCALE = 2.0


def assert_recurrence_close(
    out: torch.Tensor,
    expected: torch.Tensor,
    state: torch.Tensor,
    expected_state: torch.Tensor,
    dtype: torch.dtype,
    names: tuple[str, str],
) -> None:
    """Assert a recurrent op's output and float32 state equal what they should.

    Both are compared at the activation dtype's tolerances scaled by
    :data:`RECURRENCE_TOL_SCALE`: the state is stored in float32, but chunked
    kernels may feed the tensor cores operands in the activation dtype, so the
    state is only as exact as that.

    :param out: the op's output (real tokens only).
    :param expected: what the output must be.
    :param state: the state the op wrote.
    :param expected_state: what the state must be.
    :param dtype: the activation dtype.
    :param names: ``(output, state)`` names for failure messages.
    """
    assert state.dtype == torch.float32
    assert_close_to_reference(out, expected, dtype, scale=RECURRENCE_TOL_SCALE, msg=names[0])
    assert_close_to_reference(
        state, expected_state, dtype, scale=RECURRENCE_TOL_SCALE, msg=names[1]
    )


def random_state(
    shape: Sequence[int],
    dtype: torch.dtype,
    batch: BatchMetadata,
    gen: torch.Generator,
    device: torch.device,
    scale: float = 1.0,
) -> torch.Tensor:
    """A random per-slot state whose slots without initial state hold NaN.

    :param shape: ``[num_slots, ...]``.
    :param dtype: the state dtype.
    :param batch: the batch whose sequences' slots are poisoned.
    :param gen: the random generator.
    :param device: where the state goes.
    :param scale: standard deviation of the random values.
    :return: the state tensor on ``device``.
    """
    state = torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * scale
    host = batch.host
    for i in range(batch.num_seqs):
        if not host.has_initial_state[i]:
            state[int(host.state_slots[i])] = float("nan")
    return state.to(device=device, dtype=dtype)


def single_sequence_batch(
    query_len: int, cached_len: int, slot: int, device: torch.device, padding: int = 1
) -> BatchMetadata:
    """One sequence in state slot ``slot``, with a few padding rows.

    :param query_len: new tokens of the step.
    :param cached_len: tokens before them.
    :param slot: the sequence's state slot.
    :param device: where the metadata's tensors go.
    :param padding: padding rows after the real tokens.
    :return: the batch metadata.
    """
    total = query_len + cached_len
    return build_batch_metadata(
        [query_len],
        [cached_len],
        [list(range(1, total + 1))],
        1,
        state_slots=[slot],
        padded_num_tokens=query_len + padding,
        device=device,
    )


def prompt_chunks(
    chunks: Sequence[int], slot: int, device: torch.device
) -> Iterator[tuple[BatchMetadata, slice]]:
    """The steps of one prompt fed in chunks: each chunk's batch and its rows of the prompt.

    :param chunks: tokens per step (later ones of 1 are decode steps).
    :param slot: the sequence's state slot.
    :param device: where the metadata's tensors go.
    :return: ``(batch, rows)`` per step; the batch has one padding row.
    """
    done = 0
    for n in chunks:
        yield single_sequence_batch(n, done, slot, device), slice(done, done + n)
        done += n


def step_rows(t: torch.Tensor, rows: slice, batch: BatchMetadata) -> torch.Tensor:
    """Rows ``rows`` of a per-token input, followed by zero rows up to the batch's padded size.

    :param t: the whole prompt's per-token input.
    :param rows: this step's rows.
    :param batch: this step's batch.
    :return: the step's input.
    """
    pad = batch.padded_num_tokens - (rows.stop - rows.start)
    return torch.cat([t[rows], torch.zeros_like(t[:pad])])


@dataclass
class OpCall:
    """One call of a cached op, ready to run with or without ``out``.

    :param run: calls the op with the given ``out`` (``None``: without).
    :param out_like: a tensor of the op's full result shape and dtype.
    :param per_token_inputs: the per-token inputs (a graph replay refreshes them).
    :param states: every state the op writes.
    """

    run: Callable[[torch.Tensor | None], torch.Tensor]
    out_like: torch.Tensor
    per_token_inputs: list[torch.Tensor]
    states: list[torch.Tensor]


class RecurrentBackendTests(BackendTestsBase):
    """The tests a recurrent family runs the same way, on the calls of :meth:`op_calls`."""

    #: :func:`~backplane.testing.batches.make_case` arguments (``query_lens``,
    #: ``cached_lens``, ``seed``...) of the extra ``long_prefill_and_extend`` case,
    #: whose prompts span several chunks of the family's chunked prefill.
    LONG_CASE: ClassVar[dict[str, Any]] = {}

    @classmethod
    def cases(cls) -> list[BatchCase]:
        """The kit's standard batches plus the long prompts of :attr:`LONG_CASE`.

        :return: the cases.
        """
        return [
            *super().cases(),
            make_case("long_prefill_and_extend", shuffle_slots=True, padding=2, **cls.LONG_CASE),
        ]

    def op_calls(
        self,
        backend: Any,
        case: BatchCase,
        batch: BatchMetadata,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[OpCall]:
        """One call of each cached op of the family, with the suite's default layers.

        :param backend: the backend under test.
        :param case: the batch (its ``num_slots`` sizes the states).
        :param batch: the batch's metadata on ``device``.
        :param dtype: the activation dtype.
        :param device: where the inputs go.
        :return: the calls, in the order a layer makes them.
        """
        raise NotImplementedError

    def test_opcheck(self, backend: Any, device: torch.device) -> None:
        """``torch.library.opcheck`` passes for every op the family's calls make."""
        case = self.get_case("prefill")  # no initial state: repeated calls are idempotent
        batch = case.metadata(device)
        calls = self.op_calls(backend, case, batch, self.single_dtype, device)
        n = sum(
            self.check_custom_ops(
                backend, batch, lambda c=c: c.run(None), c.out_like.shape, c.out_like.dtype
            )
            for c in calls
        )
        assert n >= len(calls)

    @pytest.mark.gpu
    def test_decode_cuda_graph_replay(self, backend: Any, backend_capabilities: Any) -> None:
        """A decode step captured in a CUDA graph replays correctly with new inputs and slots."""
        if not torch.cuda.is_available():
            pytest.skip("CUDA is not available")
        require_feature(backend_capabilities, "cuda", "cuda_graph")
        device = torch.device("cuda")
        case = self.get_case("decode")
        batch = case.metadata(device)
        calls = self.op_calls(backend, case, batch, self.single_dtype, device)
        outs = [torch.empty_like(c.out_like) for c in calls]

        def step() -> None:
            for call, out in zip(calls, outs, strict=True):
                call.run(out)

        check_graph_replay(
            batch,
            {self.family: backend.plan(batch)},
            step,
            [t for c in calls for t in c.per_token_inputs],
            [s for c in calls for s in c.states],
            outs,
        )
