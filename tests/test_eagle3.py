"""EAGLE-3 drafts (`method: "eagle3"`): a tiny random draft in the published layout (fc over three target layers,
midlayer with 2 x hidden attention input and hidden_norm, its own norm and head over a smaller vocabulary, d2t)
loads; its paged forward equals the formula written out in PyTorch; it reads the target's residual streams at the
configured layers; verification keeps greedy and seeded outputs token-identical with every proposal inside the
draft vocabulary; bad drafts are one clear error."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from conftest import record_rows
from flashpage.config import ModelConfig
from flashpage.engine.config import EngineConfig
from flashpage.engine.llm_engine import LLMEngine
from flashpage.engine.spec.eagle3 import feature_layers, load_eagle3
from flashpage.errors import ParameterError
from flashpage.loader import LoadedModel, build_empty, init_dummy_weights
from flashpage.model import AttentionMetadata
from test_engine import mixed_workload, run

H, VOCAB, DRAFT_VOCAB, LAYERS = 64, 512, 200, 4
CONFIG = ModelConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
AUX = [0, 2, 3]


@pytest.fixture(scope="module")
def target():
    model = build_empty(CONFIG, torch.float32, torch.device("cpu"))
    init_dummy_weights(model, 5)
    return LoadedModel(CONFIG, model, None)


def write_draft(path, *, config=None, drop=(), replace=None, seed=0, target=CONFIG, draft_vocab=DRAFT_VOCAB):
    """A random EAGLE-3 draft for `target` in the published layout."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = target.hidden_size, target.intermediate_size, target.vocab_size
    q, kv = target.num_attention_heads * target.head_dim, target.num_key_value_heads * target.head_dim

    def r(*shape, scale=0.05):
        return scale * torch.randn(*shape, generator=gen)
    d2t = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values - torch.arange(draft_vocab)
    tensors = {
        "fc.weight": r(h, 3 * h), "midlayer.hidden_norm.weight": 1 + r(h), "midlayer.input_layernorm.weight": 1 + r(h),
        "midlayer.self_attn.q_proj.weight": r(q, 2 * h), "midlayer.self_attn.k_proj.weight": r(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": r(kv, 2 * h), "midlayer.self_attn.o_proj.weight": r(h, q),
        "midlayer.post_attention_layernorm.weight": 1 + r(h), "midlayer.mlp.gate_proj.weight": r(inter, h),
        "midlayer.mlp.up_proj.weight": r(inter, h), "midlayer.mlp.down_proj.weight": r(h, inter),
        "norm.weight": 1 + r(h), "lm_head.weight": r(draft_vocab, h, scale=1.0), "d2t": d2t,
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, torch.arange(draft_vocab) + d2t, True)}
    tensors.update(replace or {})
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items() if n not in drop}, path / "model.safetensors")
    aux = AUX if target is CONFIG else None
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h, "intermediate_size": inter,
        "num_attention_heads": target.num_attention_heads, "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim, "vocab_size": vocab, "draft_vocab_size": draft_vocab, "num_hidden_layers": 1,
        "max_position_embeddings": target.max_position_embeddings, "rope_theta": target.rope_theta,
        "rms_norm_eps": target.rms_norm_eps, **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}} if aux
                                                 else {}), **(config or {})}))
    return path


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return write_draft(tmp_path_factory.mktemp("eagle3") / "draft")


def engine(target, **cfg) -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", max_model_len=4096, **cfg), target)


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_the_draft_is_eagle3s_formula(target, draft_dir):
    """f' = o + MLP(o), o = h + attention([norm(embed(t)); hidden_norm(h)]) with h = fc(features) for the target's
    streams; log-probabilities: the draft head's over its vocabulary, at the target's ids, -inf elsewhere."""
    draft = load_eagle3(str(draft_dir), CONFIG, torch.float32, "cpu")
    ops, n = target.model.ops, 13
    ids, streams = torch.randint(VOCAB, (n,)), torch.randn(n, 3 * H)
    meta = AttentionMetadata.prefill([n])
    h = draft.fuse(ops, target.model, streams)
    torch.testing.assert_close(h, streams @ draft.fc.weight.T)
    out = draft(ops, draft.embed(target.model, ids), h, meta, None)
    layer, eps = draft.layer, draft.norm.eps
    x = torch.cat([_rms(target.model.embed_tokens(ids), layer.input_layernorm.weight, eps),
                   _rms(h, layer.hidden_norm.weight, eps)], -1)
    q, k, v = (x @ layer.self_attn.qkv_proj.weight.T).split([64, 32, 32], -1)
    cos, sin = _rope(draft, meta)

    def rope(t, heads):
        t = t.view(n, heads, 16)
        return t * cos[:, None] + torch.cat([-t[..., 8:], t[..., :8]], -1) * sin[:, None]
    q, k, v = rope(q, 4).transpose(0, 1), rope(k, 2).transpose(0, 1), v.view(n, 2, 16).transpose(0, 1)
    attn = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0), is_causal=True)
    o = h + attn.transpose(0, 1).reshape(n, 64) @ layer.self_attn.o_proj.weight.T
    gate, up = (_rms(o, layer.post_attention_layernorm.weight, eps) @ layer.mlp.gate_up_proj.weight.T).chunk(2, -1)
    want = o + (F.silu(gate) * up) @ layer.mlp.down_proj.weight.T
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    lp = draft.logprobs(ops, target.model, out)
    own = torch.log_softmax(_rms(out, draft.norm.weight, eps) @ draft.lm_head.weight.T, -1)
    torch.testing.assert_close(lp[:, draft.target_ids], own, rtol=1e-4, atol=1e-4)
    outside = torch.ones(VOCAB, dtype=torch.bool).index_fill_(0, draft.target_ids, False)
    assert outside.sum() == VOCAB - DRAFT_VOCAB and lp[:, outside].eq(float("-inf")).all()


def _rope(draft, meta):
    from flashpage.model.rope import rope_cos_sin
    return rope_cos_sin(draft._inv_freq, meta.positions, torch.float32)


@pytest.mark.parametrize("tree_width", [1, 3])
def test_eagle3_is_token_identical_and_reads_the_three_layers(target, draft_dir, tree_width):
    prompts, params = mixed_workload()
    base = run(engine(target, max_num_batched_tokens=48), prompts, params)
    spec = engine(target, max_num_batched_tokens=48, num_gpu_blocks=14,
                  speculative_config={"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": 3,
                                      "tree_width": tree_width})
    assert spec.runner.feature_layers == tuple(AUX)
    seen, proposed = [], []
    take, propose = spec.proposer.take_features, spec.proposer.propose

    def taking(plan, hidden):
        if hidden is not None and not any(s.num_logits > 1 for s in plan.seqs):
            record_rows(spec, plan, hidden, seen)
        return take(plan, hidden)

    def proposing(running):
        propose(running)
        proposed.extend(t for s in running for t in (s.proposal or []))
    spec.proposer.take_features, spec.proposer.propose = taking, proposing
    outs = run(spec, prompts, params)
    for b, s in zip(base, outs):
        assert [(c.token_ids, c.finish_reason) for c in b.outputs] == [(c.token_ids, c.finish_reason) for c in s.outputs]
    stats = spec.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert spec.proposer.bm.num_free_blocks == spec.proposer.bm.num_blocks
    assert proposed and set(proposed) <= set(spec.proposer.draft.target_ids.tolist())
    # what the runner handed over: the residual streams at the input of layers 0, 2 and 3, side by side
    model, checked = target.model, 0
    for tokens, positions, feats in seen:
        ids = torch.tensor(tokens)
        _, want = model(ids, AttentionMetadata.prefill([len(ids)]), None, (0, 2, 3))
        torch.testing.assert_close(feats, want[positions], rtol=1e-4, atol=1e-4)
        checked += 1
    assert checked >= 3


def test_default_layers_are_eagle3s(tmp_path):
    path = write_draft(tmp_path / "d", config={"eagle_config": {}})
    assert feature_layers(str(path), 32) == (2, 16, 29) and feature_layers(str(path), 8) == (2, 4, 5)


@pytest.mark.parametrize("change,match", [
    ({"config": {"hidden_size": 32}}, "hidden_size is 32, the target's 64"),
    ({"config": {"vocab_size": 500}}, "vocab_size is 500, the target's 512"),
    ({"replace": {"fc.weight": torch.zeros(H, 2 * H)}}, r"fc.weight is \[64, 128\], expected \[64, 192\]"),
    ({"replace": {"d2t": torch.full((DRAFT_VOCAB,), VOCAB)}}, "d2t must map each of the 200 draft tokens"),
    ({"drop": ("d2t",)}, "no d2t to map it"),
    ({"drop": ("midlayer.hidden_norm.weight",)}, "lacks tensors for layer.hidden_norm.weight"),
    ({"config": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 1, 9]}}}, "must be ascending layers"),
    ({"spec": {"method": "eagle"}}, "EAGLE-3 checkpoint .* give method 'eagle3'"),
])
def test_bad_eagle3_drafts_are_one_clear_error(target, tmp_path, change, match):
    path = write_draft(tmp_path / "d", config=change.get("config"), drop=change.get("drop", ()),
                       replace=change.get("replace"))
    spec = {"method": "eagle3", "model": str(path), "num_speculative_tokens": 3, **change.get("spec", {})}
    with pytest.raises(ParameterError, match=match):
        engine(target, speculative_config=spec)


def test_an_eagle1_checkpoint_is_refused_as_eagle3(target, tmp_path):
    path = tmp_path / "e1"
    path.mkdir()
    save_file({"fc.weight": torch.zeros(H, 2 * H)}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"hidden_size": H, "intermediate_size": 128,
                                                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                                  "vocab_size": VOCAB, "num_hidden_layers": 1,
                                                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX}}))
    with pytest.raises(ParameterError, match="looks like EAGLE-1's: give method 'eagle'"):
        engine(target, speculative_config={"method": "eagle3", "model": str(path), "num_speculative_tokens": 2})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tree_width", [1, 4])
def test_eagle3_greedy_identity_under_cuda_graphs(tmp_path, tree_width):
    """On a GPU the verify steps replay CUDA graphs, which must carry the three layers' features: float32
    `llama-3.2-1b` (dummy weights) with a random EAGLE-3 draft of its shapes gives plain decoding's tokens."""
    from flashpage import LLM, SamplingParams
    from flashpage.loader.presets import preset_config

    kw = dict(load_format="dummy", dtype="float32", max_model_len=1024, max_num_seqs=8)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(128000, (n,), generator=gen).tolist()} for n in (5, 40, 300, 17)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM("llama-3.2-1b", **kw)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    draft = write_draft(tmp_path / "draft", target=preset_config("llama-3.2-1b"), draft_vocab=32000)
    spec = LLM("llama-3.2-1b", speculative_config={"method": "eagle3", "model": str(draft),
                                                   "num_speculative_tokens": 4, "tree_width": tree_width}, **kw)
    assert any(q > 1 for _, q in spec.engine.runner.graphs)  # (verify graphs captured)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    assert spec.stats()["spec_num_draft_tokens"] > 0
