"""ModelRunner: owns the model and the paged KV cache; runs one SchedulerOutput as one forward pass."""

from __future__ import annotations

import torch

from flashpage.engine.scheduler import SchedulerOutput
from flashpage.loader import LoadedModel
from flashpage.model import AttentionBackend, AttentionMetadata


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, attention_backend: str):
        self.model = loaded.model
        self.config = cfg = loaded.config
        self.model.set_attention_backend(AttentionBackend(attention_backend))
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(torch.empty(shape, dtype=self.dtype, device=self.device),
                           torch.empty(shape, dtype=self.dtype, device=self.device))
                          for _ in range(cfg.num_hidden_layers)]

    @staticmethod
    def kv_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
        cfg = loaded.config
        itemsize = next(loaded.model.parameters()).element_size()
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Returns logits [sampled seqs, vocab] (in batch order) and {seq_id: prompt logits} where asked."""
        dev, bs = self.device, self.block_size
        if batch.copies:
            src = torch.tensor([c.src for c in batch.copies], device=dev)
            dst = torch.tensor([c.dst for c in batch.copies], device=dev)
            for k_cache, v_cache in self.kv_caches:
                k_cache[dst] = k_cache[src]
                v_cache[dst] = v_cache[src]
        tokens, positions, slots, cu, seq_lens = [], [], [], [0], []
        for s in batch.seqs:
            pos = range(s.start, s.start + len(s.token_ids))
            tokens += s.token_ids
            positions += pos
            slots += [s.block_table[p // bs] * bs + p % bs for p in pos]
            cu.append(cu[-1] + len(s.token_ids))
            seq_lens.append(s.start + len(s.token_ids))
        width = max(len(s.block_table) for s in batch.seqs)
        table = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens_k=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_seqlen_q=max(len(s.token_ids) for s in batch.seqs),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
        )
        hidden = self.model(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev), meta, self.kv_caches)
        last = [cu[i + 1] - 1 for i, s in enumerate(batch.seqs) if s.sample]
        logits = self.model.compute_logits(hidden[last])
        prompt_logits = {s.seq_id: self.model.compute_logits(hidden[cu[i]:cu[i + 1]])
                         for i, s in enumerate(batch.seqs) if s.prompt_logits}
        return logits, prompt_logits
