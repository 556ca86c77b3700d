"""The Triton kernels under the names the model and sampler call (same signatures as `reference`)."""

from flashpage.kernels.activation import silu_and_mul
from flashpage.kernels.attention import flash_attn_varlen, paged_attention
from flashpage.kernels.cache import reshape_and_cache
from flashpage.kernels.norm import rms_norm
from flashpage.kernels.rotary import rope_and_cache
from flashpage.kernels.sampling import apply_penalties, sample

__all__ = ["apply_penalties", "flash_attn_varlen", "paged_attention", "reshape_and_cache", "rms_norm",
           "rope_and_cache", "sample", "silu_and_mul"]
