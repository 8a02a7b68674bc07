"""The one-shot all-reduce on two GPUs: sums against a float64 reference, bit-equal on every rank,
eagerly and replayed in a CUDA graph, the engine's routing of small messages to it, and a wait
for a peer that never comes, ended by the host's abort."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")


def _two_gpus() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 131 + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _reference(world: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The float64 sum of every rank's input, rounded once to ``dtype``."""
    total = sum(_inputs(r, numel, dtype, seed).double() for r in range(world))
    return total.to(dtype)


def _join(rank: int, world: int, port: int) -> torch.device:
    """Join a NCCL group of ``world`` ranks on this rank's GPU; return the GPU."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    return device


def _check(rank: int, world: int, port: int) -> None:
    device = _join(rank, world, port)
    try:
        from backplane.core import parallel
        from backplane.core.parallel import TensorParallel, set_tensor_parallel
        from backplane.engine.distributed.one_shot import setup_one_shot

        set_tensor_parallel(TensorParallel(rank=rank, size=world, group=dist.group.WORLD))
        assert setup_one_shot(dist.group.WORLD, rank, world, device)
        comm = parallel._small
        assert comm is not None
        sizes = [1, 7, 2048, 4096, 5000, 8192 * 3 + 5, comm.max_elems]
        seed = 0
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for numel in sizes:
                seed += 1
                x = _inputs(rank, numel, dtype, seed).to(device)
                assert comm.fits(x)
                comm(x)
                want = _reference(world, numel, dtype, seed)
                # float32 sums of two float32 values round once, as the float64 sum does
                torch.testing.assert_close(x.cpu(), want, rtol=0, atol=0)
                every = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(every, x)
                for other in every:
                    assert torch.equal(other, x), "ranks disagree"
        # too large for the buffers: the group's NCCL sum takes it
        big = torch.ones(comm.max_elems + 1, dtype=torch.float32, device=device)
        assert not comm.fits(big)
        torch.ops.backplane.tp_all_reduce(big)
        assert bool((big == world).all())

        # captured: the epochs advance on the device, so every replay is a new call
        x = torch.zeros(4096, dtype=torch.bfloat16, device=device)
        y = torch.zeros(4096 * 3, dtype=torch.bfloat16, device=device)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(5):
                torch.ops.backplane.tp_all_reduce(x)
                torch.ops.backplane.tp_all_reduce(y)
        for step in range(20):
            xs = _inputs(rank, 4096, torch.bfloat16, 1000 + step)
            ys = _inputs(rank, 4096 * 3, torch.bfloat16, 2000 + step)
            x.copy_(xs)
            y.copy_(ys)
            graph.replay()
            # five sums in a row: the first sums the ranks, the next four double it
            want_x = _reference(world, 4096, torch.bfloat16, 1000 + step)
            want_y = _reference(world, 4096 * 3, torch.bfloat16, 2000 + step)
            for _ in range(4):
                want_x = (want_x.double() * world).to(torch.bfloat16)
                want_y = (want_y.double() * world).to(torch.bfloat16)
            torch.testing.assert_close(x.cpu(), want_x, rtol=0, atol=0)
            torch.testing.assert_close(y.cpu(), want_y, rtol=0, atol=0)
        dist.barrier()
    finally:
        parallel.set_small_all_reduce(None)
        dist.destroy_process_group()


def test_one_shot_sums_equal_float64_on_every_rank_eager_and_in_graphs():
    _two_gpus()
    mp.spawn(_check, args=(2, _port()), nprocs=2, join=True)


def _check_abort(rank: int, world: int, port: int) -> None:
    device = _join(rank, world, port)
    try:
        from backplane.core import parallel
        from backplane.engine.distributed.one_shot import setup_one_shot

        assert setup_one_shot(dist.group.WORLD, rank, world, device)
        comm = parallel._small
        assert comm is not None and not comm.aborted
        dist.barrier()
        if rank == 0:
            # rank 1 never makes this call: rank 0's kernel waits for its flag
            x = torch.ones(4096, dtype=torch.bfloat16, device=device)
            comm(x)
            done = torch.cuda.Event()
            done.record()
            time.sleep(2.0)
            assert not done.query(), "the sum finished without the peer's slice"
            comm.abort()
            t0 = time.monotonic()
            while not done.query():
                assert time.monotonic() - t0 < 30, "the kernel went on waiting after the abort"
                time.sleep(0.01)
            assert comm.aborted
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        parallel.set_small_all_reduce(None)
        dist.destroy_process_group()


def test_a_wait_for_a_peer_that_never_comes_ends_when_the_host_aborts():
    _two_gpus()
    mp.spawn(_check_abort, args=(2, _port()), nprocs=2, join=True)


def _check_rejoin(rank: int, world: int, ports: tuple[int, int]) -> None:
    """Join, sum, leave, and join a new group in the same processes (a second engine)."""
    from backplane.core import parallel
    from backplane.engine.distributed.group import join_group, leave_group

    device = torch.device("cuda", rank)
    for seed, port in enumerate(ports):
        join_group(rank, world, f"tcp://127.0.0.1:{port}", device, one_shot=True)
        try:
            comm = parallel._small
            assert comm is not None, f"group {seed}: the one-shot all-reduce was not set up"
            x = _inputs(rank, 5000, torch.bfloat16, seed).to(device)
            comm(x)
            want = _reference(world, 5000, torch.bfloat16, seed)
            torch.testing.assert_close(x.cpu(), want, rtol=0, atol=0)
        finally:
            leave_group()


def test_a_second_group_in_the_same_processes_sets_it_up_again():
    _two_gpus()
    mp.spawn(_check_rejoin, args=(2, (_port(), _port())), nprocs=2, join=True)
