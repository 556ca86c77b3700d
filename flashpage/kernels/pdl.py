"""Programmatic dependent launch (sm_90 and later). A kernel launched with it (`launch_pdl`) may start while the
kernel before it in the stream is still running, once every program of that one has called `release_next` (or
exited); it must call `wait_for_previous` before it reads or writes anything another kernel writes or reads.

The decode step's kernels (norms, the linear layers at decode sizes, RoPE + cache write, attention and its split
merge) all launch this way: each releases the next as soon as it has waited (a linear layer once its loop
over the weight is done, so that the next kernel's programs do not take the shared memory its own later programs
need), so launching the next kernel is off the critical path, and a linear layer's programs ask L2 for the first
columns of their weight, which no kernel writes, while the kernel before them runs (an H200's batch-1 FP8 decode
step: 3.30 -> 3.09 ms, docs/kernel-notes.md). FLASHPAGE_PDL=0 turns it off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from flashpage.kernels.device import interpreting


@functools.lru_cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL: a CUDA GPU of sm_90 or later, not under the interpreter."""
    if device.type != "cuda" or interpreting() or os.environ.get("FLASHPAGE_PDL") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at `ptrs`, without waiting for them."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                              pack=1)
