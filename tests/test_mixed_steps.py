"""A mixed step, decoding sequences first and prompt chunks after them (as the scheduler orders a step):
`prepare_inputs` hands the leading decoding rows to the decode kernel apart from the prefill (`DecodeSplit`), and
attention through the split equals the reference's attention of the whole step in one call."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from conftest import DEVICE, rel_err
from flashpage.engine.inputs import prepare_inputs
from flashpage.engine.step import SeqStep, StepPlan
from flashpage.kernels import kernel_set
from flashpage.kernels import reference as ref
from flashpage.kv import KVCache
from flashpage.model import attention as attention_module
from test_kernels import TOL
from test_kv_quantized import DTYPES

PAGE, HQ, HKV, DIM = 16, 6, 2, 64
# (keys after the step, tokens the step computes): three decoding sequences (one of them a one-token prompt), a
# prompt chunk over a cached prefix, a fresh prompt, and a decoding sequence after them (which stays in the rest)
STEP = [(37, 1), (16, 1), (1, 1), (45, 25), (30, 30), (9, 1)]


def mixed_step() -> StepPlan:
    blocks = list(range(sum(-(-n // PAGE) for n, _ in STEP) + 2))
    random.Random(0).shuffle(blocks)
    plan = StepPlan()
    for i, (keys, new) in enumerate(STEP):
        table = [blocks.pop() for _ in range(-(-keys // PAGE))]
        plan.add(SeqStep(i, [5] * new, list(range(keys - new, keys)), table, num_logits=1))
    return plan


def cache_of(kind: str, num_blocks: int, dtype) -> KVCache:
    """Every slot written with random keys and values (the cached prefixes), quantized as `kind` says."""
    shape = (num_blocks, PAGE, HKV, DIM)
    if kind == "auto":
        cache = KVCache(torch.empty(shape, dtype=dtype, device=DEVICE), torch.empty(shape, dtype=dtype, device=DEVICE))
    else:
        scales = [torch.rand(HKV, device=DEVICE) + 0.02 if kind == "fp8" else
                  torch.empty(num_blocks, HKV, PAGE, device=DEVICE) for _ in range(2)]
        cache = KVCache(*(torch.empty(shape, dtype=DTYPES[kind], device=DEVICE) for _ in range(2)), *scales)
    k, v = (torch.randn(num_blocks * PAGE, HKV, DIM, device=DEVICE).to(dtype) for _ in range(2))
    ref.reshape_and_cache(k, v, cache, torch.arange(num_blocks * PAGE, device=DEVICE))
    return cache


def copy_of(cache: KVCache) -> KVCache:
    return dataclasses.replace(cache, **{f.name: getattr(cache, f.name).clone() for f in dataclasses.fields(cache)
                                         if isinstance(getattr(cache, f.name), torch.Tensor)})


@pytest.mark.parametrize("kernels", [pytest.param("cpu", marks=pytest.mark.skipif(
    DEVICE == "cuda", reason="the CPU kernel set serves CPU tensors")), "triton"])
@pytest.mark.parametrize("kind", ["auto", "fp8", "int8"])
def test_decode_split_equals_the_step_in_one_call(kernels, kind, monkeypatch):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    plan = mixed_step()
    meta = prepare_inputs(plan, PAGE, torch.device(DEVICE)).meta
    split = meta.decode_split
    assert split is not None and split.rows == 3
    assert split.rest.cu_seqlens_q.tolist() == [0, 25, 55, 56] and split.rest.max_seqlen_q == 30
    tokens = meta.positions.numel()
    q = torch.randn(tokens, HQ, DIM, device=DEVICE).to(dtype)
    k, v = (torch.randn(tokens, HKV, DIM, device=DEVICE).to(dtype) for _ in range(2))
    cos, sin = torch.ones(tokens, DIM, device=DEVICE, dtype=dtype), torch.zeros(tokens, DIM, device=DEVICE, dtype=dtype)
    cache = cache_of(kind, int(meta.block_table.max()) + 1, dtype)
    whole = dataclasses.replace(meta, decode_split=None)
    expected = attention_module.attention(ref, q.double(), k.double(), v.double(), cos.double(), sin.double(),
                                          copy_of(cache), whole, DIM ** -0.5, None)
    monkeypatch.setattr(torch, "empty_like", lambda x, **kw: torch.full_like(x, float("nan"), **kw))  # poisoned
    out = attention_module.attention(kernel_set(kernels), q, k, v, cos, sin, copy_of(cache), meta, DIM ** -0.5, None)
    assert rel_err(out, expected) < TOL[dtype]


def test_no_split_without_decoding_sequences_first():
    plan = mixed_step()
    plan.seqs = plan.seqs[3:]  # a prompt chunk leads
    assert prepare_inputs(plan, PAGE, torch.device(DEVICE)).meta.decode_split is None
    plan.seqs = mixed_step().seqs[:3]  # decoding alone
    assert prepare_inputs(plan, PAGE, torch.device(DEVICE)).meta.decode_split is None


@pytest.mark.parametrize("decoding", [1, 2, 3])
def test_the_rests_tensors_are_16_byte_aligned(decoding):
    """Triton compiles a kernel again for a pointer that is not 16-byte aligned: the rest's metadata (from
    `paged_view`, as a block-sparse step's view) starts every tensor on 16 bytes whatever the batch's sizes."""
    plan = mixed_step()
    plan.seqs = plan.seqs[3 - decoding:]
    rest = prepare_inputs(plan, PAGE, torch.device(DEVICE)).meta.decode_split.rest
    tensors = [rest.cu_seqlens_q, rest.seq_lens_k, rest.block_table]
    assert all(t.data_ptr() % 16 == 0 for t in tensors), [t.data_ptr() % 16 for t in tensors]
    assert rest.seq_lens_k.tolist() == [45, 30, 9] and rest.cu_seqlens_q.tolist() == [0, 25, 55, 56]
