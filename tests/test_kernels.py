"""Triton kernels against a float64 PyTorch reference, through the interpreter on CPU (or natively on a GPU).

Every case draws fresh random inputs, poisons the output with NaN first, and uses awkward sizes.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, rel_err
from flashpage.kernels import reference as ref
from flashpage.kernels import triton_ops as tri
from flashpage.kv import KVCache

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2, torch.float32: 2e-3}


def cu(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out.to(DEVICE)


def rand(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float32, device=DEVICE).to(dtype)


def nan_like(x):
    return torch.full_like(x, float("nan"))


VARLEN_CASES = [
    # (q lengths, k lengths, Hq, Hkv, D, causal, window)
    ([1], [1], 4, 4, 64, True, (-1, -1)),  # one token
    ([17, 1, 33], [17, 1, 33], 8, 2, 64, True, (-1, -1)),  # not multiples of any tile
    ([40, 9], [40, 9], 9, 3, 64, True, (-1, -1)),  # SmolLM2's 9/3 heads
    ([130], [130], 8, 1, 128, True, (-1, -1)),  # MQA, > one row tile
    ([20, 31], [20, 31], 8, 8, 80, True, (-1, -1)),  # head dim 80 (padded to 128)
    ([26], [26], 4, 1, 96, True, (5, 0)),  # sliding window
    ([5, 12], [37, 70], 8, 2, 64, True, (-1, -1)),  # queries are the last tokens of longer keys
    ([23], [29], 6, 2, 64, False, (-1, -1)),  # non-causal
    ([19], [19], 4, 2, 64, False, (3, 4)),  # two-sided window
    ([8], [8], 4, 2, 256, True, (-1, -1)),  # head dim 256
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens_q,lens_k,hq,hkv,dim,causal,window", VARLEN_CASES)
def test_flash_attn_varlen(lens_q, lens_k, hq, hkv, dim, causal, window, dtype):
    q = rand(sum(lens_q), hq, dim, dtype=dtype)
    k, v = rand(sum(lens_k), hkv, dim, dtype=dtype), rand(sum(lens_k), hkv, dim, dtype=dtype)
    args = (cu(lens_q), cu(lens_k), max(lens_q), max(lens_k))
    out = tri.flash_attn_varlen(q, k, v, *args, causal=causal, window_size=window, out=nan_like(q))
    expected = ref.flash_attn_varlen(q.double(), k.double(), v.double(), *args, causal=causal, window_size=window)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < TOL[dtype]


def test_fp8_attention_quantizes_each_head_and_stays_close():
    """fp8=True: q, k, v rounded to e4m3 with one scale per head (a head's largest magnitude maps to 448); off a
    Hopper GPU the dequantized values go through the same kernel, so the result is that, exactly (on one, the FP8
    tensor cores multiply them: tests/test_hopper_prefill.py)."""
    from flashpage.kernels.fp8 import dequantize_heads, quantize_heads
    x = rand(30, 3, 64, dtype=torch.bfloat16)
    x[:, 1] = 0
    x8, scale = quantize_heads(x)
    assert scale[1] == 1 and scale[0] == x[:, 0].abs().max().float() / 448 and x8.float().abs().amax() == 448
    assert rel_err(dequantize_heads(x8, scale, torch.float32)[:, ::2], x[:, ::2]) < 0.05 and not x8[:, 1].float().any()
    lens = [17, 1, 40]
    q, k, v = rand(sum(lens), 8, 64, dtype=torch.bfloat16), rand(sum(lens), 2, 64, dtype=torch.bfloat16), \
        rand(sum(lens), 2, 64, dtype=torch.bfloat16) * 3
    args = (cu(lens), cu(lens), max(lens), max(lens))
    out = tri.flash_attn_varlen(q, k, v, *args, fp8=True, out=nan_like(q))
    deq = [dequantize_heads(*quantize_heads(t), torch.bfloat16) for t in (q, k, v)]
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9):
        assert torch.equal(out, tri.flash_attn_varlen(*deq, *args))
    exact = ref.flash_attn_varlen(q.double(), k.double(), v.double(), *args)
    err = ((out.double() - exact).norm() / exact.norm()).item()
    assert 0.01 < err < 0.06, err  # lossy, by about e4m3's precision (bf16: 0.004)
    with pytest.raises(ValueError, match="fp8"):
        tri.flash_attn_varlen(q, k, v, *args, fp8=True, batch_invariant=True)
    assert tri.flash_attn_varlen(q[:0], k[:0], v[:0], cu([]), cu([]), 0, 0, fp8=True).shape == (0, 8, 64)


def test_fp8_prefill_inputs_quantize_each_token_into_its_aligned_slot():
    """The Hopper FP8 prefill's inputs (`hopper_prefill.quantize_inputs`, a Triton kernel): the torch quantizer's
    values, each sequence's keys from a multiple of 16, V transposed, zeros between. The inputs are e4m3 values
    times a power of two, so no value rounds (the CPU interpreter's e4m3 rounding can be a binade off)."""
    from flashpage.kernels import hopper_prefill
    from flashpage.kernels.fp8 import FP8, quantize_heads

    def exact(*shape):
        x = rand(*shape, dtype=torch.float32).mul(100).clamp(-448, 448).to(FP8).to(torch.bfloat16)
        x[0, :, 0] = 448  # every head's largest magnitude: scale 1, then 2 ** -3
        return x * 2.0 ** -3
    lens = [1, 17, 40]
    q, k, v = exact(58, 8, 64), exact(58, 2, 64), exact(58, 2, 64)
    x = hopper_prefill.quantize_inputs(q, k, v, cu(lens))
    assert x.cu_seqlens_k.tolist() == [0, 16, 48, 96] and x.seq_lens_k.tolist() == lens
    (q8, q_scale), (k8, k_scale), (v8, v_scale) = (quantize_heads(t) for t in (q, k, v))
    assert torch.equal(x.scales, torch.cat([q_scale.view(2, 4), k_scale[:, None], v_scale[:, None]], 1))
    assert torch.equal(x.q.float(), q8.float())
    for start, first, n in zip([0, 16, 48], [0, 1, 18], lens):
        assert torch.equal(x.k[start:start + n].float(), k8[first:first + n].float())
        assert torch.equal(x.v_t[:, :, start:start + n].permute(2, 0, 1).float(), v8[first:first + n].float())
    assert not x.k[1:16].float().any() and not x.v_t[:, :, 33:48].float().any()


def test_hopper_prefill_persistent_programs_balance_round_robin():
    """Round-robin over 132 programs hands each program one residue class of row tiles modulo gcd(132, n_m). With
    GQA 4 (row tiles of 32 tokens, four to a key tile) the classes cost alike and every SM gets a program; with one
    head per token (MHA: eight row tiles of 128 tokens at S=1k) a class would take row tiles {0, 4} (8 + 4 key
    tiles) and another {3, 7} (5 + 1), so 131 programs (every class one row tile of each)."""
    from flashpage.kernels.hopper_prefill import persistent_programs
    assert persistent_programs(132, 32, 4, 1024, 1024, 128, 128) == 132
    assert persistent_programs(132, 56, 7, 1024, 1024, 128, 128) == 132  # within 10%: left alone
    assert persistent_programs(132, 8, 1, 1024, 1024, 128, 128) == 131
    assert persistent_programs(132, 24, 3, 1024, 1024, 128, 64) == 131  # SmolLM2's group of 3
    assert persistent_programs(132, 1, 4, 1, 1000, 128, 128) == 132  # one row tile: nothing to balance


def test_flash_attn_varlen_empty_batch_and_scale():
    q = rand(0, 4, 64, dtype=torch.float16)
    out = tri.flash_attn_varlen(q, q[:, :2], q[:, :2], cu([]), cu([]), 0, 0)
    assert out.shape == (0, 4, 64)
    q, k, v = (rand(10, 4, 64, dtype=torch.float16) for _ in range(3))
    args = (cu([10]), cu([10]), 10, 10)
    out = tri.flash_attn_varlen(q, k, v, *args, softmax_scale=0.3)
    assert rel_err(out, ref.flash_attn_varlen(q.double(), k.double(), v.double(), *args, softmax_scale=0.3)) < 2e-3


def paged_case(lens_k: list[int], lens_q: list[int], page: int, hkv: int, dim: int, dtype, shared_prefix_blocks: int = 0):
    """A cache with shuffled blocks; sequences may share their first blocks (as prefix caching does)."""
    blocks_per_seq = [-(-n // page) for n in lens_k]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(lens_k), max(blocks_per_seq, default=1), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        for j in range(nb):
            if i > 0 and j < shared_prefix_blocks:
                table[i, j] = table[0, j]
            else:
                table[i, j] = order[used]
                used += 1
    k_cache = rand(num_blocks, page, hkv, dim, dtype=dtype)
    v_cache = rand(num_blocks, page, hkv, dim, dtype=dtype)
    return k_cache, v_cache, table.to(DEVICE), torch.tensor(lens_k, dtype=torch.int32, device=DEVICE), cu(lens_q)


PAGED_CASES = [
    # (k lengths, q lengths, page, Hq, Hkv, D, window, num_splits)
    ([1], [1], 8, 4, 4, 64, (-1, -1), 1),  # decode of a one-token sequence
    ([37, 5, 300], [1, 1, 1], 16, 8, 2, 64, (-1, -1), 1),  # decode
    ([300, 129, 77], [1, 1, 1], 16, 9, 3, 64, (-1, -1), 4),  # split-KV decode; short ones leave splits empty
    ([520], [1], 32, 8, 1, 128, (-1, -1), 8),  # MQA, many splits
    ([260, 40], [1, 1], 8, 8, 2, 64, (63, 0), 3),  # window with splits, not a power of two
    ([50, 90], [13, 90], 16, 8, 2, 64, (-1, -1), 1),  # chunked prefill over a cached prefix, and a full prefill
    ([70], [33], 64, 4, 4, 128, (9, 0), 1),  # prefill with window, large block
    ([45, 61], [3, 2], 8, 12, 3, 80, (-1, -1), 1),  # a few queries each, head dim 80
    ([200, 33], [1, 1], 16, 6, 2, 80, (-1, -1), 5),  # split-KV decode, head dim 80: the merge's last columns
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens_k,lens_q,page,hq,hkv,dim,window,splits", PAGED_CASES)
def test_paged_attention(lens_k, lens_q, page, hq, hkv, dim, window, splits, dtype):
    k_cache, v_cache, table, seq_lens, cu_q = paged_case(lens_k, lens_q, page, hkv, dim, dtype,
                                                         shared_prefix_blocks=1 if len(lens_k) > 1 else 0)
    q = rand(sum(lens_q), hq, dim, dtype=dtype)
    out = tri.paged_attention(q, KVCache(k_cache, v_cache), table, cu_q, seq_lens, max(lens_q), window_size=window,
                              num_splits=splits, out=nan_like(q))
    expected = ref.paged_attention(q.double(), KVCache(k_cache.double(), v_cache.double()), table, cu_q, seq_lens, max(lens_q),
                                   window_size=window)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < TOL[dtype]


def test_paged_attention_splits_agree():
    """Split-KV merging gives the unsplit answer to rounding, for every split count."""
    k_cache, v_cache, table, seq_lens, cu_q = paged_case([700, 333], [1, 1], 16, 2, 64, torch.float16)
    q = rand(2, 8, 64, dtype=torch.float16)
    base = tri.paged_attention(q, KVCache(k_cache, v_cache), table, cu_q, seq_lens, 1, num_splits=1)
    for splits in (2, 3, 16, 45):  # 45 splits of 44 tiles (700 keys): one split is empty
        out = tri.paged_attention(q, KVCache(k_cache, v_cache), table, cu_q, seq_lens, 1, num_splits=splits)
        assert rel_err(out, base) < 1e-3, splits


@pytest.mark.parametrize("page,splits", [(8, 1), (16, 1), (16, 4)])
def test_paged_decode_ignores_slots_past_each_sequence(page, splits):
    """Slots past a sequence's end in its last block hold NaN here: the copy-engine path (decode on pages of 16 keys
    or more) fetches whole tiles, so it must drop those keys rather than weight them by zero."""
    lens = [37, 5, 300, 1]
    k_cache, v_cache, table, seq_lens, cu_q = paged_case(lens, [1] * len(lens), page, 2, 64, torch.bfloat16)
    for i, n in enumerate(lens):
        last = table[i, (n - 1) // page]
        k_cache[last, (n - 1) % page + 1:] = float("nan")
        v_cache[last, (n - 1) % page + 1:] = float("nan")
    q = rand(len(lens), 8, 64, dtype=torch.bfloat16)
    out = tri.paged_attention(q, KVCache(k_cache, v_cache), table, cu_q, seq_lens, 1, num_splits=splits, out=nan_like(q))
    expected = ref.paged_attention(q.double(), KVCache(k_cache.double(), v_cache.double()), table, cu_q, seq_lens, 1)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < TOL[torch.bfloat16]


def plant_jumps(k_cache, table, q, jumps, page):
    """Make key `pos` of sequence `seq` score about `score` (softmax units) with each of its KV head's queries, far
    above the keys before it (random ones score about 3 at most): for each (seq, pos, score) of `jumps`."""
    hkv, dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // hkv
    for seq, pos, score in jumps:
        for h in range(hkv):
            queries = q[seq, h * group:(h + 1) * group].float()
            u = queries.mean(0) / queries.mean(0).norm()
            key = u * score * dim**0.5 / (queries @ u).mean()
            k_cache[table[seq, pos // page], pos % page, h] = key.to(k_cache.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_scores_that_jump(dtype, splits):
    """Keys far above every key before them, past a split's first tile: the decode's running maximum jumps, and
    its sums must be rescaled for every row."""
    k_cache, v_cache, table, seq_lens, cu_q = paged_case([300, 200], [1, 1], 16, 2, 64, dtype)
    q = rand(2, 8, 64, dtype=dtype)
    plant_jumps(k_cache, table, q, [(0, 250, 10.0), (0, 280, 14.0), (1, 120, 9.0)], 16)
    out = tri.paged_attention(q, KVCache(k_cache, v_cache), table, cu_q, seq_lens, 1, num_splits=splits,
                              out=nan_like(q))
    expected = ref.paged_attention(q.double(), KVCache(k_cache.double(), v_cache.double()), table, cu_q, seq_lens, 1)
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("splits", [1, 2])
def test_paged_decode_programs_take_turns_over_sequences(monkeypatch, splits):
    """When one program per (sequence, KV head, split) would not all run at once, each program takes every n-th
    sequence in turn: here 4 programs at a time, so 2 (or 1) programs per KV head and split cover 5 sequences."""
    from flashpage.kernels import attention

    monkeypatch.setattr(attention, "_programs_per_wave", lambda device: 4)
    lens = [37, 5, 300, 1, 64]
    k_cache, v_cache, table, seq_lens, cu_q = paged_case(lens, [1] * len(lens), 16, 2, 64, torch.bfloat16)
    q = rand(len(lens), 8, 64, dtype=torch.bfloat16)
    out = tri.paged_attention(q, KVCache(k_cache, v_cache), table, cu_q, seq_lens, 1, num_splits=splits, out=nan_like(q))
    expected = ref.paged_attention(q.double(), KVCache(k_cache.double(), v_cache.double()), table, cu_q, seq_lens, 1)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < TOL[torch.bfloat16]


def test_choose_num_splits_fills_each_sm_with_four_programs(monkeypatch):
    from flashpage.kernels import attention

    monkeypatch.setattr(attention, "sm_count", lambda device: 132)  # an H100
    gpu = torch.device("cuda", 0)
    assert attention.choose_num_splits(1, 8, 1, 32768, gpu) == 66  # 528 programs: four on each SM
    assert attention.choose_num_splits(8, 8, 1, 8192, gpu) == 8
    assert attention.choose_num_splits(64, 8, 1, 4096, gpu) == 1  # the batch alone fills the GPU
    assert attention.choose_num_splits(1, 8, 1, 640, gpu) == 20  # at least 32 keys per split
    assert attention.choose_num_splits(1, 1, 1, 1 << 20, gpu) == 128  # the merge's limit
    assert attention.choose_num_splits(1, 8, 4, 32768, gpu) == 1  # not a decode
    assert attention.choose_num_splits(1, 8, 1, 32768, torch.device("cpu")) == 1
    # an 8-bit cache: eight programs per SM
    assert [attention.choose_num_splits(b, 8, 1, n, gpu, cache_bytes=1) for b, n in
            ((1, 32768), (8, 8192), (64, 4096), (256, 1024))] == [128, 16, 2, 1]


def test_paged_attention_rejects_bad_block_size_and_heads():
    q = rand(1, 6, 64, dtype=torch.float16)
    cache = rand(4, 12, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="power of two"):
        tri.paged_attention(q, KVCache(cache, cache), torch.zeros(1, 4, dtype=torch.int32), cu([1]), torch.tensor([3]), 1)
    cache = rand(4, 16, 4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="num_splits"):
        tri.paged_attention(q[:, :4], KVCache(cache, cache), torch.zeros(1, 4, dtype=torch.int32), cu([1]), torch.tensor([3]),
                            1, num_splits=0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tri.paged_attention(q, KVCache(cache, cache), torch.zeros(1, 4, dtype=torch.int32), cu([1]), torch.tensor([3]), 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_reshape_and_cache(dtype):
    page, hkv, dim = 16, 3, 80
    k_cache = torch.full((6, page, hkv, dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    slots = torch.tensor([0, 17, -1, 95, 40, 41], device=DEVICE)  # -1 is padding
    k, v = rand(6, hkv, dim, dtype=dtype), rand(6, hkv, dim, dtype=dtype)
    tri.reshape_and_cache(k, v, KVCache(k_cache, v_cache), slots)
    flat_k, flat_v = k_cache.view(-1, hkv, dim), v_cache.view(-1, hkv, dim)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], k[keep]) and torch.equal(flat_v[slots[keep]], v[keep])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[keep]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def test_engine_greedy_triton_backend_equals_torch_backend(smollm_llm, smollm_gguf):
    """End to end on SmolLM2 (GQA 9/3, head dim 64): the Triton kernels give the PyTorch backend's tokens."""
    from flashpage import LLM, SamplingParams

    triton_llm = LLM(str(smollm_gguf), dtype="float32", device=DEVICE, kernels="triton")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["The capital of France is", "1 2 3"]
    got = [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in smollm_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_reads_q_k_v_as_strided_views_of_fused_qkv(dtype):
    """The model hands q/k/v over as slices of one fused projection: each has its own token stride."""
    lens, hq, hkv, dim = [19, 70], 8, 2, 64
    qkv = rand(sum(lens), (hq + 2 * hkv) * dim, dtype=dtype)
    q, k, v = (t.view(-1, h, dim) for t, h in zip(qkv.split([hq * dim, hkv * dim, hkv * dim], -1), (hq, hkv, hkv)))
    assert k.stride(0) != hkv * dim and v.stride(0) != hkv * dim
    args = (cu(lens), cu(lens), max(lens), max(lens))
    out = tri.flash_attn_varlen(q, k.contiguous(), v, *args, out=nan_like(q.contiguous()))
    expected = ref.flash_attn_varlen(q.double(), k.double(), v.double(), *args)
    assert rel_err(out, expected) < TOL[dtype]
    out = tri.flash_attn_varlen(q, k, v.contiguous(), *args, out=nan_like(q.contiguous()))
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("lens", [[1, 9, 23, 16, 40], [23]])
@pytest.mark.parametrize("window", [(-1, -1), (5, 0)])
def test_cpu_batched_decode_attention_equals_reference(lens, window):
    """The CPU kernel set's decode: one call over the batch, keys gathered and padded; the reference's per-sequence
    loop on the same pages (shuffled, lengths not multiples of the page, one of a single key) is the truth."""
    from flashpage.kernels import cpu

    page, hq, hkv, dim = 8, 6, 2, 16
    pages = [-(-n // page) for n in lens]
    num_blocks = sum(pages) + 3
    cache = KVCache(torch.full((num_blocks, page, hkv, dim), float("nan"), dtype=torch.float64),
                    torch.full((num_blocks, page, hkv, dim), float("nan"), dtype=torch.float64))
    order = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    for i, n in enumerate(pages):
        table[i, :n] = torch.tensor([order.pop() for _ in range(n)])
        for j in range(lens[i]):  # only the slots a sequence wrote hold numbers; the rest of its pages is NaN
            cache.k[table[i, j // page], j % page] = torch.randn(hkv, dim, dtype=torch.float64)
            cache.v[table[i, j // page], j % page] = torch.randn(hkv, dim, dtype=torch.float64)
    q = torch.randn(len(lens), hq, dim, dtype=torch.float64)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = ref.paged_attention(q, cache, table, cu, seq_lens, 1, window_size=window, softmax_scale=0.3)
    got = cpu.paged_attention(q, cache, table, cu, seq_lens, 1, window_size=window, softmax_scale=0.3,
                              out=torch.full_like(q, float("nan")))
    assert rel_err(got, want) < 1e-12


def test_cpu_linear_with_its_norm_equals_reference():
    from flashpage.kernels import cpu

    x, weight, norm, residual = torch.randn(5, 48), torch.randn(40, 48), torch.randn(48), torch.randn(5, 40)
    for kw in (dict(norm_weight=norm, eps=1e-5), dict(norm_weight=norm, eps=1e-5, residual=residual),
               dict(norm_weight=norm, eps=1e-5, silu_mul=True)):  # float32 as the model runs on CPU
        assert rel_err(cpu.linear(x, weight, **kw), ref.linear(x, weight, **kw)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_cpu_packed_products_equal_reference_and_follow_weight_writes(dtype, rows):
    """The CPU set multiplies a packed copy of the weight (oneDNN / MKL layouts): within the dtype's rounding of
    the reference, and a weight written in place is packed again (a stale copy would give the old product)."""
    from flashpage.kernels import cpu

    weight, bias = torch.randn(72, 48, dtype=dtype), torch.randn(72, dtype=dtype)
    x, residual = torch.randn(rows, 48, dtype=dtype), torch.randn(rows, 72, dtype=dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for step in range(2):
        exact = x.double() @ weight.double().T
        for kw, want in ((dict(), exact), (dict(bias=bias), exact + bias.double()),
                         (dict(residual=residual), exact + residual.double())):
            assert rel_err(cpu.linear(x, weight, **kw), want) < tol, (step, kw)
        weight.mul_(-0.5)


def test_cpu_decode_attention_does_not_depend_on_the_rest_of_the_batch():
    """A sequence's decode output is bit-identical alone and batched with longer and shorter ones (else a seeded
    request could sample differently depending on what else runs)."""
    from flashpage.kernels import cpu

    page, hq, hkv, dim = 8, 4, 2, 16
    cache = KVCache(torch.randn(20, page, hkv, dim), torch.randn(20, page, hkv, dim))
    table = torch.randperm(20).to(torch.int32).view(4, 5)
    q = torch.randn(4, hq, dim)
    lens = torch.tensor([13, 37, 5, 40], dtype=torch.int32)
    batched = cpu.paged_attention(q, cache, table, torch.arange(5, dtype=torch.int32), lens, 1)
    for i in range(4):
        alone = cpu.paged_attention(q[i:i + 1], cache, table[i:i + 1, :-(-int(lens[i]) // page)],
                                    torch.arange(2, dtype=torch.int32), lens[i:i + 1], 1)
        assert torch.equal(alone[0], batched[i])
