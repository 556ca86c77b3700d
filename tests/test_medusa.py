"""Medusa heads (and blockwise parallel decoding, their chain) and typical acceptance: checkpoints in both published
layouts load and compute the heads' formula; lossless verification keeps greedy and seeded outputs
token-identical; typical acceptance is opt-in and does what its rule says; bad heads are refused before anything
runs."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from flashpage import SamplingParams
from flashpage.engine.spec.medusa import default_tree, load_medusa
from flashpage.engine.spec.medusa_train import save_medusa, train_medusa
from flashpage.engine.spec.typical import typical_walk
from flashpage.errors import ParameterError
from test_engine import mixed_workload, run, tiny_engine

HEADS = 3


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    """Heads trained in a second on the tiny engine's own greedy outputs (its random model loops, so they learn
    something), in Medusa's layout."""
    engine = tiny_engine()
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(1, 20))] for _ in range(40)]
    outs = run(engine, prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    heads = train_medusa(engine.runner.model, [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)], HEADS,
                         steps=200)
    path = tmp_path_factory.mktemp("medusa")
    save_medusa(heads, path)
    return path


def vllm_layout(src, dst, prefix=""):
    """The same heads as vLLM's converted checkpoints store them."""
    t = load_file(src / "medusa_lm_head.safetensors")
    out = {}
    for name, tensor in t.items():
        head, layer, *rest = name.split(".")
        out[prefix + (f"lm_heads.{head}.weight" if int(layer) == 1 else f"blocks.{head}.layers.{layer}.{rest[-1]}")] = tensor
    dst.mkdir(exist_ok=True)
    save_file(out, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps({"num_heads": HEADS, "num_hidden_layers": 1, "hidden_size": 64,
                                                 "vocab_size": 512}))
    return dst


def test_both_layouts_load_and_compute_the_heads_formula(heads_dir, tmp_path):
    """Head i: logits = W2 (x + SiLU(W1 x + b1)), x the final-normed hidden state; Medusa's own names and vLLM's
    (with its optional `medusa_heads.` prefix) give the same heads."""
    t = load_file(heads_dir / "medusa_lm_head.safetensors")
    x = torch.randn(5, 64)
    ref = torch.stack([(x + F.silu(x @ t[f"{i}.0.linear.weight"].T + t[f"{i}.0.linear.bias"])) @ t[f"{i}.1.weight"].T
                       for i in range(HEADS)])
    for path in (heads_dir, vllm_layout(heads_dir, tmp_path / "a"), vllm_layout(heads_dir, tmp_path / "b", "medusa_heads.")):
        heads = load_medusa(str(path), 64, 512, torch.float32, "cpu")
        out = heads(x, HEADS)
        assert ((out - ref).norm() / ref.norm()) < 1e-6


def test_default_tree_is_the_likeliest_paths_and_a_chain_at_width_one():
    assert default_tree(4, 1) == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    tree = default_tree(4, 4)
    assert len(tree) == 16 and len(set(tree)) == 16
    assert all(p[:-1] in tree for p in tree if len(p) > 1) and max(max(p) for p in tree) < 4
    assert tree[:3] == [(0,), (1,), (2,)] and (0, 0) in tree
    assert len(default_tree(16, 16)) == 63  # (the kernels' limit: 64 tokens with the last one)


@pytest.mark.parametrize("config", [{}, {"tree_width": 1}, {"medusa_choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}],
                         ids=["tree", "blockwise-chain", "medusa-choices"])
def test_medusa_is_token_identical_greedy_and_seeded_with_chunks_and_preemption(heads_dir, config):
    """Lossless: every emitted token is the draw decoding makes at its place, whatever the heads guessed."""
    prompts, params = mixed_workload()
    base = run(tiny_engine(max_num_batched_tokens=48), prompts, params)
    engine = tiny_engine(max_num_batched_tokens=48, num_gpu_blocks=12,
                         speculative_config={"method": "medusa", "model": str(heads_dir), **config})
    outs = run(engine, prompts, params)
    for b, s in zip(base, outs):
        assert [(c.token_ids, c.finish_reason) for c in b.outputs] == [(c.token_ids, c.finish_reason) for c in s.outputs]
    stats = engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0 and stats["spec_acceptance_rate"] < 1
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert engine.spec.num_speculative_tokens == HEADS  # (left out: all the checkpoint's heads)


def test_typical_walk_keeps_the_deepest_typical_path():
    """Nodes 0 (a) and 1 (b) hang from the last token, node 2 (c) from node 0, node 3 (d) from node 1 and node
    4 (e) from node 3. Row 0 is sure of b; row 2 (after b) is flat, so d passes its relaxed bound; row 4 (after
    d) gives e nothing."""
    v = 8
    logits = torch.full((6, v), -30.0)
    logits[0, 1] = 10  # after the last token: b
    logits[1, :] = 0  # after a: flat (c would pass, but a did not)
    logits[2, :] = 0  # after b: flat, 1/8 each, above min(0.09, 0.3 exp(-ln 8))
    logits[4, 0] = 10  # after d: a, not e
    tokens, parents = [0, 1, 2, 3, 4], [-1, -1, 0, 1, 3]
    assert typical_walk(tokens, parents, logits, 1.0, 0.09, 0.3) == [1, 3]
    assert typical_walk(tokens, parents, logits, 1.0, 0.2, 1.5) == [1]  # d's bound now min(0.2, 1.5 / 8) > 1/8
    assert typical_walk(tokens, parents, logits, 1.0, 0.0, 0.3) == [1, 3, 4]  # bound 0: all pass, the deepest path


def test_typical_acceptance_is_opt_in_exact_when_greedy_and_keeps_what_its_rule_allows(heads_dir):
    prompts, params = mixed_workload()
    spec = {"method": "medusa", "model": str(heads_dir), "acceptance_method": "typical_acceptance_sampler"}
    greedy = [SamplingParams(temperature=0, max_tokens=p.max_tokens, n=p.n) for p in params]
    base = run(tiny_engine(max_num_batched_tokens=48), prompts, greedy)
    outs = run(tiny_engine(max_num_batched_tokens=48, speculative_config=spec), prompts, greedy)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in base]
    # threshold 0: every proposed token has probability > 0, so every path is kept whole
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=20, logprobs=2, ignore_eos=True) for i in range(len(prompts))]
    engine = tiny_engine(max_num_batched_tokens=48, num_gpu_blocks=30, speculative_config={
        **spec, "typical_acceptance_sampler_posterior_threshold": 0.0})
    outs = run(engine, prompts, sampled)
    stats = engine.stats()
    # (a tree is cut to the depth a request has room for near its end, so a few paths are shorter)
    assert stats["spec_num_drafts"] > 0 and stats["spec_accepted_per_position"][0] == stats["spec_num_drafts"]
    assert stats["spec_mean_accepted_length"] > HEADS + 0.5
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 20 and len(c.logprobs) == 20
        assert all(t in lp and lp[t].logprob <= 0 for t, lp in zip(c.token_ids, c.logprobs))


@pytest.mark.parametrize("change,match", [
    ({"hidden_size": 32}, "hidden_size is 32, the target's 64"),
    ({"vocab_size": 500}, "vocab_size is 500, the target's 512"),
    ({"tensor": (64, 32)}, r"expected \(64, 64\) \(the heads' hidden size does not match"),
    ({"spec": {"num_speculative_tokens": 5}}, "num_speculative_tokens is 5, but the Medusa checkpoint has 3 heads"),
    ({"spec": {"medusa_choices": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}}, "deeper than the checkpoint's 3 heads"),
    ({"spec": {"medusa_choices": [[0], [1, 0]]}}, r"path \[1, 0\] has no parent path \[1\]"),
    ({"spec": {"medusa_choices": [[0]] * 2}}, "distinct paths"),
    ({"spec": {"medusa_choices": [[0]], "tree_width": 2}}, "both shape the tree"),
    ({"spec": {"typical_acceptance_sampler_posterior_alpha": 0.5}}, "applies only with acceptance_method typical"),
    ({"spec": {"acceptance_method": "typical"}}, "acceptance_method must be one of"),
    ({"spec": {"model": None}}, "must name the Medusa heads' checkpoint"),
    ({"spec": {"model": "/no/such/heads"}}, "is not a directory of Medusa heads"),
])
def test_bad_medusa_heads_or_settings_are_one_clear_error_before_anything_runs(heads_dir, tmp_path, change, match):
    path = tmp_path / "heads"
    path.mkdir()
    config = json.loads((heads_dir / "config.json").read_text())
    tensors = load_file(heads_dir / "medusa_lm_head.safetensors")
    if "tensor" in change:
        tensors["1.0.linear.weight"] = torch.zeros(change["tensor"])
    config.update({k: v for k, v in change.items() if k in ("hidden_size", "vocab_size")})
    save_file(tensors, path / "medusa_lm_head.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ParameterError, match=match):
        tiny_engine(speculative_config={"method": "medusa", "model": str(path), **change.get("spec", {})})


def test_typical_acceptance_is_refused_for_a_draft_model():
    with pytest.raises(ParameterError, match="not for a draft model"):
        tiny_engine(speculative_config={"model": "x", "num_speculative_tokens": 2,
                                        "acceptance_method": "typical_acceptance_sampler"})
