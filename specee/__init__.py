"""specee: faster decoding of Hugging Face causal LMs by speculative early exiting."""
from .exit.config import EarlyExitConfig
from .engine.llm import LLM
from .engine.sequence import RequestOutput, RequestStats
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "EarlyExitConfig", "RequestOutput", "RequestStats"]
__version__ = "0.1.0"
