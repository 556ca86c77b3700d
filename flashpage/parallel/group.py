"""TensorParallel: this process's rank in a tensor-parallel group, and the collectives the model and runner call.

Sharding follows Megatron-LM (and gpt-fast): Q/K/V and gate/up are cut by output rows, o_proj and down_proj by
input columns (each followed by one all-reduce), the embedding and LM head by vocabulary rows. Every collective is
torch.distributed's: NCCL on CUDA, gloo on CPU. Host objects (each step's plan) go over a gloo group of their own,
so on CUDA they never wait behind the device's collectives. The default TensorParallel() is a single rank; its
collectives do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # device tensors: NCCL on CUDA, gloo on CPU
    cpu_group: dist.ProcessGroup | None = None  # host objects: gloo

    def shard(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's share of n rows cut evenly; n must divide by the size."""
        return self.rank * n // self.size, n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension (rank order), on every rank."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place (a device tensor of a shape every rank knows)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def broadcast_object(self, obj=None):
        """Rank 0's picklable obj on every rank (the others pass nothing)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank is here (over the host group)."""
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    def min(self, n: int) -> int:
        """The smallest n over the ranks."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes: query heads [q_start, q_start + num_heads) and KV heads
    [kv_start, kv_start + num_kv_heads) of the checkpoint's."""
    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """ValueError unless `size` ranks can share the heads: the query heads split evenly, and the KV heads either
    split evenly or each is replicated over a whole number of ranks (as MQA's one KV head over every rank)."""
    if num_heads % size or (num_kv_heads % size and size % num_kv_heads):
        raise ValueError(f"tensor_parallel_size={size} cannot split this model's attention heads ({num_heads} query, "
                         f"{num_kv_heads} key/value): it must divide {num_heads}, and divide {num_kv_heads} or be "
                         f"a multiple of it")


def head_shard(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadShard:
    check_heads(num_heads, num_kv_heads, tp.size)
    q_start, q_count = tp.shard(num_heads)
    if num_kv_heads >= tp.size:
        kv_start, kv_count = tp.shard(num_kv_heads)
    else:  # each KV head replicated on size // num_kv_heads consecutive ranks: the ones holding its query heads
        kv_start, kv_count = tp.rank * num_kv_heads // tp.size, 1
    return HeadShard(q_start, q_count, kv_start, kv_count)
