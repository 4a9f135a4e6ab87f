"""Kestrel: an LLM inference and serving engine with explicit, typed execution contracts."""

from kestrel.engine.llm import LLM
from kestrel.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kestrel.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
