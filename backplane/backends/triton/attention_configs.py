"""Launch configurations of the Triton attention kernels and how one is chosen.

The default tables were measured with ``benchmarks/tune_triton_attention.py``;
a shape class names the table a launch draws from, and the first configuration
that fits the device (shared memory, registers) is used and remembered. The
number of key splits of the decode is chosen here too.
"""

from __future__ import annotations

import torch
from triton.runtime.errors import OutOfResources

from backplane.backends.triton._common import MAX_KV_SPLITS, device_parallelism, next_pow2
from backplane.core.launch import KernelLauncher, cdiv
from backplane.core.metadata import BatchMetadata

#: Index of the first config that fitted the device, per launch key.
_CONFIG_CHOICE: dict[tuple, int] = {}


def _cfg(block_m: int | None, block_n: int, num_warps: int, num_stages: int) -> dict:
    """One launch configuration (tile sizes, warps, pipeline stages)."""
    cfg = {"BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages}
    if block_m is not None:
        cfg["BLOCK_M"] = block_m
    return cfg


def _configs_key(configs: list[dict]) -> tuple:
    """A hashable identity of a caller-given configuration list (tuning scripts only)."""
    return tuple(tuple(sorted(c.items())) for c in configs)


# The defaults below come from benchmarks/tune_triton_attention.py on an H200
# (Llama-3-8B layer, bfloat16); see docs/benchmarks/triton.md. They are built once:
# the launchers run per layer per step, and the name doubles as the launch key.
_PREFILL_CONFIGS: dict[str, list[dict]] = {
    "big": [_cfg(32, 32, 8, 2), _cfg(16, 16, 8, 1)],
    "long": [_cfg(128, 128, 8, 3), _cfg(128, 128, 8, 2), _cfg(128, 64, 8, 3), _cfg(64, 32, 4, 2)],
    "medium": [_cfg(128, 64, 8, 3), _cfg(64, 32, 4, 2)],
    "short": [_cfg(64, 32, 4, 2)],
    "tiny": [_cfg(32, 32, 4, 2)],
}
# Split sequences (few of them, long contexts) stream long key ranges per program
# and prefer wide tiles; unsplit ones (many sequences) narrow tiles.
_DECODE_CONFIGS: dict[str, list[dict]] = {
    "big": [_cfg(None, 32, 8, 2), _cfg(None, 16, 8, 1)],
    "wide_head": [_cfg(None, 32, 4, 2)],
    "split": [_cfg(None, 128, 4, 2), _cfg(None, 64, 4, 2)],
    "many_splits": [_cfg(None, 128, 8, 2), _cfg(None, 128, 4, 2), _cfg(None, 64, 4, 2)],
    "unsplit": [_cfg(None, 64, 4, 2)],
}
# "many_splits": 16 or more splits of a head dim up to 64 (one sequence, a long
# context or a decode graph captured at a long max_model_len). With 32 splits the
# 4-warp configurations took 13-16 us per layer and 128 keys x 8 warps 7.7-8.4
# (Llama-1B's layer at 1024 and 2048 keys on an H200, benchmarks/decode_splits.py);
# with 16 splits 8 warps was as fast or up to 0.2 us faster.
_MANY_SPLITS = 16


def _prefill_class(big: bool, max_q: int, dk: int) -> str:
    """The shape class that picks the default prefill configurations."""
    if big:
        return "big"
    if max_q >= 2048 and dk <= 128:
        return "long"
    if max_q > 64:
        return "medium"
    return "tiny" if max_q <= 32 else "short"


def _decode_class(big: bool, dk: int, num_splits: int) -> str:
    """The shape class that picks the default decode configurations."""
    if big:
        return "big"
    if dk > 128:
        return "wide_head"
    if num_splits >= _MANY_SPLITS and dk <= 64:
        return "many_splits"
    return "split" if num_splits > 1 else "unsplit"


def _launch_fitting(
    launcher: KernelLauncher,
    grid,
    key: tuple,
    configs: list[dict],
    args: tuple,
    meta: dict,
    launch_key: tuple | None = None,
) -> int:
    """Launch with the first config (fastest first) whose shared memory / registers fit.

    A config that does not fit raises ``OutOfResources`` when it is compiled,
    before anything is enqueued; the next one is tried and the choice is
    remembered per ``key``, so the search happens once per shape class.

    :param launch_key: the launch's key for ``launcher`` without the config
        (see :class:`~backplane.core.launch.KernelLauncher`); ``None`` derives
        one from ``args`` and ``meta``.
    :return: the index of the configuration launched (the launcher's key is
        ``(launch_key, index)``).
    """
    start = _CONFIG_CHOICE.get(key, 0)
    device = args[0].device.index
    for i in range(start, len(configs)):
        cfg = configs[i]
        try:
            if launch_key is None:
                launcher.launch(grid(cfg), args, device, **meta, **cfg)
            else:
                launcher((launch_key, i), grid(cfg), args, device, **meta, **cfg)
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        _CONFIG_CHOICE[key] = i
        return i
    raise AssertionError("unreachable: the last configuration raises or launches")


KEYS_PER_SPLIT = 128
"""About how many keys a decode split is given. At one sequence each split is a
latency-bound page walk; Llama-1B's layer (32/8 heads of 64) on an H200, the
calls of 16 layers in one graph (``benchmarks/decode_splits.py``), us per layer:
576 keys: 7.7 with 4 splits, 6.5 with 8; 1024 keys: 6.5 with 8, 6.9 with 16;
2048 keys: 9.4 with 8, 8.1 with 16, 15.4 with 32. So the context's count of
128-key blocks is rounded up to a power of two: 5 blocks get 8 splits."""


#: the most bytes of key and value tiles a decode program holds in registers while it
#: waits for the previous kernel (``_decode_kernel``'s ``EARLY``): Llama-3.1-8B's
#: layer (heads of 128) at batch 1 with 128-key tiles (64 KiB) ran slower than without
#: the early tile; Llama-3.2-1B's (heads of 64, 32 KiB) ran faster
EARLY_TILE_BYTES = 32768


#: a decode launch reads its first tile before its wait only where the device holds at
#: least this many splits of every sequence (a few sequences: batch 1, the end of a
#: batch). Its tiles are then the early tile's keys (64 at heads of 128), which read
#: long splits slower than the 128-key tiles of other launches (an FP8 cache, 32
#: sequences x 1,200 keys in two splits: 66.8 against 54.6 us on an H100,
#: ``benchmarks/tune_triton_attention.py``); with more splits a sequence's are short
EARLY_MIN_SPLITS = 4


def early_block(block_dk: int, block_dv: int, element_size: int) -> int:
    """The keys of a decode program's first tile read before its wait (see
    :data:`EARLY_TILE_BYTES`): a power of two from 16 to 128.

    :param block_dk: the key tile's width.
    :param block_dv: the value tile's width.
    :param element_size: bytes of a tile element as the products read it.
    """
    fit = EARLY_TILE_BYTES // ((block_dk + block_dv) * element_size)
    return max(16, min(128, 1 << (max(fit, 1).bit_length() - 1)))


def choose_num_splits(
    batch: BatchMetadata,
    programs_per_split: int,
    device: torch.device,
    keys_per_split: int = KEYS_PER_SPLIT,
) -> int:
    """Pick how many key splits each decode sequence gets.

    Enough splits to fill the device (about two programs per SM, and at most
    :data:`MAX_KV_SPLITS`, rounded down to a power of two), but no more than
    the longest context's (host value) count of ``keys_per_split``-key
    blocks rounded up to a power of two. The kernel derives each split's range
    from the sequence length on the device, so any value is correct for any
    lengths (a decode graph captured with one value replays correctly for
    others).
    """
    n = batch.num_decode_seqs
    if n == 0:
        return 1
    want = cdiv(device_parallelism(device), max(n * programs_per_split, 1))
    fill = int(max(1, min(want, MAX_KV_SPLITS)))
    # Powers of two: the count is a compile-time constant of the kernel, so
    # free values would compile a new variant for nearly every mixed step.
    by_len = next_pow2(cdiv(max(batch.max_seq_len, 1), keys_per_split))
    return min(1 << (fill.bit_length() - 1), by_len)
