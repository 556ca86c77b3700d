from flashpage.kv.block_manager import BlockManager, CopyOp, slot
from flashpage.kv.cache import KVCache, allocate_kv_caches, kv_bytes_per_block

__all__ = ["BlockManager", "CopyOp", "KVCache", "allocate_kv_caches", "kv_bytes_per_block", "slot"]
