from flashpage.kv.block_manager import BlockManager, CopyOp, slot
from flashpage.kv.cache import KV_CACHE_DTYPES, KVCache, allocate_kv_caches, kv_bytes_per_block

__all__ = ["BlockManager", "CopyOp", "KV_CACHE_DTYPES", "KVCache", "allocate_kv_caches", "kv_bytes_per_block", "slot"]
