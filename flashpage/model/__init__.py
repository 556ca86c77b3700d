from flashpage.model.attention import AttentionMetadata, TorchAttentionBackend
from flashpage.model.llama import LlamaForCausalLM

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "TorchAttentionBackend"]
