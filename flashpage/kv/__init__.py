from flashpage.kv.block_manager import PENDING, BlockManager, CopyOp

__all__ = ["PENDING", "BlockManager", "CopyOp"]
