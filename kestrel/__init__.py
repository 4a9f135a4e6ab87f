"""Kestrel: an LLM inference and serving engine with explicit, typed execution contracts."""

from kestrel.logs import configure_logging

configure_logging()

from kestrel.engine.llm import LLM  # noqa: E402
from kestrel.engine.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from kestrel.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
