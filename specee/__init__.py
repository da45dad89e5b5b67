"""specee: faster decoding of Hugging Face causal LMs by speculative early exiting."""
from .engine.llm import LLM
from .engine.sequence import RequestOutput, RequestStats
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestStats"]
__version__ = "0.1.0"
