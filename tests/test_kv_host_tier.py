"""Host tier: page contents survive device -> host -> device, for every cache tensor."""

from __future__ import annotations

import pytest
import torch

from backplane.engine.kv_cache import HostTier
from backplane.engine.kv_cache.host_tier import _runs


def _caches(device: str, num_pages: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn((num_pages, 2, 4, 2, 8), generator=g).to(device=device, dtype=torch.bfloat16)
    mla = torch.randn((num_pages, 4, 12), generator=g).to(device)
    return [kv, mla]


def _round_trip(device: str) -> None:
    caches = _caches(device)
    orig = [c.clone() for c in caches]
    tier = HostTier(caches, 4)
    # pages 2,3 (a run) and 7 go to host; hashes are arbitrary ids
    assert tier.offload([2, 3, 7], [102, 103, 107]) == 3
    assert tier.offload([2], [102]) == 0, "already on host: no second copy"
    for c in caches:  # the device pages get new owners who overwrite them
        c[[2, 3, 7]] = 0
    hp = [tier.get(h) for h in (102, 103, 107)]
    assert None not in hp
    tier.onboard(hp, [5, 6, 1])
    tier.wait()
    tier.synchronize()
    for c, o in zip(caches, orig, strict=True):
        torch.testing.assert_close(c[[5, 6, 1]], o[[2, 3, 7]], rtol=0, atol=0)
        torch.testing.assert_close(c[[0, 4, 8, 9]], o[[0, 4, 8, 9]], rtol=0, atol=0)
    tier.check_invariants()


def test_round_trip_cpu():
    _round_trip("cpu")


@pytest.mark.gpu
def test_round_trip_cuda():
    _round_trip("cuda")


def test_full_host_evicts_lru_but_never_claimed_pages():
    caches = _caches("cpu")
    tier = HostTier(caches, 2)
    tier.offload([1, 2], [11, 12])
    tier.claim(tier.get(11))
    tier.offload([3], [13])  # evicts 12 (11 is claimed)
    assert tier.get(12) is None and tier.get(11) is not None and tier.get(13) is not None
    tier.claim(tier.get(13))
    assert tier.offload([4], [14]) == 0 and tier.num_dropped == 1, "everything claimed: drop"
    tier.unclaim(tier.get(11))
    tier.offload([4], [14])
    assert tier.get(11) is None and tier.get(14) is not None
    torch.testing.assert_close(tier.host_caches[1][tier.get(13)], caches[1][3], rtol=0, atol=0)
    tier.check_invariants()


def test_sizing_from_bytes_and_errors():
    caches = _caches("cpu")
    per = HostTier.bytes_per_page(caches)
    assert per == 2 * 4 * 2 * 8 * 2 + 4 * 12 * 4
    assert HostTier.from_bytes(caches, per * 3 + 5).num_pages == 3
    with pytest.raises(ValueError, match="host_kv_memory"):
        HostTier.from_bytes(caches, per - 1)
    with pytest.raises(ValueError, match="disagree"):
        HostTier([caches[0], caches[1][:5]], 2)


def test_runs_coalesce_consecutive_pairs():
    import numpy as np

    assert _runs(np.array([1, 2, 3, 7, 8]), np.array([4, 5, 6, 0, 2])) == [
        (1, 4, 3),
        (7, 0, 1),
        (8, 2, 1),
    ]


def test_offload_larger_than_host_never_reuses_a_page_twice():
    caches = _caches("cpu")
    orig = caches[1].clone()
    tier = HostTier(caches, 2)
    assert tier.offload([1, 2, 3, 4], [11, 12, 13, 14]) == 2
    assert tier.num_dropped == 2 and tier.get(11) is not None and tier.get(12) is not None
    torch.testing.assert_close(tier.host_caches[1][tier.get(12)], orig[2], rtol=0, atol=0)
    tier.check_invariants()


def test_round_trip_non_contiguous_cache_uses_index_copies():
    base = torch.randn(6, 4, 2, 3)
    cache = base.transpose(1, 2)  # dim 0 is still the page, but not contiguous
    orig = cache.clone()
    tier = HostTier([cache], 3)
    assert tier._np_views is None
    tier.offload([1, 4], [21, 24])
    cache[[1, 4]] = 0
    tier.onboard([tier.get(21), tier.get(24)], [2, 5])
    torch.testing.assert_close(cache[[2, 5]], orig[[1, 4]], rtol=0, atol=0)
    torch.testing.assert_close(cache[[0, 3]], orig[[0, 3]], rtol=0, atol=0)
