from flashpage.kv.block_manager import BlockManager, CopyOp

__all__ = ["BlockManager", "CopyOp"]
