"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import torch

from flashpage.engine.runner import ModelRunner, SampledTokens
from flashpage.engine.sampler import SampleRow, upload
from flashpage.engine.scheduler import Scheduler
from flashpage.engine.sequence import Sequence
from flashpage.errors import ParameterError
from flashpage.kv import PENDING, BlockManager
from flashpage.loader import LoadedModel
from flashpage.outputs import CompletionOutput, RequestOutput
from flashpage.sampling_params import SamplingParams
from flashpage.tokenizer import IncrementalDetokenizer


@dataclass
class EngineConfig:
    max_model_len: int
    block_size: int = 16
    num_gpu_blocks: int | None = None  # KV cache size in blocks; by default from the memory settings below
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the GPU's memory flashpage may fill
    cpu_kv_cache_gb: float = 1.0  # CPU: KV cache size
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    kernels: str = "torch"  # "triton" or "torch" (the PyTorch references)
    enforce_eager: bool = False  # CUDA: no graphs, every step eager
    overlap: bool = True  # schedule and launch step N+1 before reading back step N's tokens


@dataclass
class InFlight:
    """A launched step whose tokens are still on their way back."""
    seqs: list[Sequence]  # one per sampled row
    positions: list[int]  # where each row's token goes in its sequence's token_ids
    result: SampledTokens
    overlap: bool  # the next step may be scheduled before this one is read back


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False


class LLMEngine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, seed: int = 0):
        if cfg.block_size < 1 or cfg.block_size & (cfg.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {cfg.block_size}")
        if cfg.max_num_seqs < 1 or cfg.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.cfg, self.config, self.tokenizer = cfg, loaded.config, loaded.tokenizer
        num_blocks = cfg.num_gpu_blocks or self._blocks_that_fit(loaded, cfg)
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache; lower the model size or raise the memory settings")
        self.runner = ModelRunner(loaded, num_blocks, cfg.block_size, cfg.kernels, cfg.max_num_seqs,
                                  cfg.max_model_len, cfg.enforce_eager)
        self.bm = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.bm, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.rng = random.Random(seed)  # seeds of unseeded requests
        self.in_flight: InFlight | None = None
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.eos_ids = set(loaded.config.eos_token_ids)
        self.num_aborted = 0  # requests stopped before they finished

    @staticmethod
    def _blocks_that_fit(loaded: LoadedModel, cfg: EngineConfig) -> int:
        per_block = ModelRunner.kv_bytes_per_block(loaded, cfg.block_size)
        device = next(loaded.model.parameters()).device
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = free - (1 - cfg.gpu_memory_utilization) * total
        else:
            budget = cfg.cpu_kv_cache_gb * 2**30
        useful = cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size)  # more could never be used
        return int(min(budget // per_block, useful))

    # ----- requests -----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run; changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        if not prompt_token_ids:
            raise ParameterError("prompt", "prompt is empty")
        vocab = self.config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_token_ids):
            raise ParameterError("prompt", f"prompt token ids must be integers in [0, {vocab})")
        n, limit = len(prompt_token_ids), self.cfg.max_model_len
        if n >= limit:
            raise ParameterError("prompt", f"prompt has {n} tokens, which leaves no room to generate within the "
                                 f"model's context (max_model_len={limit})")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ParameterError("max_tokens", f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is {n + params.max_tokens} "
                             f"tokens, over the model's context (max_model_len={limit}); lower max_tokens or "
                             f"shorten the prompt")
        longest = limit if params.max_tokens is None else n + params.max_tokens
        need = -(-longest // self.cfg.block_size)
        if need > self.bm.num_blocks:
            raise ParameterError("max_tokens", f"request needs up to {need} KV blocks ({longest} tokens) but the cache has "
                             f"{self.bm.num_blocks}; lower max_tokens or enlarge the cache")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        req = Request(request_id, prompt, list(prompt_token_ids), params)
        req.seqs.append(self._new_sequence(req, 0, next(self._arrivals)))
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])

    def _new_sequence(self, req: Request, index: int, arrival: int) -> Sequence:
        p = req.params
        seq = Sequence(
            seq_id=next(self._seq_ids), request_id=req.request_id, index=index, token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids), params=p, arrival=arrival,
            detokenizer=IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens)
            if self.tokenizer else None,
            logprobs=[] if p.logprobs is not None else None,
            prompt_logprobs=[None] if p.prompt_logprobs is not None else None,
        )
        self.seqs[seq.seq_id] = seq
        return seq

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its KV blocks are freed at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return  # unknown, or already finished
        self.num_aborted += 1
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
            self.seqs.pop(seq.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one batch; return the outputs of the requests advanced by the batch launched
        before it (finished ones flagged). With overlap, the host schedules this step while the GPU still runs
        the last one, whose tokens this step reads on the device; otherwise a step is read back at once."""
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch.seqs else None
        outputs = self._read_back(self.in_flight) if self.in_flight else []
        self.in_flight = launched
        if launched and not launched.overlap:
            outputs += self._read_back(launched)
            self.in_flight = None
        return outputs

    def _launch(self, batch) -> InFlight:
        logits, prompt_logits = self.runner.execute(batch)
        for seq_id, pl in prompt_logits.items():
            self._record_prompt_logprobs(self.seqs[seq_id], pl, next(s for s in batch.seqs if s.seq_id == seq_id).start)
        rows, seqs = [], []
        for row, s in enumerate(s for s in batch.seqs if s.sample):
            seq = self.seqs[s.seq_id]
            rows.append(row)
            seqs.append(seq)
            req = self.requests[seq.request_id]
            if req.params.n > 1 and not req.forked:  # the prompt is done: fork the other samples off it
                req.forked = True
                for index in range(1, req.params.n):
                    child = self._new_sequence(req, index, seq.arrival)
                    req.seqs.append(child)
                    self.scheduler.fork(seq, child)
                    rows.append(row)
                    seqs.append(child)
        if rows != list(range(logits.shape[0])):  # forked samples repeat their parent's row (no host sync)
            logits = logits.index_select(0, upload(rows, torch.int64, logits.device))
        sample_rows = [SampleRow(s.params, s.token_ids, len(s.token_ids) - s.num_prompt_tokens, self._seed(s))
                       for s in seqs]
        result = self.runner.sample(logits, sample_rows, [self._blocked_tokens(s) for s in seqs],
                                    [s.seq_id for s in seqs])
        positions = []
        for seq in seqs:  # the token is PENDING until read back; the next step may already compute on it
            positions.append(len(seq.token_ids))
            seq.token_ids.append(PENDING)
            seq.num_pending += 1
            n_out = len(seq.token_ids) - seq.num_prompt_tokens
            seq.last_pending = (seq.params.max_tokens is not None and n_out >= seq.params.max_tokens) or \
                len(seq.token_ids) >= self.cfg.max_model_len
        # Penalties need every earlier token on the host before the next step samples.
        overlap = self.cfg.overlap and not any(s.params.uses_penalties for s in seqs)
        return InFlight(seqs, positions, result, overlap)

    def _seed(self, seq: Sequence) -> int:
        """This step's random seed for a sequence: from the request's seed, sample index and position if it has
        one (so its tokens do not depend on what else runs), else from the engine's generator."""
        if seq.params.seed is None:
            return self.rng.getrandbits(63)
        return hash((seq.params.seed, seq.index, len(seq.token_ids))) % 2**63

    def _blocked_tokens(self, seq: Sequence) -> list[int]:
        """Tokens the sequence may not pick yet: its stop tokens before min_tokens."""
        p = seq.params
        if len(seq.token_ids) - seq.num_prompt_tokens >= p.min_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_ids))

    def _read_back(self, step: InFlight) -> list[RequestOutput]:
        tokens, logprobs, top_ids, top_lps = step.result.wait()
        advanced = {}
        for i, (seq, pos, token, lp) in enumerate(zip(step.seqs, step.positions, tokens, logprobs)):
            if seq.finished:
                continue  # finished (or aborted) while this step ran: the token is dropped
            seq.token_ids[pos] = token
            seq.num_pending -= 1
            self.bm.token_known(seq.seq_id, seq.token_ids, pos)
            top = None
            if seq.params.logprobs is not None:
                k = seq.params.logprobs
                top = dict(zip(top_ids[i][:k], top_lps[i][:k])) if k else {}
                top[token] = lp
            self._append(seq, pos, token, lp, top)
            advanced[seq.request_id] = self.requests[seq.request_id]
        return [self._output(req) for req in advanced.values()]

    def _append(self, seq: Sequence, pos: int, token: int, logprob: float, top: dict | None) -> None:
        """Account for the token now known at `pos` (later positions may still be pending)."""
        p = seq.params
        seq.cumulative_logprob += logprob
        if seq.logprobs is not None:
            seq.logprobs.append(top)
        n_out = pos + 1 - seq.num_prompt_tokens
        eos = not p.ignore_eos and token in self.eos_ids  # (masked until min_tokens, as stop tokens are)
        if seq.detokenizer and not (eos or token in p.stop_token_ids):  # a stop token's text is not output (vLLM)
            seq.text += seq.detokenizer.step(token)
        if eos:
            self._finish(seq, "stop", None)
        elif token in p.stop_token_ids:
            self._finish(seq, "stop", token)
        elif p.stop and (hit := _first_stop(seq.text, p.stop)) is not None:
            seq.text = seq.text[:hit[0]]
            self._finish(seq, "stop", hit[1])
        elif (p.max_tokens is not None and n_out >= p.max_tokens) or pos + 1 >= self.cfg.max_model_len:
            self._finish(seq, "length", None)
        if seq.finished:  # drop tokens launched after this one
            del seq.token_ids[pos + 1:]
            seq.num_pending = 0

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, start: int) -> None:
        """logits[i] predicts prompt token start + i + 1."""
        end = min(start + logits.shape[0], seq.num_prompt_tokens - 1)
        if end <= start or len(seq.prompt_logprobs) != start + 1:
            return
        targets = torch.tensor(seq.token_ids[start + 1:end + 1], device=logits.device)
        lp = torch.log_softmax(logits[:end - start], dim=-1)
        chosen = lp.gather(-1, targets[:, None])[:, 0].tolist()
        k = seq.params.prompt_logprobs
        top_lps, top_ids = lp.topk(k, dim=-1) if k else (None, None)
        for i, (token, value) in enumerate(zip(targets.tolist(), chosen)):
            entry = dict(zip(top_ids[i].tolist(), top_lps[i].tolist())) if k else {}
            entry[token] = value
            seq.prompt_logprobs.append(entry)

    def _output(self, req: Request) -> RequestOutput:
        finished = all(s.finished for s in req.seqs) and (req.forked or req.params.n == 1)
        outputs = [CompletionOutput(s.index, s.text, list(s.output_token_ids), s.finish_reason, s.stop_reason,
                                    s.cumulative_logprob, s.logprobs) for s in req.seqs]
        if finished:
            for s in req.seqs:
                self.seqs.pop(s.seq_id, None)
            del self.requests[req.request_id]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs, finished,
                             req.seqs[0].prompt_logprobs)

    # ----- statistics ---------------------------------------------------------------------------
    def stats(self) -> dict:
        blocks_in_use, tokens_stored = self.bm.usage()
        return {
            "kv_blocks_total": self.bm.num_blocks,
            "kv_blocks_free": self.bm.num_free_blocks,
            "kv_block_size": self.bm.block_size,
            "kv_tokens_stored": tokens_stored,
            "kv_slots_allocated": blocks_in_use * self.bm.block_size,
            "prefix_cache_queries": self.scheduler.prefix_queries,
            "prefix_cache_hits": self.scheduler.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_aborted_requests": self.num_aborted,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def streamable_end(text: str, stops: list[str], finished: bool) -> int:
    """How much of a sample's text may be shown while streaming: all of it once finished, else all but the
    longest end of it that begins some stop string (that part is held back until it cannot be one)."""
    return len(text) if finished else len(text) - _stop_prefix_len(text, stops)


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
