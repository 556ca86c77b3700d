"""Training Medusa heads on a frozen target (Medusa-1), written in Medusa's own checkpoint layout.

Head i learns the token i + 2 places after each position from the target's final-normed hidden state there (the
target's own head gives the token 1 place after). Heads start as Medusa's do: residual blocks at zero (the
identity) and the target's vocabulary projection, so an untrained head already guesses what the target would
draw next. The loss is the heads' cross-entropies weighted 0.8^i (Medusa's). Train on the target's own outputs
(self-distillation, as the Medusa paper recommends where the training data is not the model's): the heads then
learn what the model will say. Small enough for a CPU: tests train tiny heads in a second, and
`flashpage bench spec medusa` trains SmolLM2's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from flashpage.engine.spec.medusa import MedusaHeads
from flashpage.kernels.reference import rms_norm
from flashpage.model import AttentionMetadata


@torch.no_grad()
def target_features(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The target's final-normed hidden state at every position of each sequence (float32, one forward each)."""
    out = []
    for tokens in sequences:
        ids = torch.tensor(tokens, device=model.embed_tokens.weight.device)
        h = model(ids, AttentionMetadata.prefill([len(tokens)]), None).float()
        out.append(rms_norm(h, model.norm.weight.float(), model.norm.eps))
    return out


def train_medusa(model, sequences: list[list[int]], num_heads: int, num_layers: int = 1, steps: int = 300,
                 batch: int = 512, lr: float = 1e-3, train_lm_head: bool = False, seed: int = 0) -> MedusaHeads:
    """Heads for `model` (a LlamaForCausalLM) trained on token `sequences` (float32, on the model's device)."""
    gen = torch.Generator().manual_seed(seed)
    c = model.config
    feats = target_features(model, sequences)
    x = torch.cat([f[:len(f) - 1 - num_heads] for f in feats if len(f) > num_heads + 1])
    targets = torch.cat([torch.stack([torch.tensor(s[2 + i:len(s) - num_heads + 1 + i]) for i in range(num_heads)], 1)
                         for s in sequences if len(s) > num_heads + 1]).to(x.device)
    heads = MedusaHeads(c.hidden_size, c.vocab_size, num_heads, num_layers, shared_lm_head=False).to(x.device)
    lm = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    with torch.no_grad():
        for block in heads.blocks:
            for layer in block["layers"]:
                layer.weight.zero_()
                layer.bias.zero_()
        for head in heads.lm_heads:
            head.weight.copy_(lm.float())
            head.weight.requires_grad_(train_lm_head)
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    weights = torch.tensor([0.8**i for i in range(num_heads)], device=x.device)
    for _ in tqdm(range(steps), desc="Training Medusa heads", leave=False):
        pick = torch.randint(len(x), (min(batch, len(x)),), generator=gen).to(x.device)
        logits = heads(x[pick], num_heads)  # [heads, B, V]
        loss = sum(w * F.cross_entropy(logits[i], targets[pick, i]) for i, w in enumerate(weights))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


def save_medusa(heads: MedusaHeads, path: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """Write `heads` in Medusa's own layout: config.json and medusa_lm_head.safetensors (tensors in `dtype`)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    num_layers = len(heads.blocks[0]["layers"])
    tensors = {}
    for i, block in enumerate(heads.blocks):
        for j, layer in enumerate(block["layers"]):
            tensors[f"{i}.{j}.linear.weight"] = layer.weight
            tensors[f"{i}.{j}.linear.bias"] = layer.bias
        tensors[f"{i}.{num_layers}.weight"] = heads.lm_heads[i].weight
    save_file({k: v.detach().to(dtype).cpu().contiguous() for k, v in tensors.items()},
              path / "medusa_lm_head.safetensors")
    hidden, vocab = heads.lm_heads[0].weight.shape[1], heads.lm_heads[0].weight.shape[0]
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": len(heads.blocks),
                                                  "medusa_num_layers": num_layers, "hidden_size": hidden,
                                                  "vocab_size": vocab}, indent=1))
