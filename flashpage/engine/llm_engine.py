"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

A step is one `StepPlan` from the scheduler, run by the runner in one call; the engine only applies what comes
back: appends tokens, checks stops, builds outputs. With speculative decoding, a proposer first gives decoding
sequences tokens to verify; the step draws a token after each (`SampleRow` at that position), and a proposed token
is kept while it equals the token drawn before it: what decoding one token at a time would have produced.
"""

from __future__ import annotations

import copy
import gc
import itertools
import random
import time
import weakref
from dataclasses import dataclass, field

from flashpage.engine.config import EngineConfig
from flashpage.engine.runner import ModelRunner, StepFuture
from flashpage.engine.sampler import warm_up_sampling
from flashpage.engine.scheduler import Scheduler
from flashpage.engine.sparse import SparseStats
from flashpage.engine.sequence import Sequence
from flashpage.engine.spec import SpecStats, make_proposer
from flashpage.engine.spec.draft import draft_bytes_per_block, load_draft
from flashpage.engine.spec.eagle import eagle_bytes_per_block
from flashpage.engine.spec.medusa import with_head_count
from flashpage.engine.spec.typical import kept_token, typical_walk
from flashpage.engine.step import SampledToken, StepPlan
from flashpage.engine.structured import StructuredOutputs
from flashpage.engine.validation import EngineLimits, RequestValidator
from flashpage.errors import ParameterError
from flashpage.kv import BlockManager
from flashpage.loader import LoadedModel, model_config
from flashpage.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from flashpage.parallel.workers import WorkerFailed, start_workers
from flashpage.sampling_params import SamplingParams
from flashpage.tokenizer import IncrementalDetokenizer


@dataclass
class InFlight:
    """A launched step whose tokens are still on their way back."""
    future: StepFuture
    overlap: bool  # the next step may be scheduled before this one is read back
    plan: StepPlan


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, cfg: EngineConfig, loaded: LoadedModel | None = None):
        """Builds the runner (which loads `cfg.model`, or serves `loaded`), the block manager and the scheduler.
        With tensor_parallel_size > 1 it first starts the other ranks (`flashpage.parallel.workers`)."""
        cfg = with_head_count(cfg)  # (Medusa: how many heads, before the runner sizes its verify graphs)
        self.spec = cfg.speculative
        self.typical = self.spec is not None and self.spec.acceptance_method == "typical_acceptance_sampler"
        method = self.spec.method if self.spec else None
        if method in ("medusa", "eagle", "eagle3") and cfg.tensor_parallel_size > 1:
            raise ParameterError("speculative_config.method", f"speculative_config: {method} reads the target's "
                                 f"hidden states whole, on one rank: not with tensor_parallel_size > 1 yet")
        self.workers = None
        if cfg.tensor_parallel_size > 1:
            if loaded is not None:
                raise ValueError("a model already in memory cannot be split over ranks; give tensor_parallel_size=1")
            cfg, self.workers = start_workers(cfg, model_config(cfg))
        # a draft model's weights are loaded first, and the target's KV cache leaves room for the draft's (the
        # draft runs whole on the driver)
        draft = load_draft(self.spec, cfg) if method == "draft_model" else None
        tp = self.workers.tp if self.workers else None
        reserve = draft_bytes_per_block(draft, cfg.block_size) if draft else \
            eagle_bytes_per_block(self.spec.model, cfg.block_size) if method in ("eagle", "eagle3") else 0
        self.runner = ModelRunner(cfg, loaded, reserve, tp)
        if self.workers:
            self.workers.release_graphs = weakref.WeakMethod(self.runner.release_graphs)
        self.cfg = cfg = self.runner.cfg  # device, kernels and max_model_len resolved
        self.config, self.tokenizer = self.runner.config, self.runner.tokenizer
        self.bm = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.bm, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len)
        self.rng = random.Random(cfg.seed)  # seeds of unseeded requests
        self.in_flight: InFlight | None = None
        self._early_advanced: dict[str, Request] | None = None  # the step in flight, read back by _token_bitmask
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self.eos_ids = set(self.config.eos_token_ids)
        self.num_aborted = 0  # requests stopped before they finished
        self.last_step_tokens = 0  # tokens the last step computed
        self._token_texts: dict[int, str] = {}  # log-probs' decoded tokens
        self.proposer = make_proposer(self.spec, cfg, self.runner, draft) if self.spec else None
        self.spec_stats = SpecStats(self.spec.num_speculative_tokens if self.spec else 0)
        sparse = cfg.sparse
        self.sparse_stats = SparseStats(sparse, self.runner.config.head_dim,
                                        self.runner.kv_caches[0].k.element_size()) if sparse else None
        self.structured = StructuredOutputs(self.tokenizer, self.config.vocab_size, sorted(self.eos_ids))
        self.limits = EngineLimits(self.config.vocab_size, cfg.max_model_len, cfg.max_logprobs, cfg.block_size,
                                   self.bm.num_blocks, tuple(sorted(self.eos_ids)))
        self.validator = RequestValidator(self.limits, self.tokenizer, self.structured)
        # What start-up built (the model, its parameters, the CUDA graphs) lives as long as the engine: freezing it
        # keeps the garbage collector's full passes, which the per-step objects trigger, from walking it (as vLLM).
        gc.collect()
        gc.freeze()
        # A step allocates thousands of short-lived containers, so at CPython's default threshold (700) a full
        # collection ran every ~16 decode steps of 512 sequences, 30-40 ms each, with the GPU idle (an H200 host,
        # docs/kernel-notes.md): collect the youngest generation a hundred times less often (as lmdeploy does).
        young, *older = gc.get_threshold()
        gc.set_threshold(max(young, 70_000), *older)

    @property
    def max_model_len(self) -> int:
        return self.cfg.max_model_len

    # ----- requests -----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (a ParameterError naming the field) if the request can never run; changes nothing."""
        self.validator(prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        req = Request(request_id, prompt, list(prompt_token_ids), params, RequestMetrics(time.time()))
        seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        req.seqs = [self._new_sequence(req, index, seed) for index in range(params.n)]
        if params.structured_outputs is not None:
            for seq in req.seqs:
                seq.grammar = self.structured.matcher(params.structured_outputs)
        req.seqs[0].forks = req.seqs[1:]  # forked off the first once its prompt is computed, sharing its blocks
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])

    def _new_sequence(self, req: Request, index: int, seed: int) -> Sequence:
        p = req.params
        seq = Sequence(
            seq_id=next(self._seq_ids), request_id=req.request_id, index=index, token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids), params=p, seed=seed,
            stop_ids=list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_ids)),
            bad_words=[ids for word in p.bad_words for ids in self._bad_word_ids(word)],
            detokenizer=IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens)
            if self.tokenizer and p.detokenize else None,
            logprobs=[] if p.logprobs is not None else None,
            prompt_logprobs=[None] if p.prompt_logprobs is not None else None,
        )
        self.seqs[seq.seq_id] = seq
        return seq

    def _bad_word_ids(self, word: str) -> list[list[int]]:
        """A bad word as tokens, alone and after a space (as vLLM bans both)."""
        forms = {tuple(self.tokenizer.encode(w, add_special_tokens=False)) for w in (word.lstrip(), " " + word.lstrip())}
        return [list(f) for f in sorted(forms) if f]

    def _token_text(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def _logprobs_entry(self, t: SampledToken) -> dict[int, Logprob]:
        """vLLM's per-position log-probs: the token first, then the top-k by rank."""
        entry = {t.token_id: Logprob(t.logprob, t.rank, self._token_text(t.token_id))}
        for rank, (token, logprob) in enumerate(t.top.items(), 1):
            entry.setdefault(token, Logprob(logprob, rank, self._token_text(token)))
        return entry

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV blocks are freed at once. Returns its final output (unfinished samples with
        finish_reason "abort"), or None for an unknown or finished request."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.num_aborted += 1
        for seq in req.seqs:
            if not seq.finished:
                self._release(seq)
                seq.finish_reason = "abort"
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def warm_up(self) -> None:
        """Serve a few short requests so that the kernels real requests need are compiled before they come (a
        server's first prefill otherwise waits seconds for Triton: 8 s on an H100 for llama-3-8b), and on a CPU
        the weights packed (kernels/cpu.py: 1.2 s for SmolLM2). Triton compiles a kernel again for integer
        arguments that are 1 or multiples of 16, so the waves cover both: 16 prompts of 16 tokens, then 3 of 23
        tokens in all beside those 16 decoding (a mixed step, whose decoding rows take the decode kernel as eager
        mixed steps run it: `DecodeSplit`), then one whose first block is cached (prefill after a prefix);
        then prompts of 100 and 150 tokens, the other row classes of the FP8 linear kernel's tiles
        (kernels/linear.py; the decode graphs cover the multiples of 16), the first alone in its step, the second
        beside it decoding (a mixed step with one decoding sequence, which the decode kernel is specialized for:
        kernels/attention.py, _attention_kernel); on a GPU, one of 2,048
        tokens, whose last prefill sees long items (the Hopper prefill's other tiles: kernels/hopper_prefill.py,
        short_items; on a CPU it would take seconds and compile nothing). Greedy and sampled draws, with
        log-probs; then, on a GPU, the sampling kernels' other variants (`warm_up_sampling`). A request the engine
        could never serve (a tiny context or cache) is left out. Leaves their prompts in the prefix cache, nothing
        else."""
        vocab, limit = self.config.vocab_size, self.max_model_len

        def prompt(i: int, n: int) -> list[int]:
            return [(101 + 7 * j + 13 * i) % vocab for j in range(min(n, limit - 1))]
        waves = [[prompt(i, 16) for i in range(16)], [prompt(16, 17), prompt(17, 5), prompt(18, 1)], [prompt(0, 33)],
                 None, [prompt(19, 100)], [prompt(20, 150)]]  # None: finish what runs first
        if self.cfg.device.startswith("cuda"):
            waves += [None, [prompt(21, 2048)]]
        for w, prompts in enumerate(waves):
            if prompts is None:
                while self.has_unfinished_requests():
                    self.step()
                continue
            for i, ids in enumerate(prompts):
                sampled = i % 2 == 1
                params = SamplingParams(max_tokens=min(3, limit - len(ids)), ignore_eos=True, seed=i,
                                        temperature=1.0 if sampled else 0.0, top_p=0.9 if sampled else 1.0,
                                        logprobs=1 if sampled else None)
                try:
                    self.add_request(f"warm-up-{w}-{i}", ids, params)
                except ValueError:
                    continue
            self.step()
        while self.has_unfinished_requests():
            self.step()
        if self.cfg.device.startswith("cuda"):
            # (a step samples at most one row per token it carries)
            warm_up_sampling(self.runner.model.ops, vocab, self.runner.device, self.cfg.max_num_batched_tokens,
                             drafts=self.spec is not None and self.spec.method == "draft_model")

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (also done at exit); the engine cannot step after this."""
        if self.workers:
            self.workers.shutdown()

    # ----- one step -----------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Schedule and launch one batch; return the outputs of the requests advanced by the batch launched
        before it (finished ones flagged); `final_only`: of the finished ones alone (an output copies the tokens
        so far, for every advanced request every step). With overlap, the host schedules this step while the GPU
        still runs the last one, whose tokens this step reads on the device; otherwise a step is read back at
        once. Raises WorkerFailed if a tensor-parallel rank died or hung (the engine is stopped then)."""
        if self.workers is None:
            advanced = self._step()
        elif self.workers.stopped:
            raise WorkerFailed("the tensor-parallel engine has stopped")
        else:
            try:
                advanced = self._step()
            except RuntimeError as e:  # a collective failed: the group is broken
                raise self.workers.failure(e) from e
        return [self._output(req) for req in advanced.values() if not final_only or req.finished]

    def _step(self) -> dict[str, Request]:
        """One step; returns the requests its read-backs advanced, by id."""
        speculate = self._propose()
        plan = self.scheduler.schedule()
        launched = None
        self.last_step_tokens = sum(len(s.token_ids) for s in plan.seqs)
        if self.sparse_stats:
            self.sparse_stats.record(plan.seqs)
        self._early_advanced = None
        if plan.seqs:
            # Penalties and bad words need every earlier token on the host before the next step samples; so do
            # proposals (and how many tokens a verification keeps decides the next step's positions).
            overlap = self.cfg.overlap and not speculate and not any(s.row.params.needs_history for s in plan.samples)
            draft_probs = self.proposer.probs if self.proposer else None
            launched = InFlight(self.runner.step(plan, draft_probs, self._token_bitmask(plan)), overlap, plan)
        advanced = self._early_advanced if self._early_advanced is not None else \
            self._read_back(self.in_flight) if self.in_flight else {}
        self.in_flight = launched
        if launched and not launched.overlap:
            advanced.update(self._read_back(launched))
            self.in_flight = None
        return advanced

    def _token_bitmask(self, plan):
        """The grammar masks of the plan's constrained samples, as a function the runner calls once the forward
        pass is launched: it reads back the step still in flight (its tokens move the grammars), then fills the
        masks while the device computes. None where nothing is constrained."""
        constrained = {spec.seq_id: self.seqs[spec.seq_id] for spec in plan.samples
                       if self.seqs[spec.seq_id].grammar is not None}
        if not constrained:
            return None

        def fill():
            if self.in_flight:
                self._early_advanced = self._read_back(self.in_flight)
                self.in_flight = None
            live = {i: s for i, s in constrained.items() if not s.finished}  # (a finished one's token is dropped)
            return self.structured.bitmask(plan.samples, {i: s.grammar for i, s in live.items()},
                                           {i: s.verifying for i, s in live.items()})
        return fill

    def _propose(self) -> bool:
        """Proposals for the decoding sequences whose tokens are all known, unless the batch is too large for
        speculation to pay. Returns whether this step speculates."""
        running = self.scheduler.running
        if not self.proposer:
            return False
        for seq in running:  # (what the last step left unscheduled is stale)
            seq.proposal, seq.proposal_rows, seq.proposal_parents = [], None, None
        if len(running) > (self.spec.disable_by_batch_size or len(running)):
            return False
        self.proposer.propose(running)
        for seq in running:  # only what the grammar allows can be kept: the rest is cut before it is computed
            if seq.grammar is not None and seq.proposal:
                if seq.proposal_parents:  # a tree's first branch only (its first nodes, each the last one's child)
                    branch = next((i for i, p in enumerate(seq.proposal_parents) if p != i - 1), len(seq.proposal))
                    seq.proposal, seq.proposal_parents = seq.proposal[:branch], None
                seq.proposal = seq.proposal[:seq.grammar.validate_tokens(seq.proposal)]
        return True

    def _read_back(self, step: InFlight) -> dict[str, Request]:
        result = step.future.result()
        advanced = {}
        for seq_id, tokens in result.prompt_logprobs.items():
            if seq_id in self.seqs:
                self.seqs[seq_id].prompt_logprobs += [self._logprobs_entry(t) for t in tokens]
        now = time.time()
        if hasattr(self.proposer, "take_features"):  # (a proposer that reads the target's features of every token)
            self.proposer.take_features(step.plan, result.hidden)
        observe = getattr(self.proposer, "observe", None)
        # a sequence's samples are adjacent: (index of its first, its tokens)
        for seq_id, group in itertools.groupby(enumerate(result.sampled), key=lambda p: p[1].seq_id):
            seq = self.seqs.get(seq_id)
            if seq is None or seq.finished:
                continue  # finished (or aborted) while this step ran: its tokens are dropped
            group = list(group)
            first, drawn = group[0][0], [t for _, t in group]
            drawn_ids = [t.token_id for t in drawn]
            rows = [0]  # the sample rows whose tokens are emitted: row 0 drew after its last token, row i + 1 after
            # proposed token i
            if seq.verifying:  # keep the path of proposed tokens the draws follow (a chain's: each equal to the
                # token drawn before it), and the token drawn after it
                proposal = seq.verifying
                kept = self._verify(seq, drawn, result.logits[first:first + len(drawn)] if self.typical else None)
                self.spec_stats.record(len(proposal), len(kept))
                self.scheduler.accept(seq, len(kept), kept)
                rows += [i + 1 for i in kept]
                emitted = [drawn[r] for r in rows]
                for j, node in enumerate(kept):
                    if emitted[j].token_id != proposal[node]:  # typical acceptance kept a token not drawn
                        emitted[j] = kept_token(seq_id, proposal[node], result.logits[first + rows[j]], emitted[j])
                drawn = emitted
            if observe:
                observe(seq, drawn_ids, rows, None if result.hidden is None else result.hidden[
                    result.sample_rows[first]:result.sample_rows[first + len(drawn_ids) - 1] + 1])
            for sampled in drawn:
                self._append(seq, sampled)
                if seq.finished:
                    break
            req = advanced[seq.request_id] = self.requests[seq.request_id]
            req.metrics.first_token_time = req.metrics.first_token_time or now
            req.metrics.last_token_time = now
        return advanced

    def _append(self, seq: Sequence, sampled: SampledToken) -> None:
        """Put a sampled token in its PENDING place (later positions may still be pending) and check stops."""
        p, token = seq.params, sampled.token_id
        pos = seq.num_known
        if seq.num_pending:
            seq.token_ids[pos] = token
            seq.num_pending -= 1
        else:  # a verified token after the first
            seq.token_ids.append(token)
        self.scheduler.commit(seq)
        seq.cumulative_logprob += sampled.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprobs_entry(sampled))
        eos = not p.ignore_eos and token in self.eos_ids  # (masked until min_tokens, as stop tokens are)
        # a stop token's text is left out, unless asked for (as vLLM)
        if seq.detokenizer and (p.include_stop_str_in_output or not (eos or token in p.stop_token_ids)):
            seq.text += seq.detokenizer.step(token)
        if eos:
            self._finish(seq, "stop", None)
        elif token in p.stop_token_ids:
            self._finish(seq, "stop", token)
        elif p.stop and (hit := _first_stop(seq.text, p.stop)) is not None:
            seq.text = seq.text[:hit[0] + (len(hit[1]) if p.include_stop_str_in_output else 0)]
            self._finish(seq, "stop", hit[1])
        elif seq.grammar is not None and (not seq.grammar.consume_token(token) or seq.grammar.is_stopped()):
            self._finish(seq, "stop", None)  # the grammar is complete (its mask allowed nothing else to be drawn)
        elif seq.ends_at(pos + 1, self.cfg.max_model_len):
            self._finish(seq, "length", None)
        if seq.finished:  # drop tokens launched after this one
            del seq.token_ids[pos + 1:]
            seq.num_pending = 0

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.proposer:
            self.proposer.release(seq.seq_id)

    def _output(self, req: Request) -> RequestOutput:
        finished = req.finished
        outputs = [CompletionOutput(s.index, s.text, list(s.output_token_ids), s.finish_reason, s.stop_reason,
                                    s.cumulative_logprob, s.logprobs) for s in req.seqs]
        req.metrics.first_scheduled_time = req.seqs[0].first_scheduled_time
        if finished:
            req.metrics.finished_time = time.time()
            for s in req.seqs:
                self.seqs.pop(s.seq_id, None)
            del self.requests[req.request_id]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs, finished,
                             req.seqs[0].prompt_logprobs, copy.copy(req.metrics))

    # ----- statistics ---------------------------------------------------------------------------
    def stats(self) -> dict:
        blocks_in_use, tokens_stored = self.bm.usage()
        return {
            "kv_blocks_total": self.bm.num_blocks,
            "kv_blocks_free": self.bm.num_free_blocks,
            "kv_block_size": self.bm.block_size,
            "kv_cache_dtype": self.cfg.kv_cache_dtype,
            "kv_cache_capacity_tokens": self.bm.num_blocks * self.bm.block_size,
            "kv_tokens_stored": tokens_stored,
            "kv_slots_allocated": blocks_in_use * self.bm.block_size,
            "prefix_cache_queries": self.scheduler.prefix_queries,
            "prefix_cache_hits": self.scheduler.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_aborted_requests": self.num_aborted,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            **(self.spec_stats.as_dict() if self.spec else {}),
            **(self.sparse_stats.as_dict() if self.sparse_stats else {}),
        }

    def _verify(self, seq: Sequence, drawn: list[SampledToken], logits) -> list[int]:
        """The proposed tokens the engine keeps of `seq.verifying` (a chain, or a tree), root first; `logits`:
        the sequence's sample rows where typical acceptance may judge them."""
        parents = seq.verifying_parents or list(range(-1, len(seq.verifying) - 1))  # (a chain)
        t = seq.params.temperature
        if logits is not None and t > 0:
            spec = self.spec
            return typical_walk(seq.verifying, parents, logits, t, spec.typical_acceptance_sampler_posterior_threshold,
                                spec.typical_acceptance_sampler_posterior_alpha)
        return walk_tree(seq.verifying, parents, drawn)


def walk_tree(tokens: list[int], parents: list[int], drawn) -> list[int]:
    """The proposed nodes kept from a verified token tree: from the sequence's last token (drawn[0] drawn after
    it; drawn[i + 1] after node i), down to the child whose token is the one drawn, while there is one. Lossless as
    a chain's check: each drawn token is the model's own draw at its place, whatever was proposed."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    kept, node = [], -1
    while True:
        t = drawn[node + 1].token_id
        node = next((c for c in children.get(node, []) if tokens[c] == t), None)
        if node is None:
            return kept
        kept.append(node)


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
