"""ModelRunner: owns the model, the paged KV cache and the CUDA graphs; runs one SchedulerOutput as one forward
pass, samples it, and starts copying the sampled tokens back.

Nothing here waits for the GPU except `SampledTokens.wait()`, the one read-back per step. A step's inputs are
built on the host and uploaded in one asynchronous copy. A token the previous step is still sampling (PENDING)
is read on the device from that step's output, so the host can prepare step N+1 while the GPU runs step N.
Decode steps (one new token per sequence) replay a CUDA graph captured for the next batch size up the ladder;
prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from flashpage.engine.sampler import SampleRow, sample_rows, upload
from flashpage.engine.scheduler import SchedulerOutput
from flashpage.kv import PENDING
from flashpage.loader import LoadedModel
from flashpage.model import AttentionMetadata

log = logging.getLogger("flashpage.runner")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes captured: 1, 2, 4, 8, then every 16 up to max_num_seqs (rounded up)."""
    ladder = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return [b for b in ladder if b < max_num_seqs] + [next(b for b in ladder if b >= max_num_seqs)]


@dataclass
class SampledTokens:
    """One step's sampled tokens, on their way to the host."""
    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    done: torch.cuda.Event | None

    def wait(self) -> tuple[list[int], list[float], list | None, list | None]:
        if self.done is not None:
            self.done.synchronize()
        tops = (self.top_ids.tolist(), self.top_logprobs.tolist()) if self.top_ids is not None else (None, None)
        return self.tokens.tolist(), self.logprobs.tolist(), *tops


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kernels: str, max_num_seqs: int,
                 max_model_len: int, enforce_eager: bool = False):
        self.model = loaded.model
        self.config = cfg = loaded.config
        self.model.set_kernels(kernels)
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(torch.empty(shape, dtype=self.dtype, device=self.device),
                           torch.empty(shape, dtype=self.dtype, device=self.device))
                          for _ in range(cfg.num_hidden_layers)]
        self.last_tokens: torch.Tensor | None = None  # the previous step's sampled tokens, on the device
        self.last_rows: dict[int, int] = {}  # seq_id -> its row in last_tokens
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # batch size -> (graph, logits)
        if self.device.type == "cuda" and not enforce_eager:
            self._capture_graphs(graph_batch_sizes(max_num_seqs), -(-max_model_len // block_size))

    @staticmethod
    def kv_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
        cfg = loaded.config
        itemsize = next(loaded.model.parameters()).element_size()
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize

    # ----- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Returns logits [sampled seqs, vocab] (in batch order) and {seq_id: prompt logits} where asked."""
        dev, bs = self.device, self.block_size
        if batch.copies:
            src = upload([c.src for c in batch.copies], torch.int64, dev)
            dst = upload([c.dst for c in batch.copies], torch.int64, dev)
            for k_cache, v_cache in self.kv_caches:
                k_cache[dst] = k_cache[src]
                v_cache[dst] = v_cache[src]
        seqs = batch.seqs
        decode = all(len(s.token_ids) == 1 and s.sample and not s.prompt_logits for s in seqs)
        graph_size = next((b for b in self.graphs if b >= len(seqs)), None) if decode else None
        rows = graph_size or len(seqs)
        tokens, positions, slots, cu, seq_lens, pending = [], [], [], [0], [], []
        for s in seqs:
            if s.token_ids[-1] == PENDING:  # only ever the last token of a decode
                pending += [len(tokens) + len(s.token_ids) - 1, self.last_rows[s.seq_id]]
            pos = range(s.start, s.start + len(s.token_ids))
            tokens += s.token_ids
            positions += pos
            slots += [s.block_table[p // bs] * bs + p % bs for p in pos]
            cu.append(cu[-1] + len(s.token_ids))
            seq_lens.append(s.start + len(s.token_ids))
        padding = rows - len(seqs)  # graph rows beyond the batch: no keys, no cache writes
        tokens += [0] * padding
        positions += [0] * padding
        slots += [-1] * padding
        seq_lens += [0] * padding
        cu += range(cu[-1] + 1, cu[-1] + 1 + padding)
        width = max(len(s.block_table) for s in seqs)
        table = [b for s in seqs for b in s.block_table + [0] * (width - len(s.block_table))] + [0] * (padding * width)
        n = len(tokens)
        packed = upload(tokens + positions + slots + seq_lens + cu + table + pending, torch.int64, dev)
        ids, positions_t, slots_t, lens_t, cu_t, table_t, pending_t = packed.split(
            [n, n, n, rows, rows + 1, rows * width, len(pending)])
        if pending:
            ids[pending_t[0::2]] = self.last_tokens[pending_t[1::2]]
        lens_t, cu_t, table_t = lens_t.int(), cu_t.int(), table_t.int().view(rows, width)
        if graph_size:
            graph, logits = self.graphs[graph_size]
            st = self.static
            st["ids"][:rows].copy_(ids)
            st["positions"][:rows].copy_(positions_t)
            st["slots"][:rows].copy_(slots_t)
            st["seq_lens"][:rows].copy_(lens_t)
            st["block_table"][:rows, :width].copy_(table_t)
            graph.replay()
            return logits[:len(seqs)], {}
        meta = AttentionMetadata(cu_t, lens_t, max(len(s.token_ids) for s in seqs), slots_t, table_t)
        hidden = self.model(ids, positions_t, meta, self.kv_caches)
        last = [cu[i + 1] - 1 for i, s in enumerate(seqs) if s.sample]
        # Rows picked by an uploaded index: a Python list as the index would be copied from pageable memory, which
        # makes the host wait for the whole forward pass and leaves the GPU idle while it prepares the next step.
        logits = self.model.compute_logits(hidden.index_select(0, upload(last, torch.int64, dev)) if len(last) < n
                                           else hidden)
        prompt_logits = {s.seq_id: self.model.compute_logits(hidden[cu[i]:cu[i + 1]])
                         for i, s in enumerate(seqs) if s.prompt_logits}
        return logits, prompt_logits

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SampleRow], stop_ids: list[list[int]],
               seq_ids: list[int]) -> SampledTokens:
        """Sample every row (row i is sequence seq_ids[i]) and start copying the results to the host. The
        next step reads these tokens on the device for sequences it schedules with a PENDING token."""
        out = sample_rows(self.model.ops, logits, rows, stop_ids)
        self.last_tokens = out.tokens
        self.last_rows = {seq_id: i for i, seq_id in enumerate(seq_ids)}
        cuda = self.device.type == "cuda"

        def to_host(t):
            if t is None or not cuda:
                return None if t is None else t.cpu()
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        result = SampledTokens(to_host(out.tokens), to_host(out.logprobs), to_host(out.top_ids),
                               to_host(out.top_logprobs), torch.cuda.Event() if cuda else None)
        if cuda:
            result.done.record()
        return result

    # ----- CUDA graphs ----------------------------------------------------------------------------
    def _capture_graphs(self, sizes: list[int], max_blocks_per_seq: int) -> None:
        start, dev, top = time.perf_counter(), self.device, max(sizes)
        self.static = st = {
            "ids": torch.zeros(top, dtype=torch.int64, device=dev),
            "positions": torch.zeros(top, dtype=torch.int64, device=dev),
            "slots": torch.full((top,), -1, dtype=torch.int64, device=dev),
            "seq_lens": torch.ones(top, dtype=torch.int32, device=dev),
            "block_table": torch.zeros(top, max_blocks_per_seq, dtype=torch.int32, device=dev),
            "cu": torch.arange(top + 1, dtype=torch.int32, device=dev),
        }
        pool = None
        with torch.inference_mode():
            for size in tqdm(sorted(sizes, reverse=True), desc="Capturing CUDA graphs", leave=False):
                meta = AttentionMetadata(st["cu"][:size + 1], st["seq_lens"][:size], 1, st["slots"][:size],
                                         st["block_table"][:size])
                run = lambda: self.model.compute_logits(  # noqa: E731
                    self.model(st["ids"][:size], st["positions"][:size], meta, self.kv_caches))
                run()  # compiles the Triton kernels for this shape outside the capture
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = run()
                pool = graph.pool()
                self.graphs[size] = (graph, logits)
        self.graphs = dict(sorted(self.graphs.items()))
        log.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1f s", len(sizes), min(sizes), top,
                 time.perf_counter() - start)
