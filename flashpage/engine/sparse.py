"""SparseAttentionConfig: the `sparse_attention` setting (opt-in, lossy), checked once before anything runs.

- `{"method": "sparq", "r": 16, "k": 256}`: SparQ attention for decode (`flashpage.kernels.reference.
  sparq_attention`): each decoded token reads r components of every cached key, then k whole keys and values.
  `"prompt": true` applies it to the prompt's tokens too, as if each were decoded in turn (how the quality table
  scores it; the CPU and PyTorch kernels only).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flashpage.errors import ParameterError

METHODS = ("sparq",)


@dataclass(frozen=True)
class SparseAttentionConfig:
    method: str
    r: int  # sparq: query components that approximate the scores (1..head_dim)
    k: int  # sparq: keys attended exactly per decoded token and KV head (>= 1)
    prompt: bool = False  # sparq: the prompt's tokens too (CPU / PyTorch kernels)

    @classmethod
    def from_dict(cls, d: dict) -> SparseAttentionConfig:
        def bad(key, why):
            raise ParameterError(f"sparse_attention.{key}", f"sparse_attention: {key} {why}")

        if not isinstance(d, dict):
            raise ParameterError("sparse_attention", f"sparse_attention must be a dict, got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            bad(unknown[0], f"is not a known key (known: {', '.join(sorted(known))})")
        if d.get("method") not in METHODS:
            bad("method", f"must be one of {', '.join(METHODS)}, got {d.get('method')!r}")
        for key in ("r", "k"):
            v = d.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(key, f"must be an integer >= 1, got {v!r}")
        if not isinstance(d.get("prompt", False), bool):
            bad("prompt", f"must be true or false, got {d['prompt']!r}")
        return cls(**d)

    def check_serves(self, *, head_dim: int, kernels: str, kv_cache_dtype: str, speculative: bool,
                     sliding_window: int | None) -> None:
        """Raises ParameterError for a setting this engine cannot serve with sparse attention."""
        if self.r > head_dim:
            raise ParameterError("sparse_attention.r", f"sparse_attention: r must be at most the head dimension "
                                 f"({head_dim}), got {self.r}")
        for name, unserved in (("speculative_config", speculative), ("kv_cache_dtype", kv_cache_dtype != "auto"),
                               ("deterministic", kernels == "batch_invariant"),
                               ("model", sliding_window is not None)):
            if unserved:
                what = "a sliding-window model" if name == "model" else f"{name}"
                raise ParameterError("sparse_attention", f"sparse_attention is not served with {what} (yet)")
        if self.prompt and kernels == "triton":
            raise ParameterError("sparse_attention.prompt", "sparse_attention: prompt=true runs on the CPU and "
                                 "PyTorch kernels only (kernels='cpu' or 'torch')")


@dataclass
class SparseStats:
    """What sparse attention read, summed over the queries it served (each layer alike): keys attended exactly
    against keys visible, and bytes read against dense attention's K and V (r / (2 head_dim) of every key's bytes
    for the approximate scores, plus the chosen keys and values)."""
    config: SparseAttentionConfig
    head_dim: int
    keys_visible: int = 0
    keys_attended: int = 0

    def record(self, contexts: list[int]) -> None:
        """Queries that saw these numbers of keys."""
        self.keys_visible += sum(contexts)
        self.keys_attended += sum(min(self.config.k, c) for c in contexts)

    def as_dict(self) -> dict:
        visible = max(self.keys_visible, 1)
        approx = self.config.r / (2 * self.head_dim) * self.keys_visible
        return {"sparse_attention_keys_fraction": self.keys_attended / visible,
                "sparse_attention_bytes_fraction": (approx + self.keys_attended) / visible}
