"""The one-shot all-reduce kernel's exchange, on the CPU, against a peer the host plays.

:func:`backplane.kernels.one_shot_all_reduce.one_shot_all_reduce` copies this
rank's slice into its exchange buffer, stores a flag into every peer's flag
array, waits for the peers' flags and sums every rank's slice in rank order.
Here the peer's side is written by the host before each call (its slice in the
half its epoch selects, its flag in this rank's array), so the kernel runs
alone in the Triton interpreter. Checked for both ranks of two, over calls of
different sizes: the sum (float32 of the two values, rounded once, as the
float64 sum rounds), the flag it stores into the peer's array (the call's
epoch, program by program), the half of its own buffer it writes, and the
epochs it advances. Two GPUs run the real exchange in
``test_one_shot_all_reduce_gpu.py``.

Run one check by hand with::

    TRITON_INTERPRET=1 python tests/test_one_shot_all_reduce.py exchange
"""

from __future__ import annotations

import sys

import torch
from interpreter_checks import interpreter_tests, main

CHECKS = ("exchange", "refusals")

if __name__ != "__main__":
    interpret_results, test_in_interpreter = interpreter_tests(__file__, CHECKS, timeout=600)

WORLD = 2


def _slice(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _exchange(rank: int, dtype: torch.dtype) -> None:
    from backplane.kernels.one_shot_all_reduce import BLOCK, MAX_PROGRAMS, one_shot_all_reduce

    peer = 1 - rank
    half = 4 * BLOCK + 64
    bufs = [torch.zeros(2 * half, dtype=dtype) for _ in range(WORLD)]
    flags = [torch.zeros(MAX_PROGRAMS * WORLD, dtype=torch.int32) for _ in range(WORLD)]
    buffers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    epochs = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    # the epochs both ranks count, program by program, as the host expects them
    counted = [0] * MAX_PROGRAMS
    for call, numel in enumerate([3 * BLOCK + 5, 7, 4 * BLOCK, 1, BLOCK + 1]):
        programs = -(-numel // BLOCK)
        mine = _slice(2 * call + rank, numel, dtype)
        theirs = _slice(2 * call + peer, numel, dtype)
        for p in range(programs):
            counted[p] += 1
            lo, hi = p * BLOCK, min((p + 1) * BLOCK, numel)
            at = (counted[p] & 1) * half
            # the peer has stored its slice and signalled this rank
            bufs[peer][at + lo : at + hi] = theirs[lo:hi]
            flags[rank][p * WORLD + peer] = counted[p]
        x = mine.clone()
        one_shot_all_reduce(x, buffers, flag_ptrs, flags[rank], epochs, rank, half)
        ordered = (mine, theirs) if rank == 0 else (theirs, mine)
        want = (ordered[0].double() + ordered[1].double()).to(dtype)
        assert torch.equal(x, want), f"call {call} ({numel} elements): wrong sums"
        assert epochs.tolist() == counted, f"call {call}: epochs {epochs.tolist()[:6]}"
        for p in range(MAX_PROGRAMS):
            got = int(flags[peer][p * WORLD + rank])
            assert got == counted[p], f"call {call}: flag of program {p} is {got}"
        for p in range(programs):
            lo, hi = p * BLOCK, min((p + 1) * BLOCK, numel)
            at = (counted[p] & 1) * half
            assert torch.equal(bufs[rank][at + lo : at + hi], mine[lo:hi]), (
                f"call {call}: program {p} stored its slice elsewhere"
            )


def check_exchange() -> None:
    """Both ranks of two, every dtype, calls of one to four programs."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rank in range(WORLD):
            _exchange(rank, dtype)


def check_refusals() -> None:
    """A message larger than a buffer half or not contiguous is refused with a message."""
    from backplane.kernels.one_shot_all_reduce import MAX_PROGRAMS, one_shot_all_reduce

    i64 = torch.zeros(WORLD, dtype=torch.int64)
    flags = torch.zeros(MAX_PROGRAMS * WORLD, dtype=torch.int32)
    epochs = torch.zeros(MAX_PROGRAMS, dtype=torch.int32)
    for x in (torch.zeros(65), torch.zeros(8, 8).t()):
        try:
            one_shot_all_reduce(x, i64, i64, flags, epochs, 0, 64)
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
