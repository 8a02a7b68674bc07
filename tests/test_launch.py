"""The cached Triton launcher (``backplane.core.launch``): keys, constant order, the key check."""

from __future__ import annotations

import pytest
import torch

from backplane.core import launch

triton = pytest.importorskip("triton", reason="triton is not installed")
tl = pytest.importorskip("triton.language")


@triton.jit
def _scaled_copy(
    src_ptr, dst_ptr, n, scale, SHIFT: tl.constexpr, BLOCK: tl.constexpr, NEG: tl.constexpr = False
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(src_ptr + offs, mask=ok, other=0.0) * scale + SHIFT
    if NEG:
        x = -x
    tl.store(dst_ptr + offs, x, mask=ok)


def test_int_key_follows_triton_specialisation():
    """1, multiples of 16 and values beyond 32 bits each get their own class."""
    assert launch.int_key(1) == 1
    assert launch.int_key(0) == launch.int_key(32) == 2
    assert launch.int_key(3) == launch.int_key(17) == launch.int_key(-5) == 0
    assert launch.int_key(2**31) == 4 | 2
    assert launch.int_key(2**31 + 1) == 4
    assert launch.int_key(-(2**31) - 1) == 4
    assert launch.int_key(2**31 - 1) == 0
    assert launch.int_key(2**63) == 8 | 4 | 2  # unsigned 64-bit
    assert launch.int_key(2**40 + 1) == 4  # signed 64-bit


def test_arg_key_entries():
    """Tensors give dtype and alignment, ints their class, other values their type."""
    base = torch.zeros(64, dtype=torch.float32)
    key = launch.arg_key((base, base[1:], 16, 1, 2.5, None, True))
    assert key[0] == (torch.float32, True)
    assert key[1] == (torch.float32, False)  # 4 bytes past an aligned start
    assert key[2:] == (2, 1, float, type(None), bool)


def test_constants_follow_signature_order_with_defaults():
    """The constants a launch passes after its arguments are in parameter order, defaults filled."""
    launcher = launch.KernelLauncher(_scaled_copy)
    assert launcher._tail(4, {"BLOCK": 64, "SHIFT": 3, "num_warps": 2}) == (3, 64, False)
    assert launcher._tail(4, {"NEG": True, "BLOCK": 8, "SHIFT": 0}) == (0, 8, True)
    with pytest.raises(TypeError, match="BLOCK"):
        launcher._tail(4, {"SHIFT": 1})


def _run(launcher, key, src, dst, n, scale, shift, neg=False):
    grid = (launch.cdiv(n, 32),)
    launcher(key, grid, (src, dst, n, scale), src.device.index, SHIFT=shift, BLOCK=32, NEG=neg)


@pytest.mark.gpu
def test_fast_launches_match_reference(monkeypatch):
    """Cached launches compute what the kernel computes, across keys, every element checked."""
    monkeypatch.setattr(launch, "CHECK", False)
    launcher = launch.KernelLauncher(_scaled_copy)
    src = torch.randn(1000, device="cuda", dtype=torch.float32)
    for n, shift, neg in [(1000, 1, False), (1000, 1, False), (333, -2, True), (1000, 1, False)]:
        dst = torch.full_like(src, float("nan"))
        key = (launch.arg_key((src, dst, n, 0.5)), shift, neg)
        _run(launcher, key, src, dst, n, 0.5, shift, neg)
        want = (src[:n].double() * 0.5 + shift) * (-1 if neg else 1)
        torch.testing.assert_close(dst[:n].double(), want, rtol=1e-6, atol=1e-6)
        assert dst[n:].isnan().all()
    assert len(launcher._cache) == 2


@pytest.mark.gpu
def test_check_catches_a_key_that_misses_a_specialisation(monkeypatch):
    """A key blind to ``n == 1`` (which Triton compiles as a constant) is caught when checking."""
    monkeypatch.setattr(launch, "CHECK", True)
    launcher = launch.KernelLauncher(_scaled_copy)
    src = torch.randn(64, device="cuda")
    dst = torch.empty_like(src)
    _run(launcher, "same", src, dst, 64, 1.0, 0)
    _run(launcher, "same", src, dst, 64, 1.0, 0)
    with pytest.raises(launch.LaunchKeyError, match="same"):
        _run(launcher, "same", src, dst, 1, 1.0, 0)
    # an unaligned view compiles differently too; arg_key tells it apart
    _run(launcher, launch.arg_key((src[1:], dst, 63, 1.0)), src[1:], dst, 63, 1.0, 0)
    torch.testing.assert_close(dst[:63], src[1:])


def test_lookup_is_empty_while_checking(monkeypatch):
    """With the key check on every launch goes through Triton: ``lookup`` hands out nothing."""
    monkeypatch.setattr(launch, "CHECK", True)
    launcher = launch.KernelLauncher(_scaled_copy)
    launcher._cache[(0, "k")] = object()
    assert launcher.lookup("k", 0) is None


@pytest.mark.gpu
def test_lookup_launches_what_the_call_compiled(monkeypatch):
    """After a key's first launch, ``lookup(key).launch`` runs that kernel with its constants."""
    monkeypatch.setattr(launch, "CHECK", False)
    launcher = launch.KernelLauncher(_scaled_copy)
    src = torch.randn(500, device="cuda", dtype=torch.float32)
    dst = torch.full_like(src, float("nan"))
    key = ("copy", 3, True)
    assert launcher.lookup(key, 0) is None
    _run(launcher, key, src, dst, 500, 2.0, 3, neg=True)
    hit = launcher.lookup(key, src.device.index)
    assert hit is not None and launcher.lookup(("other",), src.device.index) is None
    dst.fill_(float("nan"))
    hit.launch(launch.cdiv(450, 32), 1, 1, src.device.index, src, dst, 450, 0.5)
    want = -(src[:450].double() * 0.5 + 3)
    torch.testing.assert_close(dst[:450].double(), want, rtol=1e-6, atol=1e-6)
    assert dst[450:].isnan().all()
