"""Kernel sets: modules with the same functions, `reference` (plain PyTorch), `cpu` (the references, batched where
that is faster on a CPU), `triton_ops` (Triton) and `batch_invariant` (Triton, reductions in an order that does
not depend on the batch: the deterministic mode)."""

from __future__ import annotations

import importlib

KERNEL_SETS = {"torch": "flashpage.kernels.reference", "cpu": "flashpage.kernels.cpu",
               "triton": "flashpage.kernels.triton_ops", "batch_invariant": "flashpage.kernels.batch_invariant"}


def kernel_set(name: str):
    """The module of kernels called `name` ('torch', 'cpu', 'triton' or 'batch_invariant')."""
    if name not in KERNEL_SETS:
        raise ValueError(f"kernels {name!r} is not one of {', '.join(KERNEL_SETS)}")
    return importlib.import_module(KERNEL_SETS[name])
