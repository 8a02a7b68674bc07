"""The kit's contract checks must catch each way an op can break the out-buffer contract."""

from __future__ import annotations

import pytest
import torch

from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.testing.checks import (
    TOLERANCES,
    assert_close_to_reference,
    check_out_contract,
    no_host_sync,
    poison_,
    record_custom_ops,
)

N = 3  # real rows of the 5-row test buffers


def _shape(x, cache, mode, out=None):
    return tuple(x.shape), x.dtype


@cached_op("backplane_test_kit::scaled", mutates_args=("cache", "out"), output_shape=_shape)
def scaled(
    x: torch.Tensor, cache: torch.Tensor, mode: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """2 * x on the first N rows, x appended to the cache; ``mode`` injects one contract bug."""
    buf = output_buffer(out, x.shape, x.dtype, x.device)
    rows = N - 1 if mode == "skip_row" else N
    torch.mul(x[:rows], 2.0, out=buf[:rows])
    if mode == "differs_with_out" and out is not None:
        buf[0].add_(1.0)
    if mode == "cache_only_without_out" and out is not None:
        pass
    else:
        cache[:N].add_(x[:N])
    if mode == "no_zero_tail":
        return buf.new_empty(0) if out is not None else buf
    if mode == "returns_out" and out is not None:
        return out.clone()
    return finish_output(out, buf, N)


def _run(mode: str):
    x, cache = torch.randn(5, 4), torch.randn(5, 4)
    return lambda out: scaled(x, cache, mode, out=out), [cache]


def test_correct_op_passes_and_caches_are_restored() -> None:
    run, caches = _run("ok")
    before = caches[0].clone()
    full = check_out_contract(run, caches, N)
    assert full.shape == (5, 4)
    # The op adds x to the cache once per call; the check restores in between.
    assert torch.allclose(caches[0][:N] - before[:N], full[:N] / 2)


@pytest.mark.parametrize(
    ("mode", "fragment"),
    [
        ("no_zero_tail", "exactly zero"),
        ("returns_out", "empty sentinel"),
        ("skip_row", "NaN poison"),
        ("differs_with_out", "differ between"),
        ("cache_only_without_out", "cache 0 differs"),
    ],
)
def test_each_violation_is_caught(mode: str, fragment: str) -> None:
    run, caches = _run(mode)
    with pytest.raises(AssertionError, match=fragment):
        check_out_contract(run, caches, N)


def test_poison() -> None:
    assert torch.isnan(poison_(torch.zeros(3, dtype=torch.bfloat16))).all()
    assert (poison_(torch.zeros(3, dtype=torch.int32)) == torch.iinfo(torch.int32).max).all()
    assert poison_(torch.zeros(3, dtype=torch.bool)).all()


def test_tolerances_cover_the_backend_dtypes() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        atol, rtol = TOLERANCES[dtype]
        assert 0 < atol < 0.1 and 0 < rtol < 0.1
    assert (
        TOLERANCES[torch.float32][0] < TOLERANCES[torch.float16][0] < TOLERANCES[torch.bfloat16][0]
    )


def test_reference_comparison_rejects_nan_and_large_errors() -> None:
    ref = torch.randn(4, 3, dtype=torch.float64)
    assert_close_to_reference(ref.float(), ref, torch.float32)
    with pytest.raises(AssertionError):
        assert_close_to_reference((ref + 0.1).float(), ref, torch.float32)
    bad = ref.float().clone()
    bad[1, 1] = float("nan")
    with pytest.raises(AssertionError):
        assert_close_to_reference(bad, ref, torch.float32)


def test_record_custom_ops_sees_only_custom_ops() -> None:
    x, cache = torch.randn(5, 4), torch.zeros(5, 4)
    _, calls = record_custom_ops(lambda: scaled(x.sin(), cache, "ok"))
    assert [op for op, _, _ in calls] == [torch.ops.backplane_test_kit.scaled.default]


def test_no_host_sync_is_a_no_op_on_cpu() -> None:
    with no_host_sync("cpu"):
        assert torch.ones(2).sum().item() == 2.0


@pytest.mark.gpu
def test_no_host_sync_catches_item_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    x = torch.ones(2, device="cuda")
    with pytest.raises(RuntimeError), no_host_sync("cuda"):
        x.sum().item()
    assert torch.cuda.get_sync_debug_mode() == 0
