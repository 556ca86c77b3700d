"""ModelRunner: one request at a time, its KV cache in blocks of its own (the paged engine replaces this loop)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from flashpage.engine.sampler import sample
from flashpage.loader import LoadedModel
from flashpage.model import AttentionBackend, AttentionMetadata
from flashpage.sampling_params import SamplingParams


BLOCK_SIZE = 16


class ModelRunner:
    def __init__(self, loaded: LoadedModel, max_model_len: int, attention_backend: str):
        self.model = loaded.model
        self.model.set_attention_backend(AttentionBackend(attention_backend))
        self.config = loaded.config
        self.max_model_len = max_model_len
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator) -> Iterator[int]:
        """Yield generated token ids until the caller stops iterating or the context is full."""
        cfg, dev = self.config, self.device
        capacity = self.max_model_len if params.max_tokens is None else min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        num_blocks = -(-capacity // BLOCK_SIZE)
        shape = (num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        kv_caches = [(torch.empty(shape, dtype=self.dtype, device=dev), torch.empty(shape, dtype=self.dtype, device=dev))
                     for _ in range(cfg.num_hidden_layers)]
        block_table = torch.arange(num_blocks, dtype=torch.int32, device=dev)[None, :]
        stop_ids = torch.tensor(sorted(set(cfg.eos_token_ids) | set(params.stop_token_ids)), dtype=torch.long, device=dev)

        tokens = torch.tensor(prompt_ids, dtype=torch.long, device=dev)
        start, generated = 0, 0
        while True:
            n = tokens.numel()
            meta = AttentionMetadata(
                cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
                seq_lens_k=torch.tensor([start + n], dtype=torch.int32, device=dev),
                max_seqlen_q=n,
                slot_mapping=torch.arange(start, start + n, device=dev),
                block_table=block_table,
            )
            positions = torch.arange(start, start + n, device=dev)
            hidden = self.model(tokens, positions, meta, kv_caches)
            logits = self.model.compute_logits(hidden[-1:])
            if generated < params.min_tokens and not params.ignore_eos:
                logits[:, stop_ids] = float("-inf")
            token = int(sample(logits, [params], [generator])[0])
            yield token
            generated += 1
            start += n  # tokens in the cache; the sequence is one longer (the token just sampled)
            if start + 1 >= capacity:
                return
            tokens = torch.tensor([token], dtype=torch.long, device=dev)
