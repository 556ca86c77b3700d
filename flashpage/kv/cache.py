"""KVCache: one layer's paged key/value cache, made by one factory and handed whole to the attention kernels.

A cache is blocks of `block_size` token slots: `k` and `v` are `[num_blocks, block_size, num_kv_heads, head_dim]`
in the layout the kernels read (NHD within a block). Its storage dtype and scales live here:
- the model's dtype (`kv_cache_dtype="auto"`): no scales;
- FP8 (e4m3): one float32 scale per KV head, `k_scale`/`v_scale` [num_kv_heads], value = stored * scale; 1.0
  unless the checkpoint gives them (vLLM's `self_attn.k_scale`/`v_scale`); values past +-448 * scale saturate.
  Unless the checkpoint gives the keys' scales (which hold for keys as they are), the keys are stored rotated
  (`keys_rotated`): rotary embedding is followed by the orthogonal `reference.key_rotation`, applied to the
  queries too, so q.k is unchanged. A few channels carry most of a key's magnitude and of q.k; spread over all
  of them, each is rounded to e4m3 with an error relative to a smaller share: SmolLM2's perplexity cost went
  from +1.13% to +0.63% (docs/kernel-notes.md);
- INT8: one float32 scale per token and KV head, `k_scale`/`v_scale` [num_blocks, num_kv_heads, block_size] (a
  page's scales of one head side by side, as the decode reads them), chosen as each token is written: its largest
  magnitude over the head / 127 (symmetric, round to nearest).

A cache for SparQ attention (`sparse_attention={"method": "sparq", ...}`) keeps two more things per block:
`k_t` [num_blocks, num_kv_heads, head_dim, block_size], the keys again, component-major, so that reading r
components of every key reads r runs of block_size contiguous values instead of r scattered pieces of every key's
row (which costs as much as reading the whole row: the GPU reads memory in 32-byte sectors). It is stored in FP8
(e4m3) whatever the cache's dtype: it only ranks keys, and at the bytes of r 16-bit components it holds 2r
(SmolLM2 at 1/8 of the bytes and 4,096 tokens: +2.5% perplexity against +4.3%, docs/sparse-attention.md); and
`v_cumsum` [num_blocks, num_kv_heads, head_dim] float32, the sum of the sequence's values up to the block's last
written slot, so that SparQ's mean value is one read per sequence. Both are written with the keys (`write_sparq_copies`).
`k_t` holds the keys turned by `sparq_basis` [num_kv_heads, head_dim, head_dim] (None: as they are), and the
queries are turned by `sparq_query_basis` (its inverse transpose, so that q.k is kept; None: `sparq_basis` itself,
for an orthonormal one); there SparQ chooses its components. The engine's are the principal axes of each layer's
keys, scaled (`flashpage.engine.sparse.sparq_turns`).
With `"key_bits": 4`, `k_t` holds two keys a byte instead [num_blocks, num_kv_heads, head_dim, block_size / 2]
(uint8; a block's first half of keys in the low nibbles, its second half in the high ones, so that the kernels
read each half as a tile with no shuffle), each component a 4-bit code c, the value (c - 8) times its key's
scale (`reference.int4_keys`), `k_t_scale` [num_blocks, num_kv_heads, block_size] e4m3 (the smallest that holds
the key's largest component within 7: nothing clips): at the bytes of r e4m3 components, about 2r - 2.
With `"value_axes": m`, a third extra: `v_t` [num_blocks, num_kv_heads, block_size, m] e4m3, each value's
coordinates along the layer's m principal axes of its values, `sparq_value_axes` [num_kv_heads, head_dim, m],
divided by the values' RMS along each, `sparq_value_rms` [num_kv_heads, m] (both float32): the unchosen keys'
share of SparQ's output comes from them (`reference.sparq_attention`). Token-major, unlike `k_t`: every step reads
all m of every key's, and gathers the chosen keys' m (one run each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashpage.kernels.fp8 import FP8

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
SPARQ_COPY_DTYPE = FP8  # SparQ's component copy `k_t`: turned keys past +-FP8_MAX are stored saturated
SPARQ_KEY_BITS = (8, 4)  # its components' bits: e4m3, or int4 with a scale per key (`k_t_scale`)
# the one block size the 4-bit copy is served at: at 16, 32 and 128 the Triton writer stored wrong codes and scales
# on an H200 (not in the interpreter; docs/sparse-attention.md)
SPARQ_4BIT_BLOCK = 64


@dataclass
class KVCache:
    k: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # dequantisation scales of a quantized cache (above); None in the model's dtype
    v_scale: torch.Tensor | None = None
    k_t: torch.Tensor | None = None  # SparQ: the keys, component-major [num_blocks, num_kv_heads, head_dim, block_size]
    v_cumsum: torch.Tensor | None = None  # SparQ: running value sums [num_blocks, num_kv_heads, head_dim]
    keys_rotated: bool = False  # FP8: keys (and the queries that meet them) rotated as they are written (above)
    sparq_basis: torch.Tensor | None = None  # SparQ: the keys' turn into k_t [num_kv_heads, head_dim, head_dim]
    sparq_query_basis: torch.Tensor | None = None  # SparQ: the queries' turn (None: sparq_basis's)
    v_t: torch.Tensor | None = None  # SparQ with value axes: coordinates [num_blocks, num_kv_heads, block_size, m]
    sparq_value_axes: torch.Tensor | None = None  # SparQ: the values' principal axes [num_kv_heads, head_dim, m]
    sparq_value_rms: torch.Tensor | None = None  # SparQ: the values' RMS along each [num_kv_heads, m]
    k_t_scale: torch.Tensor | None = None  # SparQ, 4-bit copy: each key's scale [num_blocks, num_kv_heads, block_size]

    @property
    def sparq_query_turn(self) -> torch.Tensor | None:
        """The queries' SparQ turn: `sparq_query_basis`, or `sparq_basis` where that is orthonormal (none set)."""
        return self.sparq_basis if self.sparq_query_basis is None else self.sparq_query_basis

    def __post_init__(self):
        if self.k.dtype in KV_CACHE_DTYPES.values():
            blocks, page, heads, _ = self.k.shape
            want = (blocks, heads, page) if self.scaled_per_token else (heads,)
            for scale in (self.k_scale, self.v_scale):
                if scale is None or scale.shape != want or scale.dtype != torch.float32 or not scale.is_contiguous():
                    raise ValueError(f"a {self.k.dtype} cache needs contiguous float32 scales of shape {tuple(want)}")
        if self.keys_rotated and self.k.dtype != KV_CACHE_DTYPES["fp8"]:
            raise ValueError("only an FP8 cache stores its keys rotated")
        if (self.k_t is None) != (self.v_cumsum is None):
            raise ValueError("a SparQ cache needs both k_t and v_cumsum")
        if self.k_t is not None:
            blocks, page, heads, dim = self.k.shape
            packed = self.k_t_scale is not None
            want = (blocks, heads, dim, page // 2 if packed else page), torch.uint8 if packed else SPARQ_COPY_DTYPE
            if (self.k_t.shape, self.k_t.dtype) != want or self.v_cumsum.shape != (blocks, heads, dim) or \
                    self.v_cumsum.dtype != torch.float32:
                raise ValueError(f"a SparQ cache needs k_t {want[0]} {want[1]} and v_cumsum {(blocks, heads, dim)} "
                                 "float32")
            if packed and (self.k_t_scale.shape != (blocks, heads, page) or self.k_t_scale.dtype != FP8 or
                           page != SPARQ_4BIT_BLOCK):
                raise ValueError(f"a 4-bit SparQ copy needs k_t_scale {(blocks, heads, page)} float8_e4m3fn and blocks "
                                 f"of {SPARQ_4BIT_BLOCK}")
        if self.v_t is not None:
            blocks, page, heads, _ = self.k.shape
            if self.v_t.shape[:3] != (blocks, heads, page) or self.v_t.dtype != FP8 or \
                    self.sparq_value_axes is None or self.sparq_value_rms is None:
                raise ValueError(f"a SparQ cache's v_t is float8_e4m3fn {(blocks, heads, page, 'm')}, with its "
                                 "sparq_value_axes and sparq_value_rms")

    @property
    def sparq_key_bits(self) -> int:
        """SparQ: the bits of a component in its key copy `k_t` (8: e4m3; 4: int4 with a scale per key)."""
        return 8 if self.k_t_scale is None else 4

    @property
    def value_axes(self) -> int:
        """SparQ: the values' axes its copy `v_t` holds coordinates along (0: none, the mean value)."""
        return 0 if self.v_t is None else self.v_t.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def scaled_per_token(self) -> bool:
        """INT8: each slot has its own scales, which move with its block (copy-on-write copies them)."""
        return self.k.dtype == torch.int8

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Blocks src -> dst (copy-on-write), an INT8 cache's scales along; as bytes (CUDA indexes no FP8 tensor)."""
        per_slot = (self.k_scale, self.v_scale) if self.scaled_per_token else ()
        sparq = (self.k_t.view(torch.uint8), self.v_cumsum) if self.k_t is not None else ()
        sparq += tuple(c.view(torch.uint8) for c in (self.v_t, self.k_t_scale) if c is not None)
        for c in (self.k.view(torch.uint8), self.v.view(torch.uint8), *per_slot, *sparq):
            c[dst] = c[src]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Token slots (block * block_size + offset) src -> dst, an INT8 cache's scales along."""
        for c in (self.k.view(torch.uint8), self.v.view(torch.uint8)):
            flat = c.view(-1, *c.shape[2:])
            flat[dst] = flat[src]
        if self.scaled_per_token:  # [blocks, heads, block_size]
            page = self.block_size
            for s in (self.k_scale, self.v_scale):
                s[dst // page, :, dst % page] = s[src // page, :, src % page]


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       sparq: bool = False, value_axes: int = 0, key_bits: int = 8) -> int:
    """Bytes one block takes over all layers, K and V (with an INT8 cache's per-token scales, a SparQ cache's
    second copy of K in `key_bits` a component (and 4-bit keys' scales), value sums and values' coordinates)."""
    scales = 4 if dtype == torch.int8 else 0
    per_layer = 2 * block_size * num_kv_heads * (head_dim * dtype.itemsize + scales)
    if sparq:
        per_layer += num_kv_heads * head_dim * (block_size * key_bits // 8 + 4)
        per_layer += num_kv_heads * block_size * (key_bits == 4)
        per_layer += num_kv_heads * value_axes * block_size * SPARQ_COPY_DTYPE.itemsize
    return num_layers * per_layer


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device, sparq: bool = False,
                       value_axes: int = 0, key_bits: int = 8) -> list[KVCache]:
    """Each layer's cache; `sparq`: with SparQ's extras (`value_axes` > 0: its copy of the values' coordinates
    too, whose axes and RMS the caller sets; `key_bits` 4: its key copy in int4 with a scale per key)."""
    if key_bits not in SPARQ_KEY_BITS or (key_bits == 4 and block_size != SPARQ_4BIT_BLOCK):
        raise ValueError(f"SparQ's key copy holds 8 or 4 bits a component (4: at block_size {SPARQ_4BIT_BLOCK}), got "
                         f"{key_bits} bits with block_size {block_size}")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def scales():
        if dtype == torch.int8:
            return torch.empty(num_blocks, num_kv_heads, block_size, dtype=torch.float32, device=device)
        if dtype == torch.float8_e4m3fn:
            return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
        return None

    def sparq_copies():  # (k_t, v_cumsum, and a 4-bit copy's scales)
        if not sparq:
            return {}
        per_byte = 8 // key_bits
        return {"k_t": torch.empty(num_blocks, num_kv_heads, head_dim, block_size // per_byte, device=device,
                                   dtype=SPARQ_COPY_DTYPE if key_bits == 8 else torch.uint8),
                "v_cumsum": torch.zeros(num_blocks, num_kv_heads, head_dim, dtype=torch.float32, device=device),
                "k_t_scale": torch.empty(num_blocks, num_kv_heads, block_size, dtype=FP8, device=device)
                if key_bits == 4 else None}

    def value_coordinates():  # (v_t, its axes, their RMS: zeros and ones until the caller sets them)
        if not (sparq and value_axes):
            return {}
        return {"v_t": torch.empty(num_blocks, num_kv_heads, block_size, value_axes, dtype=SPARQ_COPY_DTYPE,
                                   device=device),
                "sparq_value_axes": torch.zeros(num_kv_heads, head_dim, value_axes, device=device),
                "sparq_value_rms": torch.ones(num_kv_heads, value_axes, device=device)}

    return [KVCache(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device),
                    scales(), scales(), keys_rotated=dtype == torch.float8_e4m3fn, **sparq_copies(),
                    **value_coordinates()) for _ in range(num_layers)]
