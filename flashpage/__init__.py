"""flashpage: a small, fast LLM inference engine for Llama-family models."""

from flashpage.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestMetrics,
                               RequestOutput)
from flashpage.sampling_params import (BeamSearchParams, GuidedDecodingParams, SamplingParams,
                                      StructuredOutputsParams)

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput",
           "GuidedDecodingParams", "Logprob", "RequestMetrics", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM is imported on first use: it brings PyTorch and the kernels (seconds), which a client such as
    # `flashpage bench serve` does not need
    if name == "LLM":
        from flashpage.engine.llm import LLM
        return LLM
    raise AttributeError(f"module 'flashpage' has no attribute {name!r}")
