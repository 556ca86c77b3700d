"""flashpage: a small, fast LLM inference engine for Llama-family models."""

from flashpage.engine.llm import LLM
from flashpage.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestMetrics,
                               RequestOutput)
from flashpage.sampling_params import (BeamSearchParams, GuidedDecodingParams, SamplingParams,
                                      StructuredOutputsParams)

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput",
           "GuidedDecodingParams", "Logprob", "RequestMetrics", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
__version__ = "0.1.0"
