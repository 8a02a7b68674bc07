"""The tensor-parallel all-reduce hands the messages a small all-reduce takes to it, and the rest
to the group's collective (one gloo process here; the one-shot kernel itself is GPU-tested in
``test_one_shot_all_reduce_gpu.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from backplane.core import parallel
from backplane.core.parallel import TensorParallel, set_small_all_reduce
from backplane.engine.distributed.group import leave_group


class _Tripling:
    """A stand-in that takes messages of at most ``limit`` elements and marks them (x3)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls: list[tuple[int, ...]] = []

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.limit

    def __call__(self, x: torch.Tensor) -> None:
        self.calls.append(tuple(x.shape))
        x.mul_(3)

    def abort(self) -> None:
        raise AssertionError("nothing aborts it here")

    @property
    def aborted(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield dist.group.WORLD
    finally:
        set_small_all_reduce(None)
        dist.destroy_process_group()


def test_small_messages_go_to_the_small_all_reduce_and_the_rest_to_the_group(one_rank_group):
    # size 2 so that the op runs; the one-process group sums nothing, leaving x as it was
    tp = TensorParallel(rank=0, size=2, group=one_rank_group)
    previous = parallel.set_tensor_parallel(tp)
    try:
        small = _Tripling(limit=8)
        set_small_all_reduce(small)
        x = torch.arange(8, dtype=torch.float32)
        assert tp.all_reduce(x) is x
        assert torch.equal(x, torch.arange(8, dtype=torch.float32) * 3)
        big = torch.arange(9, dtype=torch.float32)
        tp.all_reduce(big)
        assert torch.equal(big, torch.arange(9, dtype=torch.float32))
        assert small.calls == [(8,)]

        set_small_all_reduce(None)
        again = torch.arange(8, dtype=torch.float32)
        tp.all_reduce(again)
        assert torch.equal(again, torch.arange(8, dtype=torch.float32))
        assert small.calls == [(8,)]
    finally:
        parallel.set_tensor_parallel(previous)


def test_one_rank_never_calls_it():
    small = _Tripling(limit=1 << 20)
    set_small_all_reduce(small)
    try:
        x = torch.ones(4)
        TensorParallel().all_reduce(x)
        assert torch.equal(x, torch.ones(4)) and small.calls == []
    finally:
        set_small_all_reduce(None)


def test_leaving_the_group_drops_and_closes_it():
    small = _Tripling(limit=4)
    set_small_all_reduce(small)
    leave_group()
    assert parallel._small is None
    assert getattr(small, "closed", False), "its buffers were not given back"
