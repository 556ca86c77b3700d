"""FP8 weights (`quantization="fp8"`): the decoder layers' projections hold e4m3 weights and one float32 scale per
output feature (`weight_scale`); the embedding, the LM head and the norms stay in the model's dtype.

A 16/32-bit checkpoint is quantized as it loads, each weight row by its own largest magnitude (row by row also
under tensor parallelism, where a rank holds part of a row). A pre-quantized checkpoint in the layout vLLM reads
(config.json `quantization_config.quant_method: "fp8"`, tensors `weight` in e4m3 plus `weight_scale`, per tensor
or per output feature) loads as it is; its static `input_scale`s are not used: activations are always scaled
per token, at run time (`flashpage.kernels.fp8`).

Quantizing as it loads, each RMSNorm's gain is first multiplied into the columns of the projections its output
feeds (Q/K/V, gate/up), and the norm keeps a gain of ones: the same function, but the gain's large channels are
quantized with the weights (row by row, where they get their share of each row's range) instead of widening every
token's activations before they are quantized (what that saves on SmolLM2: docs/kernel-notes.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from flashpage.kernels.fp8 import FP8, quantize_rows

# Checkpoint tensors of FP8 layouts that flashpage does not use (static activation scales).
UNUSED_TENSORS = (".input_scale",)


def use_fp8_weights(model: nn.Module) -> None:
    """Give each projection of the decoder layers an e4m3 weight and a float32 `weight_scale` [out features] (on
    the meta device, before the model is allocated)."""
    for module in model.layers.modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(torch.empty_like(module.weight, dtype=FP8), requires_grad=False)
            module.weight_scale = nn.Parameter(torch.empty(module.weight.shape[0], dtype=torch.float32,
                                                           device=module.weight.device), requires_grad=False)


def place(dest: torch.Tensor, src: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Copy checkpoint data into (part of) a parameter; into an FP8 weight from a wider one, quantize it row by
    row, writing the rows' scales into `scale`."""
    if dest.dtype == FP8 and src.dtype != FP8:
        q, s = quantize_rows(src.to(dest.device))
        dest.copy_(q)
        scale.copy_(s)
    else:
        dest.copy_(src)


def fold_norm_gains(weights: Iterable[tuple[str, torch.Tensor]], norm_of: dict[str, str],
                    device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each norm in `norm_of`'s values replaced by ones and its gain multiplied into
    the columns of the projection weights `norm_of` maps to it (float32, on `device`, to be quantized there); a
    projection that comes before its norm waits for it. ValueError for a projection already stored in FP8."""
    norms = set(norm_of.values())
    gains: dict[str, torch.Tensor] = {}
    waiting: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in weights:
        if name in norm_of and tensor.dtype == FP8:
            raise ValueError(f"tensor {name!r} is stored in FP8 but the checkpoint's config.json declares no "
                             f"quantization_config (quant_method 'fp8')")
        if name in norms:
            gains[name] = gain = tensor.to(device, torch.float32)
            yield name, torch.ones_like(tensor)
            for proj, t in waiting.pop(name, []):
                yield proj, _times_columns(t, gain)
        elif name in norm_of and norm_of[name] in gains:
            yield name, _times_columns(tensor, gains[norm_of[name]])
        elif name in norm_of:
            waiting.setdefault(norm_of[name], []).append((name, tensor))
        else:
            yield name, tensor
    for held in waiting.values():  # their norm never came: the missing norm is reported by name
        yield from held


def _times_columns(weight: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """weight * gain[None, :] in float32 on gain's device; a weight of the wrong width is left for the loader's
    shape check to name."""
    if weight.dim() != 2 or weight.shape[1] != gain.shape[0]:
        return weight
    return weight.to(gain.device, torch.float32) * gain


def load_scale(dest: torch.Tensor, tensor: torch.Tensor, full_rows: int, start: int) -> None:
    """A checkpoint's `weight_scale` (one for the tensor, or one per output feature: [N] or [N, 1]; or per output
    feature and group of inputs, dest's shape but N rows: `flashpage.model.gguf_blocks`) into the scales of rows
    [start, start + len(dest)) of its N."""
    if dest.dim() > 1:
        if tuple(tensor.shape) != (full_rows, *dest.shape[1:]):
            raise ValueError(f"has shape {tuple(tensor.shape)}, expected {(full_rows, *dest.shape[1:])}")
        dest.copy_(tensor[start:start + dest.shape[0]])
        return
    t = tensor.float().reshape(-1)
    if t.numel() == 1:
        dest.copy_(t.expand(dest.shape[0]))
    elif t.numel() == full_rows:
        dest.copy_(t[start:start + dest.shape[0]])
    else:
        raise ValueError(f"has {t.numel()} scales, expected 1 or {full_rows}")
