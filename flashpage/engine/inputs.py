"""A StepPlan as the flat device tensors a forward pass reads: token ids, positions, cache slots and the
AttentionMetadata, built on the host and uploaded in one asynchronous copy.

For a captured CUDA graph, the batch is padded to the graph's size (padding sequences have no keys and write no
cache slot), and in a verify step every sequence's tokens to the graph's query length; a verify graph that
serves token trees reads a query mask for every row.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from flashpage.engine.step import StepPlan
from flashpage.kernels.block_sparse import BlockChoice, BlockSparsePattern, SplitBatch
from flashpage.kernels.tree import tree_mask
from flashpage.kv import slot
from flashpage.model import AttentionMetadata
from flashpage.model.attention import DecodeSplit


_ARRAY_TYPES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, copied asynchronously from pinned memory on CUDA. A flat list goes through
    `array.array` (torch.tensor converts a long list item by item, about six times slower: 1.9 against 0.3 ms for
    a step's 23,000 integers at 512 sequences)."""
    code = _ARRAY_TYPES.get(dtype)
    flat = code is not None and len(values) and not isinstance(values[0], (list, tuple))
    t = torch.frombuffer(array.array(code, values), dtype=dtype) if flat else torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


@dataclass
class StepInputs:
    ids: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_index: list[int]  # the rows of the hidden states that give logits, in plan order
    from_last_step: torch.Tensor  # [2 * k] int64: pairs (row of ids, row of the last step's sampled tokens)


def prepare_inputs(plan: StepPlan, block_size: int, device: torch.device, rows: int | None = None,
                   q_len: int | None = None, masked: bool = False,
                   pattern: BlockSparsePattern | None = None) -> StepInputs:
    """`rows` pads the batch to that many sequences; `q_len` pads every sequence's tokens to that many (a verify
    step's CUDA graph). Padding goes in front: padding tokens take the positions just before the sequence's own
    (whose keys are in the cache, so they never read an unwritten slot), write no slot and give no logits.
    `masked`: a query mask for every row even where no sequence is a tree (a graph captured with one).
    `pattern`: a block-sparse pattern the prompt chunks follow (`meta.block_sparse`; an eager step's)."""
    seqs = plan.seqs
    rows = rows or len(seqs)
    tokens, positions, slots, cu, seq_lens, logits_index, deferred = [], [], [], [0], [], [], []
    for s in seqs:
        n = len(s.token_ids)
        pad = q_len - n if q_len else 0
        if s.last_token_from_row is not None:
            deferred += [len(tokens) + pad + n - 1, s.last_token_from_row]
        tokens += [0] * pad + s.token_ids
        positions += [max(0, s.positions[0] - pad + i) for i in range(pad)] + s.positions
        # (a token tree's tokens take consecutive slots, whatever their positions)
        places = range(s.positions[0], s.positions[0] + n) if s.tree else s.positions
        slots += [-1] * pad + [slot(s.block_table, p, block_size) for p in places]
        cu.append(cu[-1] + n + pad)
        seq_lens.append(places[-1] + 1)
        logits_index += range(cu[-1] - s.num_logits, cu[-1])
    padding = rows - len(seqs)
    per_row = q_len or 1
    tokens += [0] * (padding * per_row)
    positions += [0] * (padding * per_row)
    slots += [-1] * (padding * per_row)
    seq_lens += [0] * padding
    cu += range(cu[-1] + per_row, cu[-1] + per_row * (padding + 1), per_row)
    width = max(len(s.block_table) for s in seqs)
    table = [b for s in seqs for b in s.block_table + [0] * (width - len(s.block_table))] + [0] * (padding * width)
    n = len(tokens)
    # A mixed step's leading decoding sequences attend apart from the rest (DecodeSplit), unless a block-sparse
    # pattern makes the step's view.
    decoding = 0 if padding or q_len or pattern is not None else next(
        (i for i, s in enumerate(seqs) if len(s.token_ids) != 1), len(seqs))
    packed = upload(tokens + positions + slots + seq_lens + cu + table + deferred, torch.int64, device)
    ids, positions_t, slots_t, lens_t, cu_t, table_t, deferred_t = packed.split(
        [n, n, n, rows, rows + 1, rows * width, len(deferred)])
    cu_t, lens_t, table_t = cu_t.int(), lens_t.int(), table_t.int().view(rows, width)
    meta = AttentionMetadata(cu_t, lens_t, q_len or max(len(s.token_ids) for s in seqs), positions_t,
                             slots_t, table_t)
    if masked or any(s.tree for s in seqs):  # token trees: their rows' bits; every other row sees causally (-1)
        bits = []
        for s in seqs:
            pad = q_len - len(s.token_ids) if q_len else 0
            bits += [-1] * pad + (tree_mask(s.tree, pad) if s.tree else [-1] * len(s.token_ids))
        meta.query_mask = upload(bits + [-1] * (padding * per_row), torch.int64, device)
    if 0 < decoding < len(seqs):
        # (the rest gets its own upload, not views of the step's tensors: a view's 16-byte alignment would follow
        # the number of decoding sequences, and Triton compiles a kernel again for each)
        rest = seqs[decoding:]
        rest_meta = paged_view([len(s.token_ids) for s in rest], seq_lens[decoding:], [s.block_table for s in rest],
                               device)
        if meta.query_mask is not None:
            rest_meta.query_mask = meta.query_mask[decoding:].clone()
        meta.decode_split = DecodeSplit(decoding, AttentionMetadata(
            cu_t[:decoding + 1], lens_t[:decoding], 1, positions=None, block_table=table_t[:decoding]), rest_meta)
    if pattern is not None and any(len(s.token_ids) > 1 for s in seqs):  # (decoding alone stays dense)
        split = pattern.split([len(s.token_ids) for s in seqs], seq_lens, [s.block_table for s in seqs], block_size)
        meta.block_sparse = block_sparse_view(pattern, split, device)
    return StepInputs(ids, meta, logits_index, deferred_t)


def paged_view(q_lens: list[int], k_lens: list[int], tables: list[list[int]], device: torch.device
               ) -> AttentionMetadata:
    """The paged attention metadata of sequences (queries, keys, block table) alone: cu_seqlens_q, seq_lens_k,
    max_seqlen_q and the block table, padded to its longest row. One upload, each part starting 16 bytes into it
    whatever the sizes: Triton specializes a kernel on its pointers' 16-byte alignment, so a part at an offset
    that followed the batch would compile kernels again mid-run."""
    width = max(map(len, tables))
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    parts = [cu, k_lens, [b for t in tables for b in t + [0] * (width - len(t))]]
    padded = [p + [0] * (-len(p) % 4) for p in parts]
    packed = upload([v for p in padded for v in p], torch.int32, device)
    cu_t, lens_t, table_t = (t[:len(p)] for t, p in zip(packed.split([len(p) for p in padded]), parts))
    return AttentionMetadata(cu_t, lens_t, max(q_lens), positions=None, block_table=table_t.view(len(tables), width))


def block_sparse_view(pattern: BlockSparsePattern, split: SplitBatch, device: torch.device) -> AttentionMetadata:
    """`paged_view` of a pattern's split, with the blocks its layers choose (`block_choice`) where it has any."""
    view = paged_view(split.q_lens, split.k_lens, split.tables, device)
    if split.choices:
        view.block_choice = BlockChoice.of(split, pattern, lambda values, dtype: upload(values, dtype, device))
    return view
