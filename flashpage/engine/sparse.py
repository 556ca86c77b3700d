"""SparseAttentionConfig: the `sparse_attention` setting (opt-in, lossy), checked once before anything runs.

- `{"method": "sparq", "r": 16, "k": 256}`: SparQ attention for decode (`flashpage.kernels.reference.
  sparq_attention`): each decoded token reads r components of every cached key, then k whole keys and values.
  `"prompt": true` applies it to the prompt's tokens too, as if each were decoded in turn (how the quality table
  scores it; the CPU and PyTorch kernels only). `"basis": "pca"` (the default) chooses the components in each
  layer's and KV head's principal axes of its keys, each query component weighed by the keys' spread along its
  axis (`sparq_turns`), measured as the engine starts on CALIBRATION_TOKENS tokens of real text; `"none"` in the
  keys' own components, as the paper does. `"value_axes": m` (0 by default: the paper's mean value) gives the
  softmax mass of the keys not chosen to their own values, each seen along the layer's m principal axes of its
  values (`principal_value_axes`, from the same calibration text) and weighed by its approximate probability, instead of
  to the mean of all values; it reads m more bytes of every key (docs/sparse-attention.md). `"recent": n` (0 by
  default, as the paper) makes the last n keys always among the k chosen, whatever their approximate scores: the
  same bytes, and at 1k-2k tokens about half a point less perplexity cost (docs/sparse-attention.md). `"key_bits":
  4` (8 by default: e4m3) keeps the copy of the keys that the approximate scores read in 4 bits a component (-7 to
  7 times a one-byte scale per key: `kv.cache`), so that r components cost r / 2 + 1 bytes of every key.
- `{"method": "block", "block": 64, "sink": 1, "local": 16, "stride": 0}`: block-sparse prefill
  (`flashpage.kernels.block_sparse`): prompt chunks attend by a static pattern of blocks of positions (sinks, a
  window, vertical lines); the attention kernels read only the cache pages of the blocks a query block sees;
  decoding stays dense. `"density": 0.25` (instead of lines) adds the key blocks each KV head's queries attend to
  most, chosen per layer from every `"sample"`-th query's attention, up to that share of the causal blocks
  (`"sample_heads": "one"`: each sampled query in one of its group's heads, in turn: a group-size times cheaper
  estimate).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from pathlib import Path

import torch

from flashpage.errors import DictSetting, ParameterError
from flashpage.kernels.block_sparse import BlockSparsePattern
from flashpage.kv.cache import SPARQ_4BIT_BLOCK, SPARQ_COPY_DTYPE, SPARQ_KEY_BITS

METHODS = {"sparq": ("r", "k", "prompt", "basis", "value_axes", "recent", "key_bits"),
           "block": ("block", "sink", "local", "stride", "density", "sample", "sample_heads")}
SAMPLE_HEADS = ("all", "one")
BASES = ("pca", "none")
MAX_VALUE_AXES = 16  # (the exact attention keeps a sum per head, chosen key of its tile and axis in registers)

# The text whose keys give SparQ's bases: the standard library's own source (any CPython 3.11+ has it), not the
# documentation that `bench quality --sparse` scores, so the measured cost is not that of text seen here.
CALIBRATION_MODULES = ("textwrap", "string", "shlex", "csv", "json.decoder", "json.encoder")
CALIBRATION_TOKENS = 4096


@dataclass(frozen=True)
class SparseAttentionConfig:
    method: str
    r: int | None = None  # sparq: query components that approximate the scores (1..head_dim)
    k: int | None = None  # sparq: keys attended exactly per decoded token and KV head (>= 1)
    prompt: bool = False  # sparq: the prompt's tokens too (CPU / PyTorch kernels)
    basis: str = "pca"  # sparq: where components are chosen: the keys' principal axes, or "none" (the keys' own)
    value_axes: int = 0  # sparq: the unchosen keys' values seen along this many principal axes (0: the mean value)
    recent: int = 0  # sparq: the last keys always among the k chosen (0..k)
    key_bits: int = 8  # sparq: bits of a component in the copy of the keys the approximate scores read (8 or 4)
    block: int = 64  # block: positions per block (a multiple of 64)
    sink: int = 1  # block: first blocks every query sees
    local: int = 16  # block: the window, in blocks, the query's own included (>= 1)
    stride: int = 0  # block: every stride-th block a vertical line every query sees (0: none)
    density: float = 0.0  # block: > 0: chosen key blocks too, up to this share of each query block's causal blocks
    sample: int = 8  # block, with density: every sample-th query estimates which key blocks its block attends to
    sample_heads: str = "all"  # block, with density: each sampled query in all its group's heads, or "one" (in turn)

    @property
    def pattern(self) -> BlockSparsePattern | None:
        """The block method's pattern (None for SparQ)."""
        if self.method != "block":
            return None
        return BlockSparsePattern(self.block, self.sink, self.local, self.stride, self.density, self.sample,
                                  self.sample_heads == "one")

    @classmethod
    def from_dict(cls, d: dict) -> SparseAttentionConfig:
        setting = DictSetting("sparse_attention", d, [f.name for f in dataclasses.fields(cls)])
        bad, integer = setting.bad, setting.integer
        method = d.get("method")
        if method not in METHODS:
            bad("method", f"must be one of {', '.join(METHODS)}, got {method!r}")
        other = sorted(set(d) - {"method", *METHODS[method]})
        if other:
            bad(other[0], f"does not apply to method {method} (its keys: {', '.join(METHODS[method])})")

        if method == "sparq":
            integer("r", 1)
            integer("k", 1)
            integer("value_axes", 0, cls.value_axes)
            if d.get("value_axes", 0) > MAX_VALUE_AXES:
                bad("value_axes", f"must be at most {MAX_VALUE_AXES}, got {d['value_axes']}")
            integer("recent", 0, cls.recent)
            if d.get("recent", 0) > d["k"]:
                bad("recent", f"must be at most k ({d['k']}): they are among the k keys chosen, got {d['recent']}")
            integer("key_bits", 1, cls.key_bits)
            if d.get("key_bits", cls.key_bits) not in SPARQ_KEY_BITS:
                bad("key_bits", f"must be 8 (e4m3) or 4 (int4 with a scale per key), got {d['key_bits']!r}")
            if not isinstance(d.get("prompt", False), bool):
                bad("prompt", f"must be true or false, got {d['prompt']!r}")
            if d.get("basis", cls.basis) not in BASES:
                bad("basis", f"must be one of {', '.join(BASES)}, got {d['basis']!r}")
        else:
            integer("block", 64, cls.block)
            if d.get("block", cls.block) % 64:
                bad("block", f"must be a multiple of 64 (the kernels' key tile), got {d['block']}")
            integer("sink", 0, cls.sink)
            integer("local", 1, cls.local)  # (0 would leave a query with no key, not even itself)
            integer("stride", 0, cls.stride)
            if d.get("stride", 0) == 1:
                bad("stride", "1 would make every block a line: use dense attention (0: no lines, or >= 2)")
            density = d.get("density", cls.density)
            if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 <= density <= 1:
                bad("density", f"must be a number in [0, 1] (0: a fixed pattern), got {density!r}")
            integer("sample", 1, cls.sample)
            if d.get("sample_heads", cls.sample_heads) not in SAMPLE_HEADS:
                bad("sample_heads", f"must be one of {', '.join(SAMPLE_HEADS)}, got {d['sample_heads']!r}")
            if density and d.get("stride", 0):
                bad("density", "and stride do not go together: chosen blocks take the lines' place")
            for key in ("sample", "sample_heads"):
                if key in d and not density:
                    bad(key, "applies with density only (how the chosen key blocks are estimated)")
        return cls(**d)

    def check_serves(self, *, head_dim: int, kernels: str, kv_cache_dtype: str, speculative: bool,
                     block_size: int, sliding_window: int | None) -> None:
        """Raises ParameterError for a setting this engine cannot serve with sparse attention."""
        for name in ("r", "value_axes") if self.method == "sparq" else ():
            if getattr(self, name) > head_dim:
                raise ParameterError(f"sparse_attention.{name}", f"sparse_attention: {name} must be at most the "
                                     f"head dimension ({head_dim}), got {getattr(self, name)}")
        if self.method == "sparq" and self.key_bits == 4 and block_size != SPARQ_4BIT_BLOCK:
            raise ParameterError("sparse_attention.key_bits", f"sparse_attention: key_bits 4 is served at block_size "
                                 f"{SPARQ_4BIT_BLOCK} (SparQ's default) only, got {block_size}")
        if self.method == "block" and self.block % block_size:
            raise ParameterError("sparse_attention.block", f"sparse_attention: block must be a multiple of the "
                                 f"cache's block_size ({block_size}), got {self.block}")
        for name, unserved in (("speculative_config", speculative), ("kv_cache_dtype", kv_cache_dtype != "auto"),
                               ("deterministic", kernels == "batch_invariant"),
                               ("model", sliding_window is not None)):
            if unserved:
                what = "a sliding-window model" if name == "model" else f"{name}"
                raise ParameterError("sparse_attention", f"sparse_attention is not served with {what} (yet)")
        if self.prompt and kernels == "triton":
            raise ParameterError("sparse_attention.prompt", "sparse_attention: prompt=true runs on the CPU and "
                                 "PyTorch kernels only (kernels='cpu' or 'torch')")


def calibration_ids(tokenizer, vocab_size: int, n: int) -> list[int]:
    """n tokens of CALIBRATION_MODULES' source; random ids where the model has no tokenizer (dummy weights)."""
    if tokenizer is None:
        return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    text = "".join(Path(importlib.import_module(m).__file__).read_text() for m in CALIBRATION_MODULES)
    return tokenizer.encode(text[:8 * n])[:n]  # (code is 3-4 characters a token)


def key_bases(keys: torch.Tensor) -> torch.Tensor:
    """Per KV head, the principal axes of keys [T, Hkv, D] (after RoPE, as cached), largest second moment first:
    the eigenvectors of K^T K as the columns of an orthonormal basis, float32 [Hkv, D, D]. In it a few components
    carry most of a key, and SparQ's r largest components of the query find more of q.k (on SmolLM2 at 1/8 of the
    bytes: docs/sparse-attention.md)."""
    k = keys.double().transpose(0, 1)  # [Hkv, T, D]
    _, vectors = torch.linalg.eigh(k.transpose(1, 2) @ k)  # ascending eigenvalues
    return vectors.flip(-1).float().contiguous()


AXIS_WEIGHT = 0.5  # the power of the keys' RMS that weighs each axis (SmolLM2: docs/sparse-attention.md)


def sparq_turns(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SparQ's default turns for keys [T, Hkv, D], float32 [Hkv, D, D]: the keys' P diag(1/w) and the queries'
    P diag(w), P the principal axes (`key_bases`), w_i the keys' RMS along axis i to the power AXIS_WEIGHT. Then
    q''.k'' = q.k, and the r largest |q''_i| = |q'_i| w_i weigh each of the query's components by how large keys are
    along its axis: by |q'_i| alone, a large component where keys are small is chosen and finds little of q.k."""
    axes = key_bases(keys)
    rms = torch.einsum("thd,hde->the", keys.float(), axes).pow(2).mean(0).sqrt()  # [Hkv, D]
    w = rms.clamp_min(1e-3 * rms.amax(-1, keepdim=True)).pow(AXIS_WEIGHT)
    return (axes / w[:, None, :]).contiguous(), (axes * w[:, None, :]).contiguous()


def principal_value_axes(values: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, the m principal axes of values [T, Hkv, D] (of their spread about their mean, largest first),
    float32 [Hkv, D, m], and the values' RMS along each, float32 [Hkv, m] (SparQ's copy of the values' coordinates
    divides by it, so that e4m3 holds them at the scale of one)."""
    v = values.double().transpose(0, 1)  # [Hkv, T, D]
    centred = v - v.mean(1, keepdim=True)
    _, vectors = torch.linalg.eigh(centred.transpose(1, 2) @ centred)  # ascending eigenvalues
    axes = vectors.flip(-1)[..., :m]
    rms = (v @ axes).pow(2).mean(1).sqrt()
    return axes.float().contiguous(), rms.clamp_min(1e-6 * rms.amax().clamp_min(1e-30)).float().contiguous()


@dataclass
class SparseStats:
    """What sparse attention read, summed over the queries it served (each layer alike): keys attended (exactly)
    against the keys dense attention would have, and bytes read against dense attention's K and V (SparQ: r bytes
    of every key's 2 * head_dim * key_bytes for the approximate scores, its copy being one byte a component (with
    key_bits 4, half a byte, and a byte of the key's scale), plus the chosen keys and values; with value_axes m, m
    more bytes of every key and of every chosen one)."""
    config: SparseAttentionConfig
    head_dim: int
    key_bytes: int  # bytes of one element of the cache's K
    keys_visible: int = 0
    keys_attended: int = 0

    def record(self, steps) -> None:
        """A step's sequences (SeqStep): the queries sparse attention served in it."""
        c = self.config
        if c.method == "sparq":
            contexts = [p + 1 for s in steps for p in s.positions if c.prompt or len(s.token_ids) == 1]
            self.keys_visible += sum(contexts)
            self.keys_attended += sum(min(c.k, n) for n in contexts)
            return
        positions = torch.tensor([p for s in steps if len(s.token_ids) > 1 for p in s.positions], dtype=torch.int64)
        self.keys_visible += int((positions + 1).sum())
        self.keys_attended += int(c.pattern.keys_seen(positions).sum())

    def as_dict(self) -> dict:
        visible = max(self.keys_visible, 1)
        approx = 0.0  # (SparQ's r components of every key, from its copy)
        if self.config.method == "sparq":
            dense = 2 * self.head_dim * self.key_bytes
            m = self.config.value_axes * SPARQ_COPY_DTYPE.itemsize
            copy = self.config.r * SPARQ_COPY_DTYPE.itemsize if self.config.key_bits == 8 else self.config.r / 2 + 1
            approx = (copy + m) / dense * self.keys_visible
            approx += m / dense * self.keys_attended
        return {"sparse_attention_keys_fraction": self.keys_attended / visible,
                "sparse_attention_bytes_fraction": (approx + self.keys_attended) / visible}
