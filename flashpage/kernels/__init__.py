"""Kernel sets: modules with the same functions, `reference` (plain PyTorch), `cpu` (the references, batched where
that is faster on a CPU) and `triton_ops` (Triton)."""

from __future__ import annotations

import importlib

KERNEL_SETS = {"torch": "flashpage.kernels.reference", "cpu": "flashpage.kernels.cpu",
               "triton": "flashpage.kernels.triton_ops"}


def kernel_set(name: str):
    """The module of kernels called `name` ('torch', 'cpu' or 'triton')."""
    if name not in KERNEL_SETS:
        raise ValueError(f"kernels {name!r} is not one of {', '.join(KERNEL_SETS)}")
    return importlib.import_module(KERNEL_SETS[name])
