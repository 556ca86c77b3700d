"""ModelRunner: loads the model, owns the paged KV cache and the CUDA graphs, and runs one StepPlan in one call:
block copies, inputs, forward pass, logits, prompt log-probs, sampling, and the start of the read-back.

Under tensor parallelism every rank has a runner over its shard and KV heads: the driver's `step` broadcasts the
plan, each rank runs `forward` (the collectives are inside the model), and the driver alone samples.

Nothing here waits for the GPU except `StepFuture.result()`, the one read-back per step. A token the previous
step is still sampling is read on the device from that step's sampled tokens (the plan names the row), so the
host can prepare step N+1 while the GPU runs step N. Decode steps (one new token per sequence) replay a CUDA
graph captured for the next batch size up the ladder, and so do verify steps of speculative decoding (each
sequence's last token and its proposals, chains or token trees, padded to the longest proposal + 1); prefill and
mixed steps run eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flashpage.engine.config import EngineConfig
from flashpage.engine.inputs import prepare_inputs, upload
from flashpage.engine.sampler import sample_rows
from flashpage.engine.sparse import CALIBRATION_TOKENS, calibration_ids, principal_value_axes, sparq_turns
from flashpage.engine.spec import target_feature_layers
from flashpage.engine.step import SampledToken, SampleRow, SampleSpec, SeqStep, StepPlan, StepResult
from flashpage.kernels.device import interpreting
from flashpage.kernels.fp8 import check_fp8_support
from flashpage.kv import KV_CACHE_DTYPES, allocate_kv_caches, kv_bytes_per_block
from flashpage.loader import LoadedModel, load_model
from flashpage.model import AttentionMetadata
from flashpage.parallel.group import TensorParallel
from flashpage.sampling_params import SamplingParams

log = logging.getLogger("flashpage.runner")


def default_cpu_threads() -> int:
    """OMP_NUM_THREADS if set; else the physical cores among the CPUs this process may run on (a second hardware
    thread of a core adds nothing to matrix products, and threads beyond the process's CPUs make every one wait)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            cores.add(cpu)
    return max(1, len(cores))


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes captured: 1, 2, 4, 8, then every 16 up to max_num_seqs (rounded up)."""
    ladder = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return [b for b in ladder if b < max_num_seqs] + [next(b for b in ladder if b >= max_num_seqs)]


class StepFuture:
    """One step's results on their way to the host; `result()` waits for them."""

    def __init__(self, samples: list[SampleSpec], sampled, prompt: dict[int, tuple], cuda: bool,
                 hidden: torch.Tensor | None, sample_rows: list[int], logits: torch.Tensor):
        def to_host(t):
            if t is None or not cuda:
                return t
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        self.samples, self.hidden, self.sample_rows, self.logits = samples, hidden, sample_rows, logits
        self.tensors = [to_host(t) for t in (sampled.tokens, sampled.logprobs, sampled.ranks, sampled.top_ids,
                                             sampled.top_logprobs)]
        self.prompt = {seq_id: (targets, *(to_host(t) for t in tensors)) for seq_id, (targets, *tensors) in prompt.items()}
        self.done = torch.cuda.Event() if cuda else None
        if cuda:
            self.done.record()

    def result(self) -> StepResult:
        if self.done is not None:
            self.done.synchronize()
        tokens, logprobs, ranks, top_ids, top_lps = (t.tolist() if t is not None else None for t in self.tensors)
        out = StepResult(hidden=self.hidden, sample_rows=self.sample_rows, logits=self.logits)
        for i, spec in enumerate(self.samples):
            k = spec.row.params.logprobs
            if k is None:
                out.sampled.append(SampledToken(spec.seq_id, tokens[i], logprobs[i]))
            else:
                k = len(top_ids[i]) if k == -1 else k
                top = dict(zip(top_ids[i][:k], top_lps[i][:k])) if k else {}
                out.sampled.append(SampledToken(spec.seq_id, tokens[i], logprobs[i], ranks[i], top))
        for seq_id, (targets, chosen, rank, ids, values) in self.prompt.items():
            chosen, rank = chosen.tolist(), rank.tolist()
            tops = (dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())) if ids is not None else ({} for _ in targets)
            out.prompt_logprobs[seq_id] = [SampledToken(seq_id, t, c, r, top)
                                           for t, c, r, top in zip(targets, chosen, rank, tops)]
        return out


def resolve_device(device: str) -> str:
    return device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"


class ModelRunner:
    def __init__(self, cfg: EngineConfig, loaded: LoadedModel | None = None, reserve_per_block: int = 0,
                 tp: TensorParallel | None = None):
        """Loads `cfg.model` (or serves `loaded`, a model already in memory: tests share one between engines) and
        allocates the KV cache, leaving `reserve_per_block` bytes per block it makes for a draft model's cache.
        `self.cfg` is `cfg` with device, kernels and max_model_len resolved. `tp`: this rank's place in a
        tensor-parallel group (default: one rank)."""
        self.tp = tp = tp or TensorParallel()
        device = resolve_device(cfg.device)
        # Triton kernels on the GPU; on CPU the interpreter would be far too slow
        kernels = cfg.kernels if cfg.kernels != "auto" else "triton" if device.startswith("cuda") else "cpu"
        if cfg.deterministic:
            if cfg.kernels not in ("auto", "batch_invariant"):
                raise ValueError(f"deterministic=True runs the batch-invariant kernels, not kernels={cfg.kernels!r}")
            if device == "cpu" and not interpreting():
                raise ValueError("deterministic=True needs a CUDA device: its kernels are Triton's (on CPU they run "
                                 "only in Triton's interpreter, TRITON_INTERPRET=1, far too slowly but for tests)")
            kernels = "batch_invariant"
        if device == "cpu":
            torch.set_num_threads(cfg.cpu_threads or default_cpu_threads())
        if loaded is None:
            loaded = load_model(cfg.model, load_format=cfg.load_format, dtype=cfg.dtype, device=device, seed=cfg.seed,
                                revision=cfg.revision, gguf_file=cfg.gguf_file, tp=tp, quantization=cfg.quantization)
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        limit = self.config.max_position_embeddings
        if cfg.max_model_len is not None and not 1 < cfg.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}] for this model, got {cfg.max_model_len}")
        self.cfg = dataclasses.replace(cfg, device=device, kernels=kernels, max_model_len=cfg.max_model_len or limit)
        self.model.set_kernels(kernels)
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = cfg.block_size
        self.sparse = cfg.sparse
        if self.sparse is not None:
            self.sparse.check_serves(head_dim=self.config.head_dim, kernels=kernels, kv_cache_dtype=cfg.kv_cache_dtype,
                                     speculative=cfg.speculative is not None, block_size=cfg.block_size,
                                     sliding_window=self.config.sliding_window)
        self.sparq_cache = self.sparse is not None and self.sparse.method == "sparq"  # (its key copy and value sums)
        # its copies' layout: value axes, and the bits of the key copy
        self.sparq_layout = dict(sparq=self.sparq_cache, value_axes=self.sparse.value_axes if self.sparq_cache else 0,
                                 key_bits=self.sparse.key_bits if self.sparq_cache else 8)
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads  # this rank's
        self.kv_dtype = KV_CACHE_DTYPES.get(cfg.kv_cache_dtype, self.dtype)
        if cfg.kv_cache_dtype == "fp8":
            check_fp8_support(self.device, "kv_cache_dtype 'fp8'")
        # A proposer that drafts from the target's own features (Medusa, EAGLE) reads the residual streams at the
        # input of these layers (the layer count: the last layer's output) at every token a step computed
        # (StepResult.hidden); graphs are captured with them.
        self.feature_layers = target_feature_layers(cfg.speculative, self.config.num_hidden_layers)
        # (batch size, tokens per sequence) -> (graph, its features or None, logits); captured after the cache
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor | None, torch.Tensor]] = {}
        spec = cfg.speculative
        # a verify graph's tokens per sequence: its last token and the longest proposal; one that serves token trees
        # reads a query mask (kernels/tree.py) for every row
        self.verify_len = spec.max_proposal + 1 if spec else 0
        self.verify_masked = spec is not None and spec.proposes_trees
        self.num_blocks = tp.min(cfg.num_gpu_blocks or self._blocks_that_fit(reserve_per_block))  # same on every rank
        if self.num_blocks < 1:
            raise ValueError("no memory left for the KV cache; lower the model size or raise the memory settings")
        c = self.config
        self.kv_caches = allocate_kv_caches(c.num_hidden_layers, self.num_blocks, self.block_size,
                                            self.num_kv_heads, c.head_dim, self.kv_dtype, self.device,
                                            **self.sparq_layout)
        if self.kv_dtype == torch.float8_e4m3fn:  # the checkpoint's per-head scales, where it has them
            for cache, layer in zip(self.kv_caches, self.model.layers):
                for kind, scale in layer.self_attn.kv_cache_scales.items():
                    (cache.k_scale if kind == "k" else cache.v_scale).copy_(scale)
                    if kind == "k":  # calibrated on the keys as they are: store them so
                        cache.keys_rotated = False
        if self.sparq_cache and (self.sparse.basis == "pca" or self.sparse.value_axes):
            self._calibrate_sparq_bases()
        self.last_sampled: torch.Tensor | None = None  # the last step's sampled tokens, on the device
        self.last_logits: torch.Tensor | None = None  # the rows they were drawn from, after masks and penalties
        # (valid until the next step: a CUDA graph overwrites them)
        if self.device.type == "cuda" and not cfg.enforce_eager:
            sizes = graph_batch_sizes(cfg.max_num_seqs)
            # verify steps only run at batch sizes where speculation is on
            verify_sizes = [b for b in sizes if b <= (spec.disable_by_batch_size or b)] if spec else []
            self._capture_graphs(sizes, verify_sizes, -(-self.cfg.max_model_len // self.block_size))

    def release_graphs(self, wait: bool = True) -> None:
        """Drop the CUDA graphs once no step will run (`wait`: after the device's work is done). A tensor-parallel
        rank does this before it leaves the process group: the graphs hold the group's collectives, and NCCL's
        teardown under them hung (a pair of H100s, and of H200s)."""
        self.graphs.clear()
        if wait and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _calibrate_sparq_bases(self) -> None:
        """Each layer's SparQ turns (`engine.sparse.sparq_turns`) from the keys of CALIBRATION_TOKENS tokens of real
        text, prefilled densely into a cache of their own (so the bases depend on no engine setting), and with
        value axes, its values' principal axes (`principal_value_axes`) from their values."""
        start = time.perf_counter()
        c, bs = self.config, self.block_size
        ids = calibration_ids(self.tokenizer, c.vocab_size, min(CALIBRATION_TOKENS, self.cfg.max_model_len))
        blocks = -(-len(ids) // bs)
        caches = allocate_kv_caches(c.num_hidden_layers, blocks, bs, self.num_kv_heads, c.head_dim, self.dtype,
                                    self.device)
        plan = StepPlan()
        plan.add(SeqStep(0, ids, list(range(len(ids))), list(range(blocks)), num_logits=1))
        inputs = prepare_inputs(plan, bs, self.device)
        self.model(inputs.ids, inputs.meta, caches)
        for cache, calibration in zip(self.kv_caches, caches):
            if self.sparse.basis == "pca":
                turns = sparq_turns(calibration.k.flatten(0, 1)[:len(ids)])
                cache.sparq_basis, cache.sparq_query_basis = (t.to(self.dtype) for t in turns)
            if self.sparse.value_axes:
                cache.sparq_value_axes, cache.sparq_value_rms = principal_value_axes(
                    calibration.v.flatten(0, 1)[:len(ids)], self.sparse.value_axes)
        log.info("SparQ bases from %d tokens of calibration text in %.2f s", len(ids), time.perf_counter() - start)

    def _blocks_that_fit(self, reserve_per_block: int) -> int:
        c, cfg = self.config, self.cfg
        per_block = reserve_per_block + kv_bytes_per_block(c.num_hidden_layers, self.block_size, self.num_kv_heads,
                                                           c.head_dim, self.kv_dtype, **self.sparq_layout)
        if self.device.type == "cuda":
            steps = self._step_memory()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - cfg.gpu_memory_utilization) * total - steps
            log.info("steps need %.2f GiB at their peak (measured); %.2f GiB left for the KV cache", steps / 2**30,
                     max(budget, 0) / 2**30)
        else:
            budget = cfg.cpu_kv_cache_gb * 2**30
        useful = cfg.max_num_seqs * -(-cfg.max_model_len // self.block_size)  # more could never be used
        return int(min(budget // per_block, useful))

    def _step_memory(self) -> int:
        """Bytes the steps will need beside the weights and the cache, measured before the cache is allocated (as
        vLLM profiles): the peak of the largest eager step (max_num_batched_tokens prompt tokens over up to
        max_num_seqs sequences, every logits row a sequence can give drawn with top-p, the costliest draw), plus
        that of a decode step of max_num_seqs sequences, which the CUDA graphs' pool will keep. Each runs on a
        cache just large enough for it."""
        cfg, rows = self.cfg, max(self.verify_len, 1)
        tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.max_model_len)
        seqs = min(cfg.max_num_seqs, tokens)
        prompts = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        # (and the last step's logits, which the next step keeps while it runs: the engine overlaps them)
        held = min(tokens, cfg.max_num_seqs * rows) * self.config.vocab_size * 4
        return held + sum(self._step_peak(lens) for lens in (prompts, [rows] * cfg.max_num_seqs))

    @torch.inference_mode()
    def _step_peak(self, lens: list[int]) -> int:
        """The memory one eager step over prompts of these lengths allocates at its peak beyond its cache, sampling
        every logits row each can give (a verify step's worth with speculation)."""
        dev, bs, rows = self.device, self.block_size, max(self.verify_len, 1)
        plan, blocks, draw = StepPlan(), 0, SamplingParams(temperature=1.0, top_p=0.9)
        for i, n in enumerate(lens):
            first = plan.add(SeqStep(i, [0] * n, list(range(n)), list(range(blocks, blocks - (-n // bs))),
                                     num_logits=min(n, rows)))
            plan.samples += [SampleSpec(i, first + j, SampleRow(draw, (), 0, seed=i)) for j in range(min(n, rows))]
            blocks -= -n // bs
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        c = self.config
        self.kv_caches = allocate_kv_caches(c.num_hidden_layers, blocks, bs, self.num_kv_heads, c.head_dim,
                                            self.kv_dtype, dev, **self.sparq_layout)
        cache = torch.cuda.memory_allocated(dev) - base
        torch.cuda.reset_peak_memory_stats(dev)
        logits = self.forward(plan)[0]
        sample_rows(self.model.ops, logits, [s.row for s in plan.samples])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base - cache
        del self.kv_caches, logits
        torch.cuda.empty_cache()
        return peak

    # ----- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, plan: StepPlan, draft_probs: torch.Tensor | None = None,
             token_bitmask: Callable[[], torch.Tensor | None] | None = None) -> StepFuture:
        """Run one plan; `draft_probs` holds the rows its samples' `draft_row`s name (a draft model's proposals).
        `token_bitmask`, called once the forward pass is launched, gives the samples' grammar masks (host int32
        [samples, ceil(V / 32)], -1 for free rows), or None."""
        dev = self.device
        if self.tp.size > 1:  # the other ranks need the sequences, not the samples (only this rank samples)
            self.tp.broadcast_object(dataclasses.replace(plan, samples=[]))
        logits, prompt_logits, hidden, logits_rows = self.forward(plan)
        prompt = {seq_id: (targets, *self._prompt_logprobs(rows, targets, k))
                  for seq_id, (rows, targets, k) in prompt_logits.items()}
        picked = [spec.logits_row for spec in plan.samples]
        if picked != list(range(logits.shape[0])):  # forked samples repeat their parent's row (no host sync)
            logits = logits.index_select(0, upload(picked, torch.int64, dev))
        self.last_logits = logits
        draft_tokens = None
        if any(spec.draft_tokens for spec in plan.samples):
            draft_tokens = [spec.draft_tokens for spec in plan.samples]
            draft_probs = draft_probs.index_select(0, upload([max(spec.draft_row, 0) for spec in plan.samples],
                                                             torch.int64, dev))
        bitmask = token_bitmask() if token_bitmask else None
        if bitmask is not None:
            bitmask = bitmask.to(dev, non_blocking=True)
        sampled = sample_rows(self.model.ops, logits, [spec.row for spec in plan.samples], draft_tokens, draft_probs,
                              bitmask)
        self.last_sampled = sampled.tokens
        return StepFuture(plan.samples, sampled, prompt, dev.type == "cuda", hidden,
                          [logits_rows[r] for r in picked] if hidden is not None else [], logits)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, list[int], int]],
                                               torch.Tensor | None, list[int]]:
        """What every rank runs of a step: block copies, inputs, the forward pass and the logits rows. Returns the
        logits, for sequences that asked for prompt log-probs {seq_id: (their prompt rows' logits, the targets,
        k)}, with `feature_layers` the target's features at each token of the plan, in plan order (else None),
        and the row of that of each logits row."""
        dev = self.device
        if plan.moves:  # a verified tree's kept tokens into their places (before any block copy reuses a block)
            src = upload([m[0] for m in plan.moves], torch.int64, dev)
            dst = upload([m[1] for m in plan.moves], torch.int64, dev)
            for cache in self.kv_caches:
                cache.copy_slots(src, dst)
        if plan.copies:
            src = upload([c.src for c in plan.copies], torch.int64, dev)
            dst = upload([c.dst for c in plan.copies], torch.int64, dev)
            for cache in self.kv_caches:
                cache.copy_blocks(src, dst)
        seqs = plan.seqs
        graph_key = self._graph_for(seqs)
        inputs = prepare_inputs(plan, self.block_size, dev, *graph_key, masked=self.verify_masked and graph_key[1] > 1) \
            if graph_key else prepare_inputs(plan, self.block_size, dev,
                                             pattern=self.sparse.pattern if self.sparse else None)
        ids, meta = inputs.ids, inputs.meta
        meta.sparse = self.sparse
        if inputs.from_last_step.numel():
            rows = inputs.from_last_step[1::2]  # (only the driver has sampled them)
            tokens = self.last_sampled[rows].to(ids.dtype) if self.tp.rank == 0 else \
                torch.empty(rows.shape, dtype=ids.dtype, device=dev)
            ids[inputs.from_last_step[0::2]] = self.tp.broadcast(tokens)
        prompt, kept = {}, None
        if graph_key:
            graph, features, logits = self.graphs[graph_key]
            st, size, tokens = self.static, graph_key[0], ids.shape[0]
            st["ids"][:tokens].copy_(ids)
            st["positions"][:tokens].copy_(meta.positions)
            st["slots"][:tokens].copy_(meta.slot_mapping)
            st["seq_lens"][:size].copy_(meta.seq_lens_k)
            st["block_table"][:size, :meta.block_table.shape[1]].copy_(meta.block_table)
            if meta.query_mask is not None:
                st["query_mask"][:tokens].copy_(meta.query_mask)
            graph.replay()
            rows = inputs.logits_index
            if rows == list(range(len(rows))):
                logits = logits[:len(rows)]
                # (every real token gives logits; a copy: the next replay overwrites the buffer)
                kept = features[:len(rows)].clone() if features is not None else None
            else:
                index = upload(rows, torch.int64, dev)
                logits = logits.index_select(0, index)
                kept = features.index_select(0, index) if features is not None else None
            rows = list(range(len(rows)))
        else:
            hidden, kept = self._model(ids, meta)
            # Rows picked by an uploaded index: a Python list as the index would be copied from pageable memory,
            # which makes the host wait for the whole forward pass and leaves the GPU idle meanwhile.
            rows = inputs.logits_index
            logits = self.model.compute_logits(
                hidden.index_select(0, upload(rows, torch.int64, dev)) if len(rows) < len(ids) else hidden)
            start = 0
            for s in seqs:
                if s.prompt_logprobs is not None:
                    first = start + s.prompt_skip
                    prompt[s.seq_id] = (self.model.compute_logits(hidden[first:first + len(s.prompt_targets)]),
                                        s.prompt_targets, s.prompt_logprobs)
                start += len(s.token_ids)
        return logits, prompt, kept, rows

    def _model(self, ids: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last layer's residual stream, and the features at `feature_layers` (None without)."""
        if not self.feature_layers:
            return self.model(ids, meta, self.kv_caches), None
        return self.model(ids, meta, self.kv_caches, self.feature_layers)

    def _prompt_logprobs(self, logits: torch.Tensor, targets: list[int], k: int):
        """Log-probabilities of the prompt tokens that rows of `logits` predict, and the top-k of each row."""
        lp = torch.log_softmax(logits, dim=-1)
        chosen = lp.gather(-1, upload(targets, torch.int64, self.device)[:, None])[:, 0]
        rank = (lp > chosen[:, None]).sum(-1) + 1
        if not k:
            return chosen, rank, None, None
        values, ids = lp.topk(lp.shape[-1] if k == -1 else k, dim=-1)
        return chosen, rank, ids, values

    # ----- CUDA graphs ----------------------------------------------------------------------------
    def _graph_for(self, seqs) -> tuple[int, int] | None:
        """The captured graph (batch size, tokens per sequence) that runs these sequences, if any: a decode step
        (one token each), or a verify step (each a last token and its proposals, every token giving logits)."""
        if not self.graphs or any(s.prompt_logprobs is not None or s.num_logits != len(s.token_ids) or
                                  (s.tree and not self.verify_masked) for s in seqs):
            return None
        q = 1 if all(len(s.token_ids) == 1 for s in seqs) else self.verify_len
        if any(len(s.token_ids) > q for s in seqs):
            return None
        return next(((b, q_) for b, q_ in self.graphs if q_ == q and b >= len(seqs)), None)

    def _capture_graphs(self, sizes: list[int], verify_sizes: list[int], max_blocks_per_seq: int) -> None:
        """Decode graphs for `sizes`, and verify graphs (self.verify_len tokens per sequence) for `verify_sizes`."""
        start, dev, q = time.perf_counter(), self.device, self.verify_len
        keys = [(b, 1) for b in sizes] + [(b, q) for b in verify_sizes]
        top = max(b for b, _ in keys)
        tokens = max(b * q_ for b, q_ in keys)
        self.static = st = {
            "ids": torch.zeros(tokens, dtype=torch.int64, device=dev),
            "positions": torch.zeros(tokens, dtype=torch.int64, device=dev),
            "slots": torch.full((tokens,), -1, dtype=torch.int64, device=dev),
            "seq_lens": torch.ones(top, dtype=torch.int32, device=dev),
            "block_table": torch.zeros(top, max_blocks_per_seq, dtype=torch.int32, device=dev),
            "query_mask": torch.full((tokens,), -1, dtype=torch.int64, device=dev),
            # cu_seqlens for each query length (a graph keeps the addresses it was captured with, not the tensors)
            **{f"cu{q_}": torch.arange(0, (top + 1) * q_, q_, dtype=torch.int32, device=dev) for _, q_ in keys},
            # every graph's logits: outputs of their own would each stay allocated, together a row per graph batch
            # size summed (17 GB for batches up to 1,024 and a vocabulary of 128k)
            "logits": torch.empty(tokens, self.config.vocab_size, dtype=torch.float32, device=dev),
        }
        pool = None
        with torch.inference_mode():
            for size, q_ in tqdm(sorted(keys, key=lambda k: -k[0] * k[1]), desc="Capturing CUDA graphs", leave=False):
                n = size * q_
                meta = AttentionMetadata(st[f"cu{q_}"][:size + 1], st["seq_lens"][:size], q_, st["positions"][:n],
                                         st["slots"][:n], st["block_table"][:size], sparse=self.sparse,
                                         query_mask=st["query_mask"][:n] if self.verify_masked and q_ > 1 else None)

                def run():
                    hidden, features = self._model(st["ids"][:n], meta)
                    return features, self.model.compute_logits(hidden, out=st["logits"][:n])
                run()  # compiles the Triton kernels for this shape outside the capture
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    features, logits = run()
                pool = graph.pool()
                self.graphs[(size, q_)] = (graph, features, logits)
        self.graphs = dict(sorted(self.graphs.items()))
        log.info("captured %d CUDA graphs (decode batches %d..%d, verify batches up to %d) in %.1f s", len(keys),
                 min(sizes), max(sizes), max(verify_sizes, default=0), time.perf_counter() - start)
