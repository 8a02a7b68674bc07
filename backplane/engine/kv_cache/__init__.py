"""Paged KV cache: page pool, prefix reuse, host tier, state slots, state snapshots and
admission."""

from backplane.engine.kv_cache.block_pool import BlockPool
from backplane.engine.kv_cache.host_tier import HostTier
from backplane.engine.kv_cache.manager import Claim, KVCacheManager, KVCacheStats, RequestKV
from backplane.engine.kv_cache.prefix_cache import PrefixCache, hash_pages
from backplane.engine.kv_cache.state_cache import StateSnapshots
from backplane.engine.kv_cache.state_slots import StateSlotPool

__all__ = [
    "BlockPool",
    "Claim",
    "HostTier",
    "KVCacheManager",
    "KVCacheStats",
    "PrefixCache",
    "RequestKV",
    "StateSlotPool",
    "StateSnapshots",
    "hash_pages",
]
