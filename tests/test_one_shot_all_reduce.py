"""The one-shot all-reduce kernel's exchange, on the CPU, against peers the host plays.

:func:`backplane.kernels.one_shot_all_reduce.one_shot_all_reduce` copies this
rank's slice into its exchange buffer, stores a flag into every peer's flag
array, waits for the peers' flags and sums every rank's slice in rank order.
Here the peers' side is written by the host before each call (their slices in
the half their epoch selects, their flags in this rank's array), so the kernel
runs alone in the Triton interpreter. Checked for every rank of two and of
four, over calls of different sizes: the sum (the float32 sum in rank
order, rounded once), the flag it stores into each peer's array (the call's
epoch, program by program, its own included), the half of its own buffer it
writes, and the epochs it advances. A call whose peer never signals returns
once the host sets the abort word, and only then. Two GPUs run the real
exchange in ``test_one_shot_all_reduce_gpu.py``.

Run one check by hand with::

    TRITON_INTERPRET=1 python tests/test_one_shot_all_reduce.py exchange
"""

from __future__ import annotations

import sys

import torch
from interpreter_checks import interpreter_tests, main

CHECKS = ("exchange", "abort", "refusals")

if __name__ != "__main__":
    interpret_results, test_in_interpreter = interpreter_tests(__file__, CHECKS, timeout=600)

WORLD = 2


def _slice(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _rank_order_sum(slices: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The slices added in float32 in rank order, rounded once to ``dtype``."""
    acc = torch.zeros(slices[0].shape, dtype=torch.float32)
    for s in slices:
        acc += s.float()
    return acc.to(dtype)


def _abort_word(value: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's abort word and the one-address table it takes."""
    word = torch.full((1,), value, dtype=torch.int32)
    return word, torch.tensor([word.data_ptr()], dtype=torch.int64)


def _exchange(rank: int, world: int, dtype: torch.dtype) -> None:
    from backplane.kernels.one_shot_all_reduce import BLOCK, MAX_PROGRAMS, one_shot_all_reduce

    half = 4 * BLOCK + 64
    bufs = [torch.zeros(2 * half, dtype=dtype) for _ in range(world)]
    flags = [torch.zeros(MAX_PROGRAMS * world, dtype=torch.int32) for _ in range(world)]
    buffers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    epochs = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    word, abort = _abort_word()
    # the epochs every rank counts, program by program, as the host expects them
    counted = [0] * MAX_PROGRAMS
    for call, numel in enumerate([3 * BLOCK + 5, 7, 4 * BLOCK, 1, BLOCK + 1]):
        programs = -(-numel // BLOCK)
        slices = [_slice(world * call + r, numel, dtype) for r in range(world)]
        for p in range(programs):
            counted[p] += 1
            lo, hi = p * BLOCK, min((p + 1) * BLOCK, numel)
            at = (counted[p] & 1) * half
            for peer in range(world):
                if peer != rank:
                    # the peer has stored its slice and signalled this rank
                    bufs[peer][at + lo : at + hi] = slices[peer][lo:hi]
                    flags[rank][p * world + peer] = counted[p]
        x = slices[rank].clone()
        one_shot_all_reduce(x, buffers, flag_ptrs, epochs, abort, rank, half)
        want = _rank_order_sum(slices, dtype)
        assert torch.equal(x, want), f"rank {rank} of {world}, call {call}: wrong sums"
        assert epochs.tolist() == counted, f"call {call}: epochs {epochs.tolist()[:6]}"
        for peer in range(world):
            for p in range(MAX_PROGRAMS):
                got = int(flags[peer][p * world + rank])
                assert got == counted[p], f"call {call}: flag of program {p} at {peer} is {got}"
        for p in range(programs):
            lo, hi = p * BLOCK, min((p + 1) * BLOCK, numel)
            at = (counted[p] & 1) * half
            assert torch.equal(bufs[rank][at + lo : at + hi], slices[rank][lo:hi]), (
                f"call {call}: program {p} stored its slice elsewhere"
            )


def check_exchange() -> None:
    """Every rank of two and of four, every dtype, calls of one to four programs."""
    for world in (2, 4):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for rank in range(world):
                _exchange(rank, world, dtype)


def check_abort() -> None:
    """A peer that never signals: the call returns once the abort word is set, not before.

    The word is set by the host two seconds into the call (the kernel runs on
    another thread); a kernel that never reads it does not return (the join
    times out), one that gives up without it returns before the word is set.
    """
    import threading
    import time

    from backplane.kernels.one_shot_all_reduce import MAX_PROGRAMS, one_shot_all_reduce

    half = 64
    bufs = [torch.zeros(2 * half) for _ in range(WORLD)]
    flags = [torch.zeros(MAX_PROGRAMS * WORLD, dtype=torch.int32) for _ in range(WORLD)]
    buffers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    epochs = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    word, abort = _abort_word()
    x = torch.arange(5, dtype=torch.float32)
    done = threading.Event()

    def call() -> None:
        one_shot_all_reduce(x, buffers, flag_ptrs, epochs, abort, 0, half)
        done.set()

    waiting = threading.Thread(target=call, daemon=True)
    waiting.start()
    time.sleep(2.0)
    assert not done.is_set(), "the call returned though its peer never signalled"
    word.fill_(1)
    waiting.join(timeout=120)
    assert done.is_set(), "the call did not return after the abort word was set"
    assert int(epochs[0]) == 1 and int(flags[1][0 * WORLD + 0]) == 1, "the call did not start"
    # a later call gives up at its first look at the word (the word stays set)
    started = time.monotonic()
    one_shot_all_reduce(x, buffers, flag_ptrs, epochs, abort, 0, half)
    assert int(epochs[0]) == 2, f"epoch {int(epochs[0])} after the second call"
    assert time.monotonic() - started < 120, "the second call waited on"


def check_refusals() -> None:
    """A message larger than a buffer half or not contiguous is refused with a message."""
    from backplane.kernels.one_shot_all_reduce import MAX_PROGRAMS, one_shot_all_reduce

    i64 = torch.zeros(WORLD, dtype=torch.int64)
    epochs = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    for x in (torch.zeros(65), torch.zeros(8, 8).t()):
        try:
            one_shot_all_reduce(x, i64, i64, epochs, i64[:1], 0, 64)
        except ValueError as e:
            assert "contiguous tensor of at most 64 elements" in str(e), str(e)
        else:
            raise AssertionError(f"no ValueError for {tuple(x.shape)}")


def run_check(name: str) -> tuple[str, str] | None:
    """Run one check by name (child side)."""
    globals()[f"check_{name}"]()
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, run_check))
