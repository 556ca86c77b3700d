from flashpage.model.attention import AttentionMetadata
from flashpage.model.llama import LlamaForCausalLM

__all__ = ["AttentionMetadata", "LlamaForCausalLM"]
