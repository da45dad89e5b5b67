"""Drafters: the sources of SpecEE's speculative tokens."""
from .base import Drafter, DrafterMismatchError, check_same_tokenizer, frequency_shortlist
from .draft_model import DraftModelDrafter
from .ngram import NGramDrafter

__all__ = ["Drafter", "DrafterMismatchError", "check_same_tokenizer", "frequency_shortlist", "DraftModelDrafter", "NGramDrafter"]
