"""The out-buffer contract helpers: cached_op registration, output_buffer, finish_output."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.forward_context import forward_context
from backplane.testing.batches import batch_cases


def _rows_shape(x: torch.Tensor, *args, **kwargs):
    return (x.shape[0], 2 * x.shape[1]), x.dtype


@cached_op(
    "backplane_test_contract::widen", mutates_args=("cache", "out"), output_shape=_rows_shape
)
def widen(
    x: torch.Tensor, cache: torch.Tensor, n: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Writes [x, 2x] for the first n rows and records x into the cache."""
    buf = output_buffer(out, (x.shape[0], 2 * x.shape[1]), x.dtype, x.device)
    d = x.shape[1]
    torch.mul(x[:n], 1.0, out=buf[:n, :d])
    torch.mul(x[:n], 2.0, out=buf[:n, d:])
    cache[:n].copy_(x[:n])
    return finish_output(out, buf, n)


def test_cached_op_requires_out_in_mutates_args() -> None:
    with pytest.raises(ValueError, match="must name 'out'"):
        cached_op("backplane_test_contract::no_out", ("cache",), _rows_shape)


def test_cached_op_requires_out_as_last_parameter() -> None:
    decorate = cached_op("backplane_test_contract::out_not_last", ("out",), _rows_shape)

    def op(x: torch.Tensor, out: torch.Tensor | None = None, n: int = 0) -> torch.Tensor:
        return x

    with pytest.raises(ValueError, match="last parameter must be 'out'"):
        decorate(op)


def test_cached_op_rejects_unknown_mutated_argument() -> None:
    decorate = cached_op("backplane_test_contract::unknown", ("kv", "out"), _rows_shape)

    def op(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return x

    with pytest.raises(ValueError, match="unknown argument 'kv'"):
        decorate(op)


@pytest.mark.parametrize("with_out", [False, True])
def test_fake_and_real_agree(with_out: bool) -> None:
    x, cache = torch.randn(5, 3), torch.zeros(5, 3)
    out = torch.empty(5, 6) if with_out else None
    real = widen(x, cache, 3, out=out)
    with FakeTensorMode() as mode:
        fx, fcache = mode.from_tensor(x), mode.from_tensor(cache)
        fout = mode.from_tensor(out) if with_out else None
        fake = widen(fx, fcache, 3, out=fout)
    assert tuple(fake.shape) == tuple(real.shape)
    assert fake.dtype == real.dtype
    assert (real.numel() == 0) == with_out


def test_opcheck_passes_both_forms() -> None:
    x, cache = torch.randn(5, 3), torch.zeros(5, 3)
    for out in (None, torch.empty(5, 6)):
        result = torch.library.opcheck(widen, (x, cache, 3), {"out": out})
        assert all(v == "SUCCESS" for v in result.values()), result


def test_output_buffer_without_out_allocates() -> None:
    buf = output_buffer(None, (4, 2), torch.float16, torch.device("cpu"))
    assert buf.shape == (4, 2) and buf.dtype == torch.float16


def test_output_buffer_returns_the_given_buffer() -> None:
    out = torch.empty(4, 2)
    assert output_buffer(out, (4, 2), torch.float32, torch.device("cpu")) is out


@pytest.mark.parametrize(
    ("out", "fragment"),
    [
        (torch.empty(5, 2), "shape (5, 2)"),
        (torch.empty(4, 2, dtype=torch.float64), "torch.float64"),
        (torch.empty(8), "shape (8,)"),
    ],
)
def test_output_buffer_rejects_mismatches(out: torch.Tensor, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        output_buffer(out, (4, 2), torch.float32, torch.device("cpu"))
    message = str(info.value)
    assert fragment in message and "expected (4, 2), torch.float32" in message


def test_finish_output_zeroes_tail_and_returns_sentinel() -> None:
    out = torch.full((5, 2), float("nan"))
    out[:3] = 1.0
    ret = finish_output(out, out, 3)
    assert ret.numel() == 0
    assert torch.equal(out[3:], torch.zeros(2, 2)) and torch.equal(out[:3], torch.ones(3, 2))


def test_finish_output_without_out_returns_buffer() -> None:
    buf = torch.ones(4, 2)
    assert finish_output(None, buf, 4) is buf
    assert finish_output(None, buf, 2) is buf and buf[2:].abs().sum() == 0


def test_torch_backends_fake_matches_real() -> None:
    """The registered torch attention and MLA ops: fake shapes equal real shapes."""
    from backplane.backends.torch.attention import paged_attention
    from backplane.backends.torch.mla import mla_attention

    case = batch_cases()[3]
    batch = case.metadata("cpu")
    t = case.padded_num_tokens
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    kv = torch.randn(case.num_pages, 2, case.page_size, 2, 8)
    mla_args = (
        torch.randn(t, 2, 8),
        torch.randn(t, 2, 4),
        torch.randn(t, 16),
        torch.randn(t, 4),
        torch.randn(case.num_pages, case.page_size, 20),
        torch.randn(2, 8, 16),
        torch.randn(2, 6, 16),
    )
    with forward_context(batch):
        real_att = paged_attention(q, k, v, kv, 0.3, 0, 1.0, 1.0)
        real_mla = mla_attention(*mla_args, 0.3, 1.0)
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake_att = paged_attention(
                *(mode.from_tensor(a) for a in (q, k, v, kv)), 0.3, 0, 1.0, 1.0
            )
            fake_mla = mla_attention(*(mode.from_tensor(a) for a in mla_args), 0.3, 1.0)
    assert fake_att.shape == real_att.shape == (t, 4, 8)
    assert fake_mla.shape == real_mla.shape == (t, 2, 6)
