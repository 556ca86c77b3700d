"""SpeculativeConfig: vLLM's `speculative_config` dictionary, checked once before anything runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flashpage.errors import DictSetting
from flashpage.kernels.tree import MAX_TREE_TOKENS

METHODS = ("ngram", "draft_model", "lookahead", "medusa", "eagle", "eagle3")
ACCEPTANCE = ("rejection_sampler", "typical_acceptance_sampler")
HEADS_TREE_WIDTH = 4  # medusa's and eagle's default: 4 guesses a node, 4 x num_speculative_tokens nodes
MAX_SPECULATIVE_TOKENS = 16  # beyond this a verify step costs more than the tokens it can win (docs/spec.md)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram": prompt lookup; "draft_model": a smaller model with the target's vocabulary;
    # "lookahead": lookahead decoding (Jacobi guesses and their n-grams, engine/spec/lookahead.py); "medusa":
    # Medusa heads on the target's hidden state (engine/spec/medusa.py); "eagle": an EAGLE draft layer on the
    # target's features, EAGLE-2's dynamic trees (engine/spec/eagle.py); "eagle3": an EAGLE-3 draft (three of
    # the target's layers fused, its own vocabulary; engine/spec/eagle3.py), the same trees
    # k: tokens proposed per sequence and step (lookahead: its tree's depth, set for it; medusa: the heads used,
    # default all of the checkpoint's, None until the engine reads them)
    num_speculative_tokens: int | None
    model: str | None = None  # the draft (a directory, .gguf file or known name), or the Medusa heads' checkpoint
    prompt_lookup_min: int = 2  # ngram: shortest suffix of the sequence to look up
    prompt_lookup_max: int = 4  # ngram: longest (the longest match found wins)
    # ngram: up to this many distinct continuations (the latest matches of the longest suffix that has any),
    # merged into one token tree verified in one step (SpecInfer); 1: one chain. medusa (default 4): up to this
    # many guesses of each head, width x k nodes, the likeliest paths; 1: a chain (blockwise parallel decoding).
    # eagle (default 4), draft_model (default 1): each level expands its `width` likeliest nodes by their `width`
    # likeliest tokens, and the tree keeps the width x k likeliest nodes of all (EAGLE-2; a draft model's then
    # proposes its likeliest tokens, not sampled ones); 1: a chain
    tree_width: int = 1
    # medusa: the tree as Medusa's code writes it (paths of head ranks, e.g. [[0], [1], [0, 0]]), instead of
    # tree_width's
    medusa_choices: tuple[tuple[int, ...], ...] | None = None
    # lookahead: the window W (guesses per level), the n-gram size N (N - 1 levels) and the guess set G (n-grams
    # verified per step at most); a step's tree has (W - 1) + W (N - 2) + G (N - 1) nodes. The defaults were the
    # fastest of the settings measured on SmolLM2 (docs/spec.md): long n-grams, few of them, a narrow window
    window_size: int = 2
    ngram_size: int = 8
    guess_set_size: int = 3
    # lookahead: the pool also holds the sequence's own n-grams, the prompt's and the answer's as it grows
    pool_from_context: bool = True
    # No proposals in a step with more running sequences than this (None: always propose). A large batch is
    # compute-bound: verifying there costs about what it wins (H100, llama-3-8b: at a third of proposals accepted,
    # 1.19x at 32 sequences, 0.89x at 64; docs/spec.md).
    disable_by_batch_size: int | None = 32
    # "typical_acceptance_sampler": keep a proposed token the target finds typical (probability above
    # min(threshold, alpha exp(-entropy)), Medusa's rule) even where it drew another: LOSSY, more tokens kept per
    # step when sampling (temperature 0 stays exact); not with a draft model (engine/spec/typical.py)
    acceptance_method: str = "rejection_sampler"
    typical_acceptance_sampler_posterior_threshold: float = 0.09
    typical_acceptance_sampler_posterior_alpha: float = 0.3

    @property
    def proposes_trees(self) -> bool:
        return self.method == "lookahead" or self.tree_width > 1 or \
            (self.medusa_choices is not None and any(p[-1] > 0 for p in self.medusa_choices))

    @property
    def max_proposal(self) -> int:
        """The most tokens one proposal holds (a verify graph's length, less the sequence's last token)."""
        k = self.num_speculative_tokens
        if self.method == "lookahead":
            w, n, g = self.window_size, self.ngram_size, self.guess_set_size
            return (w - 1) + w * (n - 2) + g * (n - 1)
        if self.method == "medusa":
            return len(self.medusa_choices) if self.medusa_choices else min(self.tree_width * k, MAX_TREE_TOKENS - 1)
        return self.tree_width * k

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        """vLLM's keys; `method` may be left out when `model` is given (a draft model), and "[ngram]" (vLLM's
        older spelling) is accepted. Raises ParameterError naming the key."""
        setting = DictSetting("speculative_config", d, [f.name for f in dataclasses.fields(cls)])
        bad = setting.bad
        d = dict(d)
        method = d.get("method") or ("draft_model" if d.get("model") not in (None, "[ngram]") else "ngram")
        d["method"] = "ngram" if method == "[ngram]" else method
        if d["method"] not in METHODS:
            bad("method", f"must be one of {', '.join(METHODS)}, got {method!r}")
        acceptance = d.get("acceptance_method", cls.acceptance_method)
        if acceptance not in ACCEPTANCE:
            bad("acceptance_method", f"must be one of {', '.join(ACCEPTANCE)}, got {acceptance!r}")
        typical_keys = ("typical_acceptance_sampler_posterior_threshold", "typical_acceptance_sampler_posterior_alpha")
        if acceptance == "typical_acceptance_sampler":
            if d["method"] == "draft_model":
                bad("acceptance_method", "typical acceptance judges point-mass proposals: not for a draft model, "
                                         "whose rejection sampler is already lossless and exact")
            for key in typical_keys:
                v = d.get(key, getattr(cls, key))
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1:
                    bad(key, f"must be a number in [0, 1], got {v!r}")
        elif any(key in d for key in typical_keys):
            bad(next(key for key in typical_keys if key in d), "applies only with acceptance_method "
                "typical_acceptance_sampler (a lossy option, never on by default)")
        if d["method"] == "medusa":
            if not isinstance(d.get("model"), str):
                bad("model", "must name the Medusa heads' checkpoint (a directory or Hub id)")
            if "medusa_choices" in d:
                if "tree_width" in d:
                    bad("tree_width", "and medusa_choices both shape the tree: give one")
                d["medusa_choices"] = medusa_choices(d["medusa_choices"], bad)
            setting.integer("tree_width", 1, HEADS_TREE_WIDTH)
            d.setdefault("tree_width", HEADS_TREE_WIDTH)
            # (left out: the heads' count, read with them before the engine starts; engine/spec/medusa.py)
            d.setdefault("num_speculative_tokens", None)
        elif "medusa_choices" in d:
            bad("medusa_choices", "applies to method medusa only")
        if d["method"] in ("eagle", "eagle3"):
            if not isinstance(d.get("model"), str):
                bad("model", "must name the EAGLE draft's checkpoint (a directory or Hub id)")
            setting.integer("tree_width", 1, HEADS_TREE_WIDTH)
            d.setdefault("tree_width", HEADS_TREE_WIDTH)
        lookahead_keys = ("window_size", "ngram_size", "guess_set_size", "pool_from_context")
        if d["method"] == "lookahead":
            for key, low in zip(lookahead_keys, (1, 3, 1)):
                setting.integer(key, low, getattr(cls, key))
            if not isinstance(d.get("pool_from_context", True), bool):
                bad("pool_from_context", f"must be true or false, got {d['pool_from_context']!r}")
            w, n, g = (d.get(key, getattr(cls, key)) for key in lookahead_keys[:3])
            if (w - 1) + w * (n - 2) + g * (n - 1) >= MAX_TREE_TOKENS:
                bad("window_size", f"W - 1 + W (N - 2) + G (N - 1) tree nodes must be fewer than {MAX_TREE_TOKENS}"
                                   f" (a tree and the token before it), got W={w}, N={n}, G={g}")
            if "num_speculative_tokens" in d:
                bad("num_speculative_tokens", "is set by lookahead itself (its tree's depth): leave it out")
            d["num_speculative_tokens"] = max(n - 1, w + n - 3)
        elif any(key in d for key in lookahead_keys):
            bad(next(key for key in lookahead_keys if key in d), "applies to method lookahead only")
        k = d.get("num_speculative_tokens")
        if (k is not None or d["method"] != "medusa") and (
                not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            bad("num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if d["method"] == "medusa" and k is not None and d.get("medusa_choices") and \
                max(map(len, d["medusa_choices"])) > k:
            bad("medusa_choices", f"has paths deeper than num_speculative_tokens ({k}), the heads used")
        if d["method"] == "draft_model" and not isinstance(d.get("model"), str):
            bad("model", "must name the draft model (a directory, .gguf file or known name)")
        if d["method"] == "ngram":
            d.pop("model", None)
            lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
            if lo is None and hi is not None:
                d["prompt_lookup_min"] = lo = min(hi, cls.prompt_lookup_min)
            if hi is None and lo is not None:
                d["prompt_lookup_max"] = hi = max(lo, cls.prompt_lookup_max)
            lo, hi = lo or cls.prompt_lookup_min, hi or cls.prompt_lookup_max
            for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    bad(key, f"must be an integer >= 1, got {v!r}")
            if lo > hi:
                bad("prompt_lookup_min", f"({lo}) must not exceed prompt_lookup_max ({hi})")
            width = d.get("tree_width", cls.tree_width)
            if not isinstance(width, int) or isinstance(width, bool) or width < 1 or width * k >= MAX_TREE_TOKENS:
                bad("tree_width", f"must be an integer >= 1 with tree_width x num_speculative_tokens < "
                                  f"{MAX_TREE_TOKENS} (a tree and the token before it), got {width!r}")
        elif d["method"] in ("eagle", "eagle3", "draft_model"):
            d.setdefault("tree_width", 1)
            setting.integer("tree_width", 1, 1)
            if d["tree_width"] * k >= MAX_TREE_TOKENS:
                bad("tree_width", f"x num_speculative_tokens must be fewer than {MAX_TREE_TOKENS} (the tree's nodes "
                                  f"and the token before them), got {d['tree_width']} x {k}")
        elif d.get("tree_width", 1) != 1 and d["method"] != "medusa":
            bad("tree_width", "applies to methods ngram, draft_model, medusa and eagle only")
        limit = d.get("disable_by_batch_size")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            bad("disable_by_batch_size", f"must be an integer >= 1 or None, got {limit!r}")
        return cls(**d)


def medusa_choices(value, bad) -> tuple[tuple[int, ...], ...]:
    """Medusa's tree format checked: distinct non-empty paths of ranks >= 0, each path's parent present, fewer
    than MAX_TREE_TOKENS of them."""
    try:
        paths = tuple(tuple(p) for p in value)
    except TypeError:
        paths = None
    if not paths or not all(p and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)
                            for p in paths):
        bad("medusa_choices", f"must be a non-empty list of paths of head ranks (lists of integers >= 0), got {value!r}")
    if len(set(paths)) != len(paths) or len(paths) >= MAX_TREE_TOKENS:
        bad("medusa_choices", f"must hold distinct paths, fewer than {MAX_TREE_TOKENS}, got {len(paths)}")
    orphan = next((p for p in paths if len(p) > 1 and p[:-1] not in paths), None)
    if orphan is not None:
        bad("medusa_choices", f"path {list(orphan)} has no parent path {list(orphan[:-1])}")
    if max(len(p) for p in paths) > MAX_SPECULATIVE_TOKENS:
        bad("medusa_choices", f"paths may be at most {MAX_SPECULATIVE_TOKENS} deep")
    return paths
