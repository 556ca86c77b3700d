"""flashpage: a small, fast LLM inference engine for Llama-family models."""

from flashpage.engine.llm import LLM
from flashpage.outputs import CompletionOutput, RequestOutput
from flashpage.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
