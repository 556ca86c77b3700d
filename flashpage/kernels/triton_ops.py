"""The Triton kernels under the names the attention backend calls (same signatures as `reference`)."""

from flashpage.kernels.attention import flash_attn_varlen, paged_attention
from flashpage.kernels.cache import reshape_and_cache

__all__ = ["flash_attn_varlen", "paged_attention", "reshape_and_cache"]
