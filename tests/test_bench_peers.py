"""The benchmark peers compute the same model: transformers over our weights, and the gpt-fast-style loop."""

from __future__ import annotations

import torch

from conftest import rel_err
from flashpage.bench.peers import StaticLlama, greedy_step, to_transformers
from flashpage.config import ModelConfig
from flashpage.loader import build_empty, init_dummy_weights
from flashpage.model import AttentionMetadata


def test_peers_match_the_model():
    cfg = ModelConfig(vocab_size=300, hidden_size=96, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=5e5,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    model = build_empty(cfg, torch.float32, torch.device("cpu"))
    init_dummy_weights(model, seed=int(torch.randint(1000, ())))
    for p in model.parameters():  # larger weights than the init, so that differences would show
        p.mul_(5)
    prompt = torch.randint(cfg.vocab_size, (1, 23))
    with torch.inference_mode():
        ours = model.compute_logits(model(prompt[0], AttentionMetadata.prefill([23])))
        hf = to_transformers(model)(prompt).logits[0].float()
        assert rel_err(hf, ours) < 1e-5
        net = StaticLlama(model, batch=1, max_len=40)
        assert rel_err(net(prompt[:, :20], torch.arange(20))[0], ours[:20]) < 1e-5
        for pos in range(20, 23):  # decode steps through the static cache
            assert rel_err(net(prompt[:, pos:pos + 1], torch.tensor([pos]))[0, 0], ours[pos]) < 1e-5
        assert greedy_step(net, prompt[:, 22:23], torch.tensor([22])).item() == ours[22].argmax().item()
