from flashpage.model.attention import AttentionBackend, AttentionMetadata
from flashpage.model.llama import LlamaForCausalLM

__all__ = ["AttentionBackend", "AttentionMetadata", "LlamaForCausalLM"]
