"""EAGLE drafts (EAGLE-1 layout, EAGLE-2 trees): the draft's paged forward equals its dense formula, the features it
reads are the target's, and verification keeps greedy and seeded outputs token-identical; bad drafts are refused
before anything runs."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file

from conftest import record_rows
from flashpage import SamplingParams
from flashpage.config import ModelConfig
from flashpage.engine.config import EngineConfig
from flashpage.engine.llm_engine import LLMEngine
from flashpage.engine.spec.eagle import load_eagle
from flashpage.errors import ParameterError
from flashpage.loader import LoadedModel, build_empty, init_dummy_weights
from flashpage.model import AttentionMetadata
from test_engine import mixed_workload, run

CONFIG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def target():
    """A one-layer random target: a draft that copies its layer (and reads the token, nearly ignoring the
    feature) agrees with it often but not always (it lacks the first token in its context)."""
    model = build_empty(CONFIG, torch.float32, torch.device("cpu"))
    init_dummy_weights(model, 3)
    return LoadedModel(CONFIG, model, None)


def engine(target, **cfg) -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", max_model_len=4096, **cfg), target)


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    """An EAGLE-1 checkpoint mimicking the target: fc = [I, 2e-4 R] (the token's embedding, a little of the
    feature), and the target's decoder layer with its input norm."""
    layer = target.model.layers[0]
    gen = torch.Generator().manual_seed(0)
    h = CONFIG.hidden_size
    qkv = layer.self_attn.qkv_proj.weight.detach()
    q, k, v = qkv.split([64, 32, 32])
    gate, up = layer.mlp.gate_up_proj.weight.detach().split([128, 128])
    tensors = {
        "fc.weight": torch.cat([torch.eye(h), 2e-4 * torch.randn(h, h, generator=gen)], 1),
        "layers.0.self_attn.q_proj.weight": q, "layers.0.self_attn.k_proj.weight": k,
        "layers.0.self_attn.v_proj.weight": v, "layers.0.self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
        "layers.0.mlp.gate_proj.weight": gate, "layers.0.mlp.up_proj.weight": up,
        "layers.0.mlp.down_proj.weight": layer.mlp.down_proj.weight,
        "layers.0.input_layernorm.weight": layer.input_layernorm.weight,
        "layers.0.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
    }
    path = tmp_path_factory.mktemp("eagle")
    save_file({n: t.detach().clone().contiguous() for n, t in tensors.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "num_hidden_layers": 1,
        "max_position_embeddings": 4096}))
    return path


def test_the_draft_is_eagles_formula(target, draft_dir):
    """f' = layer(fc([embed(t_{p+1}); f_p])) over a sequence, dense and by hand (one layer, no cache)."""
    draft = load_eagle(str(draft_dir), CONFIG, torch.float32, "cpu")
    n = 11
    ids, feats = torch.randint(512, (n,)), torch.randn(n, 64)
    meta = AttentionMetadata.prefill([n])
    emb = target.model.embed_tokens(ids)
    out = draft(target.model.ops, emb, feats, meta, None)
    x = torch.cat([emb, feats], -1) @ draft.fc.weight.T
    want = draft.layer(target.model.ops, x, *_rope(draft, meta), meta, None)
    torch.testing.assert_close(out, want)
    assert out.shape == (n, 64) and torch.isfinite(out).all()


def _rope(draft, meta):
    from flashpage.model.rope import rope_cos_sin
    return rope_cos_sin(draft._inv_freq, meta.positions, torch.float32)


@pytest.mark.parametrize("tree_width", [1, 3])
def test_eagle_is_token_identical_greedy_and_seeded_and_reads_the_targets_features(target, draft_dir, tree_width):
    prompts, params = mixed_workload()
    prompts = prompts + [prompts[2]]  # (a prefix-cache hit: the draft sees zeros for the cached part)
    params = params + [params[0]]
    base = run(engine(target, max_num_batched_tokens=48), prompts, params)
    spec = engine(target, max_num_batched_tokens=48, num_gpu_blocks=14,
                  speculative_config={"method": "eagle", "model": str(draft_dir), "num_speculative_tokens": 3,
                                      "tree_width": tree_width})
    seen = []  # (positions, features) of the draft's catch-up steps
    run_draft = spec.proposer._run

    def recording(plan, features):
        if not any(s.tree for s in plan.seqs):
            record_rows(spec, plan, features, seen)
        return run_draft(plan, features)
    spec.proposer._run = recording
    outs = run(spec, prompts, params)
    for b, s in zip(base, outs):
        assert [(c.token_ids, c.finish_reason) for c in b.outputs] == [(c.token_ids, c.finish_reason) for c in s.outputs]
    stats = spec.stats()
    assert 0 < stats["spec_acceptance_rate"] < 1 and stats["spec_mean_accepted_length"] > 1.1
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert spec.proposer.bm.num_free_blocks == spec.proposer.bm.num_blocks
    # the features the draft read are the target's final-normed hidden states at those positions
    model = target.model
    checked = 0
    for tokens, positions, feats in seen:
        if feats.abs().sum(-1).eq(0).any():
            continue  # (a prefix hit's zeros)
        ids = torch.tensor(tokens)
        h = model(ids, AttentionMetadata.prefill([len(ids)]), None)[positions]
        want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + model.norm.eps) * model.norm.weight
        torch.testing.assert_close(feats, want, rtol=1e-4, atol=1e-4)
        checked += 1
    assert checked > 5


def test_a_draft_that_mimics_the_target_keeps_most_of_its_greedy_chain(target, draft_dir):
    """The mimic agrees with the target on about three tokens in four (it lacks the first token in its context),
    so a chain of 3 keeps more than two tokens per verification on average."""
    rng = random.Random(int(torch.randint(1 << 30, ())))
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 30, 60, 7, 90)]
    spec = engine(target, speculative_config={"method": "eagle", "model": str(draft_dir), "num_speculative_tokens": 3,
                                              "tree_width": 1})
    run(spec, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert spec.stats()["spec_mean_accepted_length"] > 2


@pytest.mark.parametrize("change,match", [
    ({"hidden_size": 32}, "hidden_size is 32, the target's 64"),
    ({"vocab_size": 500}, "vocab_size is 500, the target's 512"),
    ({"tensor": "fc.weight"}, r"tensor 'fc.weight' has shape \(64, 64\), expected \(64, 128\)"),
    ({"tensor": "midlayer.hidden_norm.weight"}, "EAGLE-3 checkpoint"),
    ({"spec": {"tree_width": 16, "num_speculative_tokens": 4}}, "must be fewer than 64"),
    ({"spec": {"model": None}}, "must name the EAGLE draft's checkpoint"),
    ({"spec": {"model": "/no/such/draft"}}, "is not a directory of an EAGLE draft"),
])
def test_bad_eagle_drafts_or_settings_are_one_clear_error(target, draft_dir, tmp_path, change, match):
    from safetensors.torch import load_file

    path = tmp_path / "draft"
    path.mkdir()
    config = json.loads((draft_dir / "config.json").read_text())
    config.update({k: v for k, v in change.items() if k in ("hidden_size", "vocab_size")})
    tensors = load_file(draft_dir / "model.safetensors")
    if "tensor" in change:
        tensors[change["tensor"]] = torch.zeros(64, 64)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    spec = {"method": "eagle", "model": str(path), "num_speculative_tokens": 3, **change.get("spec", {})}
    with pytest.raises(ParameterError, match=match):
        engine(target, speculative_config=spec)
