"""CPU KV memory: the default budget follows the limits, and large caches cost only what is written."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from backplane.core.layouts import TensorSpec, cache_footprint
from backplane.engine import sizes
from backplane.engine.engine import Engine
from backplane.engine.sizes import cpu_kv_budget

GiB = 1 << 30


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    pytest.skip("no VmRSS in /proc/self/status")


def test_budget_is_what_the_limits_need() -> None:
    """Every sequence at full length, plus the scratch page and the states."""
    budget, why = cpu_kv_budget(
        page_bytes=1000, state_bytes=77, max_num_seqs=4, max_pages_per_seq=10, available=64 * GiB
    )
    assert budget == 77 + (4 * 10 + 1) * 1000
    assert "max_num_seqs=4" in why and "10 pages" in why and "within 50%" in why


def test_budget_is_capped_by_available_memory() -> None:
    """More than the share of available memory is never taken."""
    budget, why = cpu_kv_budget(
        page_bytes=GiB, state_bytes=0, max_num_seqs=32, max_pages_per_seq=8, available=10 * GiB
    )
    assert budget == 5 * GiB
    assert "capped at 50%" in why
    budget, _ = cpu_kv_budget(
        page_bytes=GiB,
        state_bytes=0,
        max_num_seqs=32,
        max_pages_per_seq=8,
        available=10 * GiB,
        fraction=0.25,
    )
    assert budget == int(2.5 * GiB)


def test_unknown_available_memory_means_no_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a reading of the available memory the limits alone decide."""
    monkeypatch.setattr(sizes, "available_memory", lambda: None)
    budget, why = cpu_kv_budget(
        page_bytes=GiB, state_bytes=0, max_num_seqs=64, max_pages_per_seq=64
    )
    assert budget == (64 * 64 + 1) * GiB
    assert "available" not in why


def test_available_memory_reads_the_os() -> None:
    """A positive figure no larger than the machine's memory (Linux)."""
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc/meminfo")
    total = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    available = sizes.available_memory()
    assert available is not None and 0 < available <= total


def test_engine_sizes_cpu_pool_to_its_limits(caplog: pytest.LogCaptureFixture) -> None:
    """A CPU engine without kv_memory gets exactly max_num_seqs x max_model_len of pages."""
    with caplog.at_level(logging.INFO, logger="backplane.engine.worker.memory"):
        engine = Engine(
            model="tiny-llama",
            device="cpu",
            dtype="float32",
            max_num_seqs=3,
            max_num_tokens=64,
            max_model_len=40,
            page_size=16,
        )
    per_seq = -(-40 // 16)
    assert engine.num_pages == 3 * per_seq + 1
    assert any("KV memory on cpu" in r.getMessage() for r in caplog.records)
    explicit = Engine(
        model="tiny-llama", device="cpu", dtype="float32", max_num_seqs=3, kv_memory="1MiB"
    )
    specs = explicit.model.cache_specs(num_pages=2, page_size=16, num_slots=1, dtype=torch.float32)
    assert explicit.num_pages == (1 << 20) // cache_footprint(specs).page_bytes


def test_large_cpu_cache_is_committed_on_write() -> None:
    """A 256 MiB cache costs no resident memory until written; it reads as zeros, aligned."""
    spec = TensorSpec((512, 2, 16, 4, 1024), torch.float32, paged=True)
    assert spec.nbytes == 256 << 20
    before = _rss_kib()
    cache = spec.allocate("cpu")
    assert cache.shape == spec.shape and cache.dtype == torch.float32 and cache.is_contiguous()
    assert cache.data_ptr() % 64 == 0
    assert _rss_kib() - before < 64 << 10
    cache[3].fill_(1.0)
    assert float(cache[3].sum()) == 2 * 16 * 4 * 1024
    assert not cache[4:].any() and not cache[:3].any()
    assert _rss_kib() - before < 128 << 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_allocate_keeps_dtype_and_zeros(dtype: torch.dtype) -> None:
    """Every dtype, large (on-demand pages) and small (allocator), comes back zero-filled."""
    for shape in [(300, 2, 16, 3, 64), (2, 3)]:
        t = TensorSpec(shape, dtype).allocate("cpu")
        assert t.shape == shape and t.dtype == dtype
        assert not t.any()
