"""What the kernels ask of the CUDA device."""

from __future__ import annotations

import functools
import os

import torch


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a device without an index: the current one)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache
def _sm_count(device_index: int) -> int:
    """(cached: the query is slow)"""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, as the tests do): some conversions and
    products differ there, and no PTX runs."""
    return os.environ.get("TRITON_INTERPRET") == "1"
